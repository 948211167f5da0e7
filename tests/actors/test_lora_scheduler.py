"""The scheduler with LoRA adapters (real KV manager, paged fake model): the running sequences never
read more adapters than there are slots (the others wait, then run), the worker learns each new
sequence's adapter, and the prefix cache is keyed by adapter."""
from __future__ import annotations

import dataclasses

from actors.messages.front_end import SamplingParams, SubmitRequest
from tests.actors.test_scheduler import Harness, prompts, reference


def lora_harness(max_loras: int, **kw) -> Harness:
    h = Harness(**kw)
    h.scheduler.cfg = dataclasses.replace(h.scheduler.cfg, max_loras=max_loras)
    return h


def submit(h: Harness, rid: str, prompt: list[int], lora: str | None, max_tokens: int = 6, **kw) -> None:
    h.scheduler.add(SubmitRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), "client", lora_name=lora, **kw))
    h._collect()


def test_running_sequences_read_at_most_max_loras_adapters_and_the_rest_wait():
    h = lora_harness(2, budget=256)
    ps = prompts(8, lo=3, hi=20)
    names = ["a", "b", "c", None, "a", "c", "b", None]
    for i, (p, name) in enumerate(zip(ps, names)):
        submit(h, f"r{i}", p, name)
    adapter_of: dict[int, str | None] = {}
    for _ in range(200):
        if not h.scheduler.has_work():
            break
        plan = h.step()
        adapter_of.update({n.seq_id: n.lora_name for n in plan.new_seqs})
        running = {adapter_of[s.seq_id] for s in plan.seqs} - {None}
        assert len(running) <= 2, running
    for i, p in enumerate(ps):
        assert h.outputs[(f"r{i}", 0)] == reference(p, 6)
    assert sorted(n for n in adapter_of.values() if n) == sorted(n for n in names if n)
    assert dict(h.scheduler.counters.lora_requests) == {"a": 2, "b": 2, "c": 2}
    h.assert_all_free()


def test_the_prefix_cache_is_keyed_by_adapter():
    h = lora_harness(4, budget=256)
    prompt = prompts(2, lo=40, hi=40)[0]   # ten full blocks of 4
    hits = []
    for rid, lora in (("first", "a"), ("same", "a"), ("other", "b"), ("base", None), ("base-again", None)):
        before = h.scheduler.counters.prefix_cache_hit_tokens
        submit(h, rid, prompt, lora)
        h.run()
        hits.append(h.scheduler.counters.prefix_cache_hit_tokens - before)
    assert hits == [0, 36, 0, 0, 36]   # a hit is capped to leave the last block's tokens to compute
    h.assert_all_free()


def test_a_request_with_an_adapter_is_not_handed_over():
    h = lora_harness(2)
    submit(h, "r", prompts(2, lo=5, hi=5)[0], "a", handoff_to="decode-engine")
    assert h.scheduler.requests["r"].handoff_to is None
    h.run()
    assert h.finish[("r", 0)] == "length"
