"""A sequence's own rules (actors/scheduler/sequence.py): where a step's tokens stop it, and which of
its request's sampling params the worker's sampler gets."""
from __future__ import annotations

from actors.messages.front_end import SamplingParams
from actors.scheduler.sequence import RequestState, Sequence

EOS = frozenset({99})


def sequence(index: int = 0, **params) -> Sequence:
    req = RequestState("r", [1, 2, 3], SamplingParams(**params), "client", 0, 1, None, 64)
    return Sequence(index, req, index)


def test_a_steps_tokens_are_kept_up_to_the_first_that_ends_the_sequence():
    seq = sequence(max_tokens=10, stop_token_ids=[7])
    assert seq.extend([4, 5], EOS) == (2, None) and seq.output_token_ids == [4, 5]
    assert seq.extend([6, 7, 8], EOS) == (2, "stop") and seq.output_token_ids == [4, 5, 6, 7]   # 8 is dropped
    assert sequence().extend([], EOS) == (0, None)


def test_the_length_and_min_tokens_decide_as_the_single_token_rule_does():
    short = sequence(max_tokens=2)
    assert short.extend([4, 5, 6], EOS) == (2, "length")
    held = sequence(max_tokens=5, min_tokens=2)
    assert held.extend([99, 99, 99], EOS) == (2, "stop")   # the first EOS is held off, the second ends it
    ignored = sequence(max_tokens=3, ignore_eos=True)
    assert ignored.extend([99, 99, 99], EOS) == (3, "length")


def test_only_sample_0_asks_the_sampler_for_the_prompts_logprobs():
    assert sequence(0, prompt_logprobs=2).worker_params().prompt_logprobs == 2
    other = sequence(1, prompt_logprobs=2, seed=5).worker_params()
    assert other.prompt_logprobs is None and other.seed == 5
    plain = sequence(1)
    assert plain.worker_params() is plain.request.params
