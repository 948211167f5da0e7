"""Multi-LoRA greedy parity through the whole engine against transformers + peft, in float32.

A tiny random Llama and Qwen2 with three PEFT adapters (all seven projections at rank 8; q, v and o
at rank 4 with rsLoRA; the MLP and k at rank 16): each adapter alone, then all three mixed in one
batch with base-model requests, and with fewer slots than adapters (requests wait for a slot and
adapters are swapped in and out). The same prompt under two adapters, or under two contents of one
adapter name, never shares cached KV.
"""
from __future__ import annotations

import random

import pytest

from actors import LLM, SamplingParams
from tests.actors.conftest import TINY_VOCAB
from tests.actors.lora_adapters import ADAPTERS, make_adapter, peft_greedy

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
ARCHS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """arch -> (base folder, {adapter name: folder}, {adapter name or None: reference tokens})."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (3, 17, 40)]
    built = {}
    for arch in ARCHS:
        base = tiny_model_dir(arch)
        folders = {name: make_adapter(base, str(tmp_path_factory.mktemp(f"lora-{arch}-{name}")), name, seed=i)
                   for i, name in enumerate(ADAPTERS)}
        want = {name: peft_greedy(base, folders.get(name), prompts, NUM_NEW) for name in (None, *ADAPTERS)}
        built[arch] = (base, folders, want, prompts)
    return built


def modules(folders: dict[str, str]) -> list[str]:
    return [f"{name}={path}" for name, path in folders.items()]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_adapter_alone_and_all_mixed_match_peft(arch, models):
    base, folders, want, prompts = models[arch]
    assert all(want[name] != want[None] for name in ADAPTERS)   # every adapter changes the output
    # 24-token steps: prompts go in chunks beside other sequences' decodes.
    with LLM(base, dtype="float32", num_threads=1, num_blocks=64, lora_modules=modules(folders),
             max_loras=3, max_lora_rank=16, max_num_batched_tokens=24) as llm:
        for name in ADAPTERS:
            outs = llm.generate(prompts, GREEDY, lora_request=name)
            assert [o.outputs[0].token_ids for o in outs] == want[name], name
        # Every prompt under every adapter and the base model, in one batch.
        names = [None, *ADAPTERS]
        batch = [(p, name) for name in names for p in prompts]
        random.Random(1).shuffle(batch)
        outs = llm.generate([p for p, _ in batch], GREEDY, lora_request=[n for _, n in batch])
        for (p, name), out in zip(batch, outs):
            assert out.outputs[0].token_ids == want[name][prompts.index(p)], name
        stats = llm.stats()
        assert stats.lora_requests == {name: 2 * len(prompts) for name in ADAPTERS}
        assert stats.kv_blocks_free == stats.kv_blocks_total


def test_fewer_slots_than_adapters_requests_wait_for_one(models):
    """Three adapters over two slots, in a KV pool small enough to preempt: had a step held all three,
    the worker would have failed it; a preempted sequence recomputes under its own adapter."""
    base, folders, want, prompts = models["llama"]
    with LLM(base, dtype="float32", num_threads=1, block_size=8, num_blocks=14, lora_modules=modules(folders),
             max_loras=2, max_lora_rank=16, max_num_batched_tokens=32, enable_prefix_caching=False) as llm:
        names = [*ADAPTERS, None] * 2
        outs = llm.generate([prompts[2]] * len(names), GREEDY, lora_request=names)
        assert [o.outputs[0].token_ids for o in outs] == [want[n][2] for n in names]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert llm.stats().preemptions > 0


def test_same_prompt_under_two_adapters_shares_no_kv(models):
    base, folders, want, prompts = models["llama"]
    with LLM(base, dtype="float32", num_threads=1, num_blocks=64, lora_modules=modules(folders),
             max_loras=3, max_lora_rank=16) as llm:
        prompt = prompts[2]   # 40 tokens: two full blocks that a second run could reuse
        first = llm.generate([prompt], GREEDY, lora_request="all")[0]
        again = llm.generate([prompt], GREEDY, lora_request="all")[0]
        other = llm.generate([prompt], GREEDY, lora_request="attn")[0]
        plain = llm.generate([prompt], GREEDY)[0]
        assert again.num_cached_tokens == 32     # the same adapter reads its own cache
        assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
        assert other.outputs[0].token_ids == want["attn"][2]
        assert plain.outputs[0].token_ids == want[None][2]
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == want["all"][2]


def test_a_name_reloaded_with_other_weights_never_reads_their_kv(models):
    """The prefix cache knows an adapter by its contents, not its name: under a name unloaded and loaded
    again from another folder, the same prompt is computed anew, with the new weights."""
    base, folders, want, prompts = models["llama"]
    prompt = prompts[2]   # 40 tokens: two full blocks that a stale key would serve
    with LLM(base, dtype="float32", num_threads=1, num_blocks=64, enable_lora=True, max_loras=1,
             max_lora_rank=16) as llm:
        llm.load_lora("tuned", folders["attn"])
        first = llm.generate([prompt], GREEDY, lora_request="tuned")[0]
        llm.unload_lora("tuned")
        llm.load_lora("tuned", folders["all"])
        reloaded = llm.generate([prompt], GREEDY, lora_request="tuned")[0]
        again = llm.generate([prompt], GREEDY, lora_request="tuned")[0]
        assert first.outputs[0].token_ids == want["attn"][2]
        assert reloaded.num_cached_tokens == 0 and reloaded.outputs[0].token_ids == want["all"][2]
        assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == want["all"][2]


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_speculative_decoding_with_adapters_is_lossless(method, models):
    """The draft proposes for the base model; the target verifies under each sequence's adapter, so
    greedy tokens are the adapter's own (repetitive prompts: the n-gram draft proposes often)."""
    base, folders, want, prompts = models["llama"]
    rng = random.Random(9)
    periodic = [(lambda p: (p * 8)[:n])([rng.randrange(4, TINY_VOCAB) for _ in range(k)]) for n, k in ((30, 5), (44, 7))]
    names = [None, *ADAPTERS]
    refs = {name: peft_greedy(base, folders.get(name), periodic, NUM_NEW) for name in names}
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False, "disable_batch_size": None}
    if method == "layerskip":
        spec["draft_layers"] = 1
    with LLM(base, dtype="float32", num_threads=1, num_blocks=96, lora_modules=modules(folders), max_loras=3,
             max_lora_rank=16, speculative=spec) as llm:
        batch = [(p, name) for name in names for p in periodic]
        outs = llm.generate([p for p, _ in batch], GREEDY, lora_request=[n for _, n in batch])
        for (p, name), out in zip(batch, outs):
            assert out.outputs[0].token_ids == refs[name][periodic.index(p)], name
        assert llm.stats().spec_decode_draft_tokens > 0


def test_structured_output_with_an_adapter(models):
    """The grammar's mask applies to the adapter's logits: the output matches the pattern."""
    base, folders, want, prompts = models["llama"]
    from actors.messages.front_end import StructuredOutput

    with LLM(base, dtype="float32", num_threads=1, num_blocks=64, lora_modules=modules(folders),
             max_loras=3, max_lora_rank=16) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24, structured=StructuredOutput("choice", '["yes", "no"]'))
        out = llm.generate(["Hello world"], params, lora_request="all")[0].outputs[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_the_offline_api_loads_and_unloads_adapters(models, tmp_path):
    base, folders, want, prompts = models["qwen2"]
    with LLM(base, dtype="float32", num_threads=1, num_blocks=64, enable_lora=True, max_loras=1) as llm:
        with pytest.raises(ValueError, match="has no adapter_config.json"):
            llm.load_lora("empty", str(tmp_path))
        llm.load_lora("attn", folders["attn"])
        with pytest.raises(ValueError, match="already been loaded"):
            llm.load_lora("attn", folders["attn"])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request="attn")] == want["attn"]
        llm.unload_lora("attn")
        failed = llm.generate(prompts[:1], GREEDY, lora_request="attn")[0].outputs[0]
        assert failed.finish_reason == "error"
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want[None]
