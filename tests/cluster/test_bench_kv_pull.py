"""`bench.kv_pull --gateway` on a tiny model: conversations through real gateway and engine processes whose
turns round robin sends to both engines; with pulls each turn reuses what the other engine computed,
without them the engine computes it, and the replies agree."""
from __future__ import annotations

import shutil

import pytest

from bench import kv_pull

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama whose every output token is one of its tokenizer's: each reply goes back in the next prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.actors.conftest import build_tiny_model
    folder = build_tiny_model("llama", str(tmp_path_factory.mktemp("kv-pull-tiny")))
    m = AutoModelForCausalLM.from_pretrained(folder)
    m.resize_token_embeddings(len(AutoTokenizer.from_pretrained(folder)))
    m.save_pretrained(folder)
    return folder


def test_conversations_through_gateways_pull_the_prefix_their_other_engine_computed(model):
    out = kv_pull.main(["--gateway", "--model", model, "--dtype", "float32", "--batch-invariant",
                        "--conversations", "1", "--turns", "3", "--prompt-len", "64", "--user", "64",
                        "--reply", "4", "--vocab", "350", "--startup-timeout", "120", "--json"])
    pulled, computed = out["pulled"], out["computed"]
    assert out["same_tokens"]
    # Turns 2 and 3 land on the engine that did not serve the turn before, which holds at least four blocks
    # fewer of the prompt than the other: pulled, 2 pulls; else none.
    assert (pulled["pulls"], pulled["pull_failures"], computed["pulls"]) == (2, 0, 0)
    # Pulled: only each turn's new tokens (and the last partial block) are computed.
    assert pulled["cached_tokens"] >= pulled["prompt_tokens"] - 2 * (4 + 64 + 16)
    assert out["prefill_tokens_computed"]["computed"] > out["prefill_tokens_computed"]["pulled"]
    assert pulled["pulled_bytes"] > 0 and out["pull_bytes_per_reused_token"] > 0
