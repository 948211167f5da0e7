"""A disk KV tier across restarts of a real `matinee serve` process: the second process finds the
first one's blocks (cached_tokens > 0, the same greedy text); block files damaged between two runs
are discarded and the prompt computed, with the same text again."""
from __future__ import annotations

import os

import pytest

from tests.cluster import harness as h

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tier-tiny")))


def serve(model: str, tier: str, log: str) -> tuple[h.Node, str]:
    port = h.free_port()
    node = h.Node(["--role", "all", "--model", model, "--served-model-name", "tiny", "--dtype", "float32",
                   "--port", str(port), "--num-blocks", "24", "--max-num-batched-tokens", "128",
                   "--kv-offload-dir", tier], log).start()
    base = f"http://127.0.0.1:{port}"
    h.wait_until(lambda: h.http_json("GET", base + "/v1/models", timeout=2)[0] == 200, 180, "the server", [node])
    return node, base


def complete(base: str, prompt: str) -> tuple[str, int]:
    status, body = h.http_json("POST", base + "/v1/completions",
                               {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True})
    assert status == 200, body
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], details.get("cached_tokens", 0)


def test_a_restarted_engine_reloads_its_prefix_from_the_disk_tier(model, tmp_path):
    tier = str(tmp_path / "tier")
    prompt = " ".join(f"word{i}" for i in range(60))
    node, base = serve(model, tier, str(tmp_path / "first.log"))
    try:
        text, cached = complete(base, prompt)
        assert cached == 0
    finally:
        assert node.terminate() == 0
    assert os.listdir(os.path.join(tier, "blocks")), "the stopped engine left no blocks on disk"

    node, base = serve(model, tier, str(tmp_path / "second.log"))
    try:
        again, cached = complete(base, prompt)
        assert again == text and cached > 0
        assert h.metric(base, "matinee_kv_tier_hit_blocks_disk_total") == cached // 16
    finally:
        assert node.terminate() == 0

    blocks = os.path.join(tier, "blocks")
    for name in os.listdir(blocks):            # every file cut short, as a crash mid-write would
        path = os.path.join(blocks, name)
        os.truncate(path, os.path.getsize(path) // 2)
    node, base = serve(model, tier, str(tmp_path / "third.log"))
    try:
        third, cached = complete(base, prompt)
        assert third == text and cached == 0
        assert h.metric(base, "matinee_kv_tier_discarded_blocks_total") >= 1
        again, cached = complete(base, prompt)   # computed once more, its blocks serve from the pool
        assert again == text and cached > 0
    finally:
        assert node.terminate() == 0
