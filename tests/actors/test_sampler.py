"""The sampler: greedy, seeds across batch mixes, truncation, penalties, logprobs, distributions."""

import math

import pytest
import torch

from actors.messages.front_end import SamplingParams as Params
from actors.worker.sampler import Sampler, SamplingState, apply_penalties_

_sampler = Sampler()
sample = _sampler.sample
processed_probs = _sampler.processed_probs


def apply_penalties(logits, states, extra_output_ids=None):
    return apply_penalties_(logits.clone(), states, extra_output_ids)


def state(prompt=(), **kw) -> SamplingState:
    return SamplingState(Params(**kw), list(prompt))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (cells with p > 0)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the support was drawn"
    expected = probs[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw_counts(logits_row: torch.Tensor, num_samples: int, seed: int = 0, **kw) -> torch.Tensor:
    """Counts of `num_samples` independent draws (one batch of identical rows)."""
    states = [state(**kw)] * num_samples  # unseeded rows only read their state
    gen = torch.Generator().manual_seed(seed)
    tokens = sample(logits_row.expand(num_samples, -1), states, generator=gen).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel())


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.25, 1.2])


def test_greedy_is_argmax_and_an_all_greedy_batch_needs_no_randomness():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [state(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_ignores_top_k_top_p_but_sees_penalties():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    assert sample(logits, [state(temperature=0.0, top_k=1, top_p=0.1)]).token_ids == [0]
    penalized = state(prompt=[0], temperature=0.0, repetition_penalty=2.0)  # 3.0 -> 1.5
    assert sample(logits, [penalized]).token_ids == [1]


def test_seeded_rows_repeat_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    vocab = 300
    target_logits = torch.randn(vocab)
    kinds = [dict(), dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05, temperature=0.7),
             dict(top_k=50, top_p=0.8, presence_penalty=0.5)]
    for kind in kinds:
        runs = []
        for mix in range(3):
            me = state(prompt=[1, 2, 3], seed=1234, **kind)
            others = [state(temperature=0.0), state(top_p=0.5), state(seed=99, top_k=3), state()][:mix * 2]
            gen = torch.Generator().manual_seed(mix)  # unseeded rows differ per run
            tokens = []
            for _ in range(25):
                rows = others[:mix] + [me] + others[mix:]
                logits = torch.randn(len(rows), vocab, generator=gen)
                logits[mix] = target_logits
                tok = sample(logits, rows, generator=gen).token_ids[mix]
                me.append([tok])
                tokens.append(tok)
            runs.append(tokens)
        assert runs[0] == runs[1] == runs[2], kind
        assert len(set(runs[0])) > 3  # really sampling, not stuck on one token


def test_different_seeds_give_different_sequences():
    logits = torch.zeros(1, 1000)
    seqs = []
    for seed in (1, 2):
        s = state(seed=seed)
        seqs.append([sample(logits, [s]).token_ids[0] for _ in range(10)])
    assert seqs[0] != seqs[1]


def test_top_k_restricts_the_support_to_the_k_most_likely():
    counts = draw_counts(LOGITS, 4000, top_k=3)
    assert set(counts.nonzero().flatten().tolist()) == {0, 1, 9}
    probs = torch.softmax(LOGITS[[0, 1, 9]], dim=0)
    assert chi_square_p_value(counts[[0, 1, 9]], probs) > 1e-4


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]).log()
    for top_p, support in [(0.5, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3, 4})]:
        probs = processed_probs(logits.unsqueeze(0), [state(top_p=top_p)])[0]
        assert set(probs.nonzero().flatten().tolist()) == support, top_p
        expected = torch.zeros(5)
        idx = sorted(support)
        expected[idx] = torch.softmax(logits[idx], dim=0)
        assert torch.allclose(probs, expected, atol=1e-6)
    counts = draw_counts(logits, 4000, top_p=0.85)
    assert set(counts.nonzero().flatten().tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]).log()
    probs = processed_probs(logits.unsqueeze(0), [state(min_p=0.15)])[0]  # threshold 0.075
    assert set(probs.nonzero().flatten().tolist()) == {0, 1, 2}
    # min-p acts after temperature: at T=2 the distribution flattens and more tokens pass
    probs_hot = processed_probs(logits.unsqueeze(0), [state(min_p=0.15, temperature=2.0)])[0]
    assert set(probs_hot.nonzero().flatten().tolist()) == {0, 1, 2, 3, 4}


def test_top_p_on_a_flat_distribution_past_the_candidate_window():
    # 3,000 tokens, nearly flat: the nucleus holds far more than the 1,024 best candidates, so
    # the cut comes from sorting the row; a peaked row next to it stays on the fast path.
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3000, generator=gen) * torch.tensor([[0.1], [6.0]])
    params = [Params(top_p=0.9, top_k=2500), Params(top_p=0.9)]
    got = processed_probs(logits, [SamplingState(p, []) for p in params])
    for j in range(2):
        expected = reference_probs(logits[j], params[j], [], []).float()
        assert torch.equal(got[j] > 0, expected > 0)
        assert torch.allclose(got[j], expected, atol=1e-6)
    assert 1024 < int((got[0] > 0).sum()) < 2500
    alone = processed_probs(logits[:1], [SamplingState(params[0], [])])
    assert torch.equal(alone[0], got[0])  # a row's result never depends on its neighbours


def test_penalties_follow_the_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5, 3.0]])
    s = state(prompt=[0, 1], repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    s.append([2, 2, 4])
    got = apply_penalties(logits, [s])[0]
    expected = torch.tensor([
        2.0 / 2,                 # prompt token, positive: divided
        -1.0 * 2,                # prompt token, negative: multiplied
        0.5 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence
        1.0,                     # never seen
        -0.5 * 2 - 0.25 - 0.5,   # output once
        3.0,
    ])
    assert torch.allclose(got, expected)
    untouched = logits.clone()
    assert torch.equal(apply_penalties_(untouched, [state()]), logits)  # rows without penalties: no change


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(1, 4)
    got = apply_penalties(logits, [state(prompt=[1, 2], presence_penalty=1.0, frequency_penalty=1.0)])
    assert torch.equal(got, logits)


def test_penalties_only_touch_their_rows_and_count_extra_outputs():
    logits = torch.ones(3, 5)
    rows = [state(), state(frequency_penalty=1.0), state()]
    got = apply_penalties(logits, rows, extra_output_ids=[[], [3, 3], [1]])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1].tolist() == [1.0, 1.0, 1.0, -1.0, 1.0]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    rows = [state(logprobs=5, temperature=0.3, top_k=4, repetition_penalty=1.5, prompt=[0, 1]),
            state(temperature=0.0), state(logprobs=0, seed=3)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    top_vals, top_ids = raw[0].topk(5)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(top_vals.tolist(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == [] and out.logprobs[2].logprob == pytest.approx(raw[2, out.token_ids[2]].item())


def test_temperature_one_frequencies_match_softmax():
    # 20,000 draws over 10 tokens (9 degrees of freedom); p < 1e-4 fails a correct sampler
    # about once in 10,000 runs, while the wrong distribution below is rejected overwhelmingly.
    counts = draw_counts(LOGITS, 20_000, seed=11)
    assert chi_square_p_value(counts, torch.softmax(LOGITS, dim=0)) > 1e-4
    assert chi_square_p_value(counts, torch.softmax(LOGITS / 0.8, dim=0)) < 1e-6  # the test has power


def test_temperature_scales_the_distribution():
    counts = draw_counts(LOGITS, 20_000, seed=12, temperature=0.5)
    assert chi_square_p_value(counts, torch.softmax(LOGITS / 0.5, dim=0)) > 1e-4


def test_seeded_draws_follow_the_distribution_too():
    logits = LOGITS.unsqueeze(0)
    s = state(seed=2024)
    tokens = [sample(logits, [s]).token_ids[0] for _ in range(2_000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=10)
    assert chi_square_p_value(counts, torch.softmax(LOGITS, dim=0)) > 1e-4


def reference_probs(logits: torch.Tensor, p: Params, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """vLLM's pipeline written plainly, in float64, token by token, with a full sort for top-p."""
    x = logits.double().clone()
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outputs):
        x[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    if p.temperature < 1e-5:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    x = x / p.temperature
    probs = torch.softmax(x, dim=0)
    x[probs < p.min_p * probs.max()] = float("-inf")
    if p.top_k > 0:
        x[x < x.sort(descending=True).values[min(p.top_k, x.numel()) - 1]] = float("-inf")
    probs = torch.softmax(x, dim=0)
    ordered, order = probs.sort(descending=True)
    keep = int((ordered.cumsum(0) < p.top_p).sum()) + 1  # smallest top set holding top_p
    x[order[keep:]] = float("-inf")
    return torch.softmax(x, dim=0)


@pytest.mark.parametrize("seed", range(6))
def test_processed_probs_match_a_plain_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 700
    rows, params, prompts, outs = [], [], [], []
    for j in range(8):
        p = Params(temperature=[0.0, 0.5, 1.0, 1.7][j % 4], top_k=[0, 5, 300, 0][(j + seed) % 4],
                   top_p=[1.0, 0.9, 0.5, 0.97][(j * 3 + seed) % 4], min_p=[0.0, 0.0, 0.02, 0.3][(j + 2 * seed) % 4],
                   repetition_penalty=[1.0, 1.3][j % 2], frequency_penalty=[0.0, 0.4][(j // 2) % 2],
                   presence_penalty=[0.0, -0.3][(j + seed) % 2])
        prompt = torch.randint(vocab, (20,), generator=gen).tolist()
        out = torch.randint(vocab, (15,), generator=gen).tolist()
        s = SamplingState(p, prompt)
        s.append(out)
        rows.append(s)
        params.append(p)
        prompts.append(prompt)
        outs.append(out)
    logits = torch.randn(8, vocab, generator=gen) * torch.tensor([0.5, 2.0, 4.0, 8.0] * 2).unsqueeze(1)
    got = processed_probs(logits, rows)
    for j in range(8):
        expected = reference_probs(logits[j], params[j], prompts[j], outs[j]).float()
        assert torch.equal(got[j] > 0, expected > 0), (j, params[j])
        assert torch.allclose(got[j], expected, atol=1e-5), (j, params[j])


def test_processed_probs_is_what_sample_draws_from():
    st = state(top_p=0.9, temperature=0.8, frequency_penalty=0.3, repetition_penalty=1.5, prompt=[0])
    st.append([1, 1])
    p = processed_probs(LOGITS.unsqueeze(0), [st])[0]
    assert 0 < int((p > 0).sum()) < 10  # top-p cut something
    tokens = sample(LOGITS.expand(10_000, -1), [st] * 10_000, generator=torch.Generator().manual_seed(4)).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=10)
    assert chi_square_p_value(counts, p) > 1e-4
    greedy = processed_probs(LOGITS.unsqueeze(0), [state(temperature=0.0)])[0]
    assert greedy.tolist() == [1.0] + [0.0] * 9
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)


def test_the_callers_logits_are_left_alone():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    before = logits.clone()
    rows = [state(top_k=3), state(top_p=0.5, min_p=0.1), state(repetition_penalty=1.3, prompt=[1]),
            state(temperature=0.0)]
    sample(logits, rows)
    processed_probs(logits, rows)
    assert torch.equal(logits, before)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [state()])


def test_works_with_the_engine_sampling_params():
    messages = pytest.importorskip("actors.messages.front_end")
    params = messages.SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=2)
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(8))
    first = sample(logits, [SamplingState(params, [1, 2])])
    again = sample(logits, [SamplingState(params, [1, 2])])
    assert first.token_ids == again.token_ids and len(first.logprobs[0].top) == 2
    forked = SamplingState(params, [1, 2], seed=4)  # n > 1 copies get their own seed
    assert forked.generator.initial_seed() == 4


def test_logit_bias_and_min_tokens_shape_the_draw():
    """+100 makes a token the greedy choice, -100 removes the greedy one; min_tokens masks EOS and
    stop ids until the output is long enough, in sample and in processed_probs alike."""
    from actors.messages.front_end import SamplingParams as SP
    from actors.worker.sampler import Sampler as S, SamplingState as St
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    s = S()
    assert s.sample(logits, [St(SP(temperature=0, logit_bias={0: 100}), [1])]).token_ids == [0]
    assert s.sample(logits, [St(SP(temperature=0, logit_bias={1: -100}), [1])]).token_ids == [3]
    held = St(SP(temperature=0, min_tokens=2, eos_token_ids=[1], stop_token_ids=[3]), [1])
    assert s.sample(logits, [held]).token_ids == [2]
    assert s.processed_probs(logits, [held])[0].argmax() == 2
    assert s.processed_probs(logits, [held], [[2, 2]])[0].argmax() == 1   # drafted tokens count
    held.append([2, 2])
    assert s.sample(logits, [held]).token_ids == [1]
    random = St(SP(temperature=1.0, seed=0, min_tokens=5, eos_token_ids=[1]), [1])
    assert all(s.sample(logits, [random]).token_ids != [1] for _ in range(50))


def test_allowed_token_ids_limit_the_draw_to_them():
    """vLLM's allowed_token_ids: greedy picks the best allowed token, sampling never leaves them,
    and processed_probs (speculative verification) sees the same support."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 4.0]])
    only = state(temperature=0, allowed_token_ids=[0, 2, 3])
    assert sample(logits, [only]).token_ids == [3]
    assert processed_probs(logits, [only])[0].argmax() == 3
    sampled = state(temperature=1.0, seed=1, allowed_token_ids=[0, 2])
    assert {sample(logits, [sampled]).token_ids[0] for _ in range(100)} == {0, 2}
    probs = processed_probs(logits, [state(temperature=1.0, allowed_token_ids=[0, 2])])[0]
    assert probs[[1, 3, 4]].sum() == 0 and torch.allclose(probs[[0, 2]], torch.softmax(torch.tensor([0.0, 1.0]), 0))
    # The other rows of the batch are untouched.
    assert sample(logits.repeat(2, 1), [only, state(temperature=0)]).token_ids == [3, 1]


def test_bad_words_mask_a_words_last_token_after_the_rest_of_it():
    """A one-token bad word is never drawn; a longer one's last token is masked only where the
    output ends with the word's other tokens (drafted tokens count), as vLLM's bad_words."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 4.0]])
    assert sample(logits, [state(temperature=0, bad_words_token_ids=[[1]])]).token_ids == [4]
    word = state(temperature=0, bad_words_token_ids=[[2, 1]])
    assert sample(logits, [word]).token_ids == [1]        # not after 2: allowed
    word.append([2])
    assert sample(logits, [word]).token_ids == [4]        # after 2: masked
    assert processed_probs(logits, [word])[0][1] == 0
    fresh = state(temperature=0, bad_words_token_ids=[[3, 2, 1]])
    assert processed_probs(logits, [fresh], [[3, 2]])[0].argmax() == 4
    assert processed_probs(logits, [fresh], [[2, 2]])[0].argmax() == 1
    assert not word.plain_greedy and not state(temperature=0, allowed_token_ids=[1]).plain_greedy


def test_row_argmax_is_torchs_argmax_first_maximum_and_nan_included():
    from actors.worker.sampler import argmax_list, row_argmax

    x = torch.randn(5, 49152)
    x[1, 7] = x[1, 9] = 1e9             # a tie: the first one
    x[2, 300] = float("nan")            # NaN wins, as in torch
    x[3] = float("-inf")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(row_argmax(x[:, ::2]), x[:, ::2].argmax(dim=-1))   # a strided view
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    for v in (x, x[:, ::2], x.bfloat16()):
        assert argmax_list(v) == v.argmax(dim=-1).tolist()


def test_only_a_greedy_row_with_nothing_to_apply_takes_the_plain_argmax():
    """The sampler's shortest path skips penalties, bias, min_tokens, logprobs and grammars: any
    of them on a greedy row keeps that row (and its batch) on the full path."""
    assert state(temperature=0.0).plain_greedy
    for kw in (dict(), dict(temperature=0.7), dict(temperature=0.0, repetition_penalty=1.1),
               dict(temperature=0.0, frequency_penalty=0.5), dict(temperature=0.0, presence_penalty=0.5),
               dict(temperature=0.0, logprobs=0), dict(temperature=0.0, logit_bias={3: 5.0}),
               dict(temperature=0.0, min_tokens=2, eos_token_ids=[1])):
        assert not state(**kw).plain_greedy, kw
    assert not SamplingState(Params(temperature=0.0), [1], grammar=object()).plain_greedy
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 4.0]])
    plain, biased = state(temperature=0.0), state(temperature=0.0, logit_bias={3: 5.0})
    assert sample(logits, [plain, plain]) == ([2, 0], [None, None])
    assert sample(logits, [plain, biased]).token_ids == [2, 3]     # the batch leaves the shortest path


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_the_top_p_cut_is_the_whole_sorted_rows(top_p):
    """The cut found among the candidates (weights >= (1 - top_p) * total / vocab) is the one a
    sort of the whole row finds, on peaked, flat and tied rows; so is the accelerators' (its best
    1024 sorted on the device, the whole row where they hold too little), run here on the CPU."""
    from actors.worker.sampler import _top_p_cut, _top_p_cut_on_device, row_sums

    gen = torch.Generator().manual_seed(int(top_p * 1000))
    for scale in (0.1, 1.0, 4.0, 12.0):
        w = torch.softmax(torch.randn(6, 49152, generator=gen) * scale, dim=-1)
        w[5, :20000] = w[5, 0]                          # a tie across a wide plateau
        got = _top_p_cut(w, [state(top_p=top_p)] * 6).squeeze(1)
        assert torch.equal(got, _top_p_cut_on_device(w, [state(top_p=top_p)] * 6).squeeze(1))
        goals = row_sums(w).squeeze(1) * top_p     # summed as the sampler sums: the last bits depend on the order
        for j in range(6):
            row = w[j].sort(descending=True).values
            cumulative = row.cumsum(dim=0)
            want = row[int((cumulative < goals[j]).sum().clamp(max=row.numel() - 1))]
            assert got[j] == want, (scale, j)


def test_an_accelerators_rows_are_cut_where_they_are(monkeypatch):
    """Rows on a device other than the CPU never go through numpy (that would copy them to the host)."""
    from actors.worker import sampler

    seen = []
    monkeypatch.setattr(sampler, "_top_p_cut_on_device", lambda w, states: seen.append(w.device.type) or w[:, :1])
    sampler._top_p_cut(torch.empty(1, 10, device="meta"), [state(top_p=0.5)])
    assert seen == ["meta"]
