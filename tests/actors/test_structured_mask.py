"""The structured-output mask on a tiny tokenizer: a token the grammar refuses is never sampled,
whatever the logits favour, in plain sampling and in speculative verification (where the emitted
tokens still follow the masked target exactly)."""
import json

import pytest
import torch

from actors.messages.front_end import SamplingParams, StructuredOutput
from actors.worker.grammar_compiler import GrammarCompiler
from actors.worker.rejection_sampler import SpecSeq, verify_logits
from actors.worker.sampler import Sampler, SamplingState
from tests.actors.conftest import TINY_VOCAB, build_tiny_tokenizer
from tests.actors.test_rejection_sampler import _chi2, _chi2_critical

CHOICES = ["yes", "no way"]
SPEC = StructuredOutput("choice", json.dumps(CHOICES))
EOS = 2


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("mask-tok")))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(lambda: tok, TINY_VOCAB, [EOS])


def _state(compiler, temperature=1.0, seed=None):
    params = SamplingParams(temperature=temperature, seed=seed, structured=SPEC)
    return SamplingState(params, [1, 5, 7], grammar=compiler.state(SPEC))


def _first_tokens(tok) -> set[int]:
    """The tokens a choice can start with: the first of any tokenization of a prefix."""
    return {t for t in range(len(tok)) if (s := tok.decode([t])) and any(c.startswith(s) for c in CHOICES)}


def test_a_refused_token_is_never_sampled(tok, compiler):
    forbidden = tok.encode("x")[0]
    sampler, g = Sampler(), torch.Generator().manual_seed(0)
    allowed = _first_tokens(tok)
    assert forbidden not in allowed
    seen = set()
    for _ in range(200):
        # One constrained row beside a free one whose logits are the same: the free row shows the
        # forbidden token really is the one the logits favour.
        logits = torch.randn(1, TINY_VOCAB, generator=g).repeat(2, 1)
        logits[:, forbidden] = 40.0
        logits[:, EOS] = 25.0
        free = SamplingState(SamplingParams(temperature=1.0), [1, 5, 7])
        out = sampler.sample(logits, [_state(compiler), free], g).token_ids
        assert out[0] in allowed and out[1] == forbidden
        seen.add(out[0])
    assert len(seen) > 1   # drawn among the allowed, not one forced token
    greedy = sampler.sample(logits[:1], [_state(compiler, temperature=0.0)]).token_ids[0]
    assert greedy in allowed


def test_a_whole_sample_is_one_of_the_choices_and_ends_at_eos(tok, compiler):
    sampler, g = Sampler(), torch.Generator().manual_seed(1)
    for _ in range(20):
        state, out = _state(compiler), []
        while not state.grammar.terminated:
            logits = torch.randn(1, TINY_VOCAB, generator=g) * 4
            logits[0, EOS] = 10.0   # the model wants to stop at once: the grammar holds it off
            token = sampler.sample(logits, [state], g).token_ids[0]
            state.append([token])
            out.append(token)
        assert out[-1] == EOS and tok.decode(out[:-1]) in CHOICES


def _speculate(tok, compiler, drafts, q, seed):
    """One verification of `drafts` against random target logits; returns what was emitted."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(drafts) + 1, TINY_VOCAB, generator=g) * 2
    for j, d in enumerate(drafts):   # the target too would take every draft, refused ones included
        logits[j, d] = 30.0
    state = _state(compiler)
    probs = q.numpy().tobytes() if q is not None else b""
    emitted = verify_logits(Sampler(), logits, [SpecSeq(state, drafts, probs)], g)[0]
    return state, emitted, logits


def test_speculation_rejects_drafts_the_grammar_refuses(tok, compiler):
    yes, forbidden = tok.encode("yes"), tok.encode("x")[0]
    drafts = [yes[0], forbidden, yes[-1]]
    q = torch.zeros(len(drafts), TINY_VOCAB)
    q[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
    for seed in range(30):
        for draft_probs in (None, q):   # an n-gram's point mass, and a draft model's distribution
            state, emitted, _ = _speculate(tok, compiler, drafts, draft_probs, seed)
            assert forbidden not in emitted and len(emitted) <= 2
            state.append(emitted)   # raises if the grammar refuses any emitted token
            assert any(c.startswith(tok.decode(emitted)) for c in CHOICES)


def test_speculation_follows_the_masked_target(tok, compiler):
    """The first emitted token is distributed as the target masked by the grammar (chi-square)."""
    forbidden = tok.encode("x")[0]
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, TINY_VOCAB, generator=g)
    logits[0, forbidden] = 6.0
    bitmask = torch.full((1, (TINY_VOCAB + 31) // 32), -1, dtype=torch.int32)
    _state(compiler).grammar.fill_mask(bitmask, 0)
    allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(TINY_VOCAB)], dtype=torch.bool)
    target = torch.softmax(logits[0].masked_fill(~allowed, float("-inf")), dim=-1)
    q = torch.softmax(torch.randn(1, TINY_VOCAB, generator=g) * 2, dim=-1)
    q[0, forbidden] += 1.0   # the draft proposes the forbidden token half the time
    q /= q.sum()
    counts, sampler = torch.zeros(TINY_VOCAB), Sampler()
    for _ in range(3000):
        draft = int(torch.multinomial(q[0], 1, generator=g))
        state = _state(compiler)
        out = verify_logits(sampler, logits, [SpecSeq(state, [draft], q.numpy().tobytes())], g)[0]
        counts[out[0]] += 1
    assert counts[forbidden] == 0
    df = int((target > 0).sum()) - 1
    assert _chi2(counts, target) < _chi2_critical(df)


def test_a_structured_output_cannot_outlive_its_grammar():
    for extra in ({"ignore_eos": True}, {"min_tokens": 3}):
        with pytest.raises(ValueError, match="grammar"):
            SamplingParams(structured=SPEC, **extra)
