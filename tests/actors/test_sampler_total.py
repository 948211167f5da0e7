"""The sampler is total: for every SamplingParams the API accepts and any finite logits, it draws a
token inside the vocabulary with finite logprobs, and speculative verification emits only such
tokens. Extreme corners (a repetition penalty of 1e-45, logits at float32's limits) included.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from actors.messages.front_end import SamplingParams
from actors.worker.rejection_sampler import SpecSeq, verify_logits
from actors.worker.sampler import Sampler, SamplingState

_sampler = Sampler()
_TINY = [1e-45, 1e-38, 5e-324, 1e-300, 1e-5, 1.0000001e-5]  # penalties and temperatures at the edges


def sampling_params(vocab: int) -> st.SearchStrategy[SamplingParams]:
    unit = st.floats(0.0, 1.0)
    return st.builds(
        SamplingParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.0, 2.0), st.sampled_from(_TINY)),
        top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True)),
        top_k=st.integers(-1, vocab),
        min_p=st.one_of(st.just(0.0), unit),
        presence_penalty=st.floats(-2.0, 2.0),
        frequency_penalty=st.floats(-2.0, 2.0),
        repetition_penalty=st.one_of(st.floats(0.0, 2.0, exclude_min=True), st.sampled_from(_TINY)),
        logprobs=st.one_of(st.none(), st.integers(0, 20)),
        seed=st.one_of(st.none(), st.integers(0, 2**31)),
    )


@st.composite
def batches(draw, rows_per_state: int = 1):
    """(logits [rows, V], states): each state owns `rows_per_state` consecutive rows."""
    vocab = draw(st.integers(1, 1100))  # past the top-p candidate window (1024) too
    n = draw(st.integers(1, 4))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)
    states = []
    for _ in range(n):
        s = SamplingState(draw(sampling_params(vocab)), draw(tokens.filter(bool)))
        s.append(draw(tokens))
        states.append(s)
    scale = float(np.float32(draw(st.sampled_from([1.0, 30.0, 1e30, np.finfo(np.float32).max]))))
    logits = draw(arrays(np.float32, (n * rows_per_state, vocab), elements=st.floats(-scale, scale, width=32)))
    return torch.from_numpy(logits), states


def assert_finite_logprobs(lp, num: int | None, vocab: int) -> None:
    if num is None:
        assert lp is None
        return
    assert math.isfinite(lp.logprob) and lp.logprob <= 1e-6
    assert len(lp.top) == min(num, vocab)
    assert all(0 <= t < vocab and math.isfinite(v) for t, v in lp.top)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_sample_always_draws_a_token_in_the_vocabulary(batch):
    logits, states = batch
    vocab = logits.shape[1]
    out = _sampler.sample(logits, states, torch.Generator().manual_seed(0))
    for token, lp, s in zip(out.token_ids, out.logprobs, states):
        assert 0 <= token < vocab
        assert_finite_logprobs(lp, s.num_logprobs, vocab)
        if lp is not None:
            assert lp.token_id == token
    probs = _sampler.processed_probs(logits, states)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.double().sum(dim=-1), torch.ones(len(states), dtype=torch.float64), atol=1e-4)


@settings(max_examples=200, deadline=None)
@given(batches(rows_per_state=3), st.booleans(), st.data())
def test_verification_always_emits_tokens_in_the_vocabulary(batch, point_mass, data):
    logits, states = batch
    vocab, k = logits.shape[1], 2
    seqs = []
    for i, s in enumerate(states):
        if point_mass:  # an n-gram proposer: any token of the vocabulary
            drafts = data.draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
            seqs.append(SpecSeq(s, drafts))
            continue
        # A draft model: its own distributions over the same params, each draft drawn where q > 0.
        q = _sampler.processed_probs(torch.flip(logits[i * 3:i * 3 + k], dims=[1]), [s] * k)
        drafts = q.argmax(dim=-1).tolist()
        seqs.append(SpecSeq(s, drafts, q.numpy().tobytes()))
    emitted = verify_logits(_sampler, logits, seqs, torch.Generator().manual_seed(0))
    for out in emitted:
        assert 1 <= len(out) <= k + 1
        assert all(0 <= t < vocab for t in out)
