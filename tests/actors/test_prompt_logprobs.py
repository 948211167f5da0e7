"""Prompt logprobs through the engine's actors: every prompt token's logprob, rank and top k equal a
transformers forward over the whole prompt, across prefill chunks, for a prompt whose blocks the
prefix cache holds (such a request computes them anyway), and once per request with n > 1."""
from __future__ import annotations

import pytest
import torch

from actors.config import EngineConfig
from actors.engine import start_engine
from actors.messages.front_end import SamplingParams, SubmitRequest, TokenDeltas
from runtime import Actor, ActorSystem
from tests.actors.test_llm_parity import prompts

TOP = 3


class Collect(Actor):
    def __init__(self):
        self.deltas: dict[str, list] = {}
        self.done: dict[str, int] = {}

    async def receive(self, msg):
        assert isinstance(msg, TokenDeltas)
        for d in msg.deltas:
            self.deltas.setdefault(d.request_id, []).append(d)
            if d.finish_reason is not None:
                self.done[d.request_id] = self.done.get(d.request_id, 0) + 1


def hf_prompt_logprobs(folder: str, prompt: list[int]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)[:-1]   # row p: token p + 1


@pytest.fixture
async def engine(tiny_model_dir):
    system = ActorSystem("prompt-logprobs")
    await system.start()
    cfg = EngineConfig(model=tiny_model_dir("llama"), dtype="float32", num_threads=1, block_size=16,
                       num_blocks=64, max_num_batched_tokens=24)   # a 70-token prompt: 3 chunks
    eng = await start_engine(cfg, system)
    sink = Collect()
    ref = await system.spawn(sink, name="sink")
    yield eng, sink, ref
    await eng.stop()
    await system.shutdown()


async def _run(eng, sink, ref, request_id: str, prompt: list[int], params: SamplingParams):
    import asyncio

    eng.scheduler.tell(SubmitRequest(request_id, prompt, params, ref))
    for _ in range(600):
        if sink.done.get(request_id, 0) == params.n:
            return sink.deltas[request_id]
        await asyncio.sleep(0.05)
    raise TimeoutError(request_id)


async def test_prompt_logprobs_equal_a_full_forward(engine, tiny_model_dir):
    eng, sink, ref = engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
    prompt = prompts(3, lens=(70,))[0]
    want = hf_prompt_logprobs(tiny_model_dir("llama"), prompt)
    # The same prompt twice: the second finds every full block cached, and computes them anyway.
    for rid in ("first", "again"):
        deltas = await _run(eng, sink, ref, rid, prompt, params)
        carrying = [d for d in deltas if d.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is deltas[0]
        got = carrying[0].prompt_logprobs
        assert [lp.token_id for lp in got] == prompt[1:]
        for p, lp in enumerate(got):
            row = want[p]
            assert lp.logprob == pytest.approx(row[prompt[p + 1]].item(), abs=1e-4)
            assert lp.rank == int((row > row[prompt[p + 1]]).sum()) + 1
            assert [t for t, _ in lp.top] == row.topk(TOP).indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4)
        assert deltas[0].num_cached_tokens == 0   # read nothing from the cache
    plain = await _run(eng, sink, ref, "plain", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    assert plain[0].num_cached_tokens == 64 and all(d.prompt_logprobs is None for d in plain)


async def test_n_samples_get_the_prompt_logprobs_once(engine):
    eng, sink, ref = engine
    prompt = prompts(4, lens=(40,))[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    deltas = await _run(eng, sink, ref, "many", prompt, params)
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert [d.index for d in carrying] == [0]
    assert len(carrying[0].prompt_logprobs) == 39 and all(lp.top == [] for lp in carrying[0].prompt_logprobs)
    one = await _run(eng, sink, ref, "one", [7], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert one[0].prompt_logprobs == []   # one prompt token: nothing before it to predict it


def test_llm_returns_prompt_logprobs(tiny_model_dir):
    from actors import LLM

    prompt = prompts(6, lens=(20,))[0]
    want = hf_prompt_logprobs(tiny_model_dir("llama"), prompt)
    llm = LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=16)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    finally:
        llm.shutdown()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry[prompt[p + 1]] == pytest.approx(want[p][prompt[p + 1]].item(), abs=1e-4)
        assert int(want[p].argmax()) in entry


def test_a_rerun_chunk_computes_no_prompt_logprob_twice(tiny_model_dir):
    """The worker alone: a chunk run again from position 0 (a preempted sequence recomputes) adds
    nothing twice, and the logprobs go out once, with the first token."""
    from actors.messages.step import NewSequence, ScheduledSeq, StepPlan
    from actors.worker.model_runner import ModelRunner
    from actors.worker.worker_actor import WorkerActor

    prompt = prompts(7, lens=(37,))[0]
    want = hf_prompt_logprobs(tiny_model_dir("llama"), prompt)
    worker = WorkerActor(ModelRunner(tiny_model_dir("llama"), dtype="float32", num_blocks=8, num_threads=1), None)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    table = [0, 1, 2]
    first = StepPlan(0, [ScheduledSeq(0, prompt[:16], 0, table, False)], [NewSequence(0, prompt, params, None)])
    assert worker.step(first).outputs == []
    rerun = StepPlan(1, [ScheduledSeq(0, prompt[:20], 0, table, False)])   # from 0 again, 4 more
    assert worker.step(rerun).outputs == []
    last = worker.step(StepPlan(2, [ScheduledSeq(0, prompt[20:], 20, table, True)])).outputs[0]
    got = last.prompt_logprobs
    assert [lp.token_id for lp in got] == prompt[1:]
    assert [lp.logprob for lp in got] == pytest.approx([want[p][prompt[p + 1]].item() for p in range(36)], abs=1e-4)
    again = worker.step(StepPlan(3, [ScheduledSeq(0, [last.token_ids[0]], 37, table, True)])).outputs[0]
    assert again.prompt_logprobs is None and len(again.token_ids) == 1
