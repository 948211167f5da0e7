"""Structured outputs through the whole engine on a tiny random model: constrained and free
sequences in one batch, n > 1, preemptions (recomputed sequences keep their grammar state) and
n-gram speculation (drafts the grammar refuses are rejected); a grammar that does not compile
fails its own request alone."""
import re

import pytest

from actors import LLM, SamplingParams
from actors.messages.front_end import StructuredOutput
from tests.actors.test_llm_parity import prompts
from tests.actors.test_spec_engine import repetitive, spec_config

PATTERN = r"[a-z ]{1,40}\."


@pytest.mark.slow
def test_constrained_beside_free_with_preemption_and_speculation(tiny_model_dir):
    constrained = SamplingParams(temperature=1.0, n=2, max_tokens=48, seed=3,
                                 structured=StructuredOutput("regex", PATTERN))
    free = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=5)
    # Repetitive prompts: the n-gram proposer drafts prompt tokens, which the grammar mostly refuses.
    batch = [repetitive(n, 7, i) for i, n in enumerate((40, 55, 70, 85, 100, 62))]
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, block_size=16, num_blocks=24,
             max_num_batched_tokens=64, speculative=spec_config("ngram")) as llm:
        outs = llm.generate(batch, [constrained, free] * 3)
        stats = llm.stats()
    assert stats.preemptions > 0 and stats.spec_decode_draft_tokens > 0
    for out in outs[0::2]:
        assert len(out.outputs) == 2
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                assert re.fullmatch(PATTERN, sample.text), sample.text
            else:
                assert sample.finish_reason == "length" and re.fullmatch(r"[a-z ]*", sample.text)
    # The free sequences beside them are not held to the pattern.
    assert any(not re.fullmatch(r"[a-z .]*", out.outputs[0].text) for out in outs[1::2])


def test_a_grammar_that_does_not_compile_fails_alone(tiny_model_dir):
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "[a-z"))
    good = SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutput("choice", '["yes", "no"]'))
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=64) as llm:
        outs = llm.generate(prompts(1, (12, 20)), [bad, good])
    assert outs[0].outputs[0].finish_reason == "error"   # its detail is logged, not sent
    assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].text in ("yes", "no")


def test_a_grammar_that_compiles_too_slowly_fails_alone_and_is_served_once_compiled(tiny_model_dir, monkeypatch):
    """The step waits COMPILE_TIMEOUT_S for a grammar: past it, that sequence fails and the rest of
    the batch goes on; the compile finishes on its thread, and a later request for it is served."""
    import time

    from actors.worker import grammar_compiler

    monkeypatch.setattr(grammar_compiler, "COMPILE_TIMEOUT_S", 0.01)
    slow = StructuredOutput("regex", "(" + "|".join(f"x{i}y+" for i in range(5000)) + ")")
    big = SamplingParams(max_tokens=4, structured=slow)
    good = SamplingParams(temperature=0.0, max_tokens=8, structured=StructuredOutput("choice", '["yes", "no"]'))
    with LLM(tiny_model_dir("llama"), dtype="float32", num_threads=1, num_blocks=64) as llm:
        outs = llm.generate(prompts(1, (12, 20)), [big, good])
        assert outs[0].outputs[0].finish_reason == "error"
        assert outs[1].outputs[0].finish_reason == "stop" and outs[1].outputs[0].text in ("yes", "no")
        deadline = time.monotonic() + 60
        while True:   # the overrunning compile finishes on its own and replaces the error
            again = llm.generate(prompts(1, (12,)), [big])[0].outputs[0]
            if again.finish_reason != "error" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert again.finish_reason in ("stop", "length") and re.fullmatch(r"x\d*y*", again.text), again
