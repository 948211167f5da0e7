"""Lossless speculative sampling through the real draft and verify path, at a fixed context.

A layer-skip draft (1 of 3 layers of a random tiny model) disagrees with the target often. 256
copies of one context each draft 3 tokens and are verified in one target forward, p and q coming
from the sampler's own processed distributions; 16 rounds give 4,096 first emitted tokens. Their
counts must fit the target's distribution (chi-square, cells with at least 5 expected draws, the
rest pooled; the critical value is the 0.9999 quantile, so a correct sampler fails 1 run in 10^4).
The second token, drawn when the first draft was kept, must follow the target given the first.
"""

import math

import pytest
import torch

from actors.draft.messages import DraftInput, Propose
from actors.draft.proposer import ModelProposer
from actors.messages.front_end import SamplingParams
from actors.messages.step import NewSequence
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from actors.worker.rejection_sampler import SpecSeq, verify_logits
from actors.worker.sampler import Sampler, SamplingState

B, ROUNDS, K = 256, 16, 3
CONTEXT = [0, 17, 99, 230, 5, 61, 142, 8, 77, 300]


def chi2_critical(df: int, z: float = 3.719) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_test(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value); tokens with zero probability must never appear."""
    assert counts[probs == 0].sum() == 0, "a token the target cannot produce was emitted"
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir("llama"), dtype="float32", kernels="torch", block_size=16,
                       num_blocks=B + 4, num_threads=1)


def target_probs(runner, tokens, params):
    table = [B + 1, B + 2]
    logits = runner.execute(ForwardBatch([SequenceInput(list(tokens), 0, table)]))
    return Sampler().processed_probs(logits, [SamplingState(params, tokens)])[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_tokens=8),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8)],
                         ids=["temperature-1", "top-p-0.9"])
def test_emitted_tokens_follow_the_target(runner, params):
    c = CONTEXT
    # Every copy holds the context's KV but its last token, in its own block.
    runner.execute(ForwardBatch([SequenceInput(c[:-1], 0, [i], 0) for i in range(B)]))
    draft = ModelProposer(runner, runner.kv_caches[:1], shares_target_kv=True, seed=5)
    states = [SamplingState(params, c, seed=10_000 + i) for i in range(B)]
    sampler = Sampler()
    first, pairs, accepted = torch.zeros(384), {}, 0
    for r in range(ROUNDS):
        new = [NewSequence(i, c, params, i) for i in range(B)] if r == 0 else []
        items = [DraftInput(i, [c[-1]], len(c) - 1, [i], K) for i in range(B)]
        proposals = draft.step(Propose(r, items, new))
        assert all(len(p.token_ids) == K and p.probs for p in proposals)
        logits = runner.execute(ForwardBatch([SequenceInput([c[-1]] + p.token_ids, len(c) - 1, [i], K + 1)
                                              for i, p in enumerate(proposals)]))
        emitted = verify_logits(sampler, logits, [SpecSeq(s, p.token_ids, p.probs)
                                                  for s, p in zip(states, proposals)])
        for out in emitted:
            accepted += len(out) - 1
            first[out[0]] += 1
            if len(out) > 1:
                pairs.setdefault(out[0], torch.zeros(384))[out[1]] += 1
    rate = accepted / (B * ROUNDS * K)
    assert 0.1 < rate < 0.9, f"acceptance {rate:.2f}: the draft must disagree often, and not always"
    stat, critical = chi2_test(first, target_probs(runner, c, params))
    assert stat < critical, f"first token: chi2 {stat:.1f} >= {critical:.1f}"
    x, counts = max(pairs.items(), key=lambda kv: kv[1].sum())
    assert counts.sum() >= 300
    stat, critical = chi2_test(counts, target_probs(runner, c + [x], params))
    assert stat < critical, f"second token after {x}: chi2 {stat:.1f} >= {critical:.1f}"
