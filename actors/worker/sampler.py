"""Token sampling from a batch of logits, with vLLM's semantics and order of operations.

penalties (repetition over prompt+output, frequency and presence over output) -> logit_bias ->
min_tokens (EOS and stop ids masked while the output is shorter) -> allowed_token_ids (every other
token masked) -> bad words (a word's last token masked where the output ends with the rest of
it) -> the structured output's grammar mask (tokens it refuses get -inf, constrained rows only) -> greedy argmax,
or temperature -> min-p -> top-k -> top-p -> one draw. Logprobs are vLLM's default `raw_logprobs`:
log_softmax of the model's unmodified logits. `processed_probs` returns the exact distribution a
row is drawn from, so speculative decoding computes p and q with this same code.
Per-sequence state (params, seeded generator, output tokens) lives in `SamplingState`, kept by the
worker per sequence; a seed therefore gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_TOP_P_CANDIDATES = 1024  # top-p looks for its cut among this many best tokens before sorting a row
_FLOAT32_MAX = torch.finfo(torch.float32).max


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """x.sum(dim=-1, keepdim=True), on the CPU a row at a time: torch splits one row's sum over the threads but
    sums each of several rows alone, so a batched sum would round a row differently beside other rows."""
    if x.device.type != "cpu" or not x.shape[0]:
        return x.sum(dim=-1, keepdim=True)
    return torch.stack([row.sum() for row in x]).unsqueeze(1)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, dim=-1, keepdim=True), on the CPU a row at a time (row_sums says why)."""
    if x.device.type != "cpu" or not x.shape[0]:
        return torch.logsumexp(x, dim=-1, keepdim=True)
    return torch.stack([torch.logsumexp(row, dim=0) for row in x]).unsqueeze(1)


class SamplingState:
    """One sequence's sampling state on the worker.

    `params` is duck-typed on the SamplingParams contract (temperature, top_p, top_k, min_p,
    presence_penalty, frequency_penalty, repetition_penalty, seed, logprobs). `seed` overrides
    params.seed (n > 1 copies get distinct seeds). Call `append` with every token the sequence
    keeps, so the penalties see them and `grammar` (a GrammarState, for a structured output)
    advances over them.
    """

    def __init__(self, params: Any, prompt_token_ids: Sequence[int], seed: int | None = None,
                 device: torch.device | str = "cpu", grammar: Any = None) -> None:
        self.params = params
        self.grammar = grammar
        seed = params.seed if seed is None else seed
        self.generator = None if seed is None else torch.Generator(device).manual_seed(seed)
        self.output_token_ids: list[int] = []
        self.prompt_token_ids = torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)
        self.greedy = params.temperature < _EPS
        self.top_k = params.top_k if params.top_k > 0 else 0
        self.uses_top_p = params.top_p < 1.0
        self.uses_min_p = params.min_p > 0.0
        self.uses_penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                               or params.frequency_penalty != 0.0)
        self.num_logprobs: int | None = params.logprobs
        bias = params.logit_bias
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None
        self.min_tokens: int = params.min_tokens
        held = set(params.stop_token_ids) | set(params.eos_token_ids)
        self.min_tokens_ids = torch.tensor(sorted(held), dtype=torch.long, device=device) \
            if self.min_tokens and held else None
        allowed = getattr(params, "allowed_token_ids", None)
        self.allowed_ids = torch.tensor(sorted(set(allowed)), dtype=torch.long, device=device) if allowed else None
        self.bad_words: list[list[int]] = [list(w) for w in getattr(params, "bad_words_token_ids", ())]
        self.pool = None   # an embedding's PoolState (actors/worker/pooling.py), set by the worker
        # Prompt logprobs: top-k wanted at each prompt position; those computed so far, in order
        # (entry j for prompt token j + 1), until sent with the first sampled token.
        self.num_prompt_logprobs: int | None = getattr(params, "prompt_logprobs", None)
        self.prompt_logprobs: list[PromptLogprob] | None = [] if self.num_prompt_logprobs is not None else None
        # The argmax of the model's logits and nothing else: the sampler's shortest path.
        self.plain_greedy = (self.greedy and not self.uses_penalties and self.num_logprobs is None
                             and self.bias_ids is None and self.min_tokens_ids is None and grammar is None
                             and self.allowed_ids is None and not self.bad_words)

    def take_prompt_logprobs(self) -> list[PromptLogprob] | None:
        """The prompt's logprobs once all are computed (then never again), else None."""
        done = self.prompt_logprobs
        if done is None or len(done) < len(self.prompt_token_ids) - 1:
            return None
        self.prompt_logprobs = None
        return done

    def holds_off_stops(self, num_extra: int = 0) -> bool:
        """Whether EOS and stop ids are masked at the next position (`num_extra` drafted before it)."""
        return self.min_tokens_ids is not None and len(self.output_token_ids) + num_extra < self.min_tokens

    def banned_ids(self, extra: Sequence[int] = ()) -> list[int]:
        """The bad words' tokens masked at the next position (`extra`: drafted tokens before it)."""
        if not self.bad_words:
            return []
        history = self.output_token_ids + list(extra) if extra else self.output_token_ids
        banned = []
        for word in self.bad_words:
            head = len(word) - 1
            if head == 0 or (len(history) >= head and history[-head:] == word[:-1]):
                banned.append(word[-1])
        return banned

    def append(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        if self.grammar is not None:
            self.grammar.accept(token_ids)


class SampledLogprobs(NamedTuple):
    """Same fields, same order as messages.TokenLogprobs: `TokenLogprobs(*x)` converts."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token, logprob), most likely first


class PromptLogprob(NamedTuple):
    """Same fields, same order as messages.TokenLogprobs, with the token's rank among all."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[SampledLogprobs | None]  # None for rows that asked for none


class Sampler:
    """Samples a batch. Keeps two scratch buffers between calls: a fresh [B, V] tensor per step
    costs page faults that dwarf the arithmetic on a CPU. One per worker thread; the caller's
    logits are never modified."""

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
        self._masks = None   # TokenMasks, made at the first constrained row

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState],
               generator: torch.Generator | None = None) -> SamplerOutput:
        """One token per row of `logits` [B, V]; `generator` drives the rows without a seed.

        Each random row consumes one uniform draw per call, from its own generator when seeded.
        """
        _check(logits, states)
        if all(s.plain_greedy for s in states):   # a greedy decode's every step: nothing to apply
            return SamplerOutput(argmax_list(logits), [None] * len(states))
        logprob_rows = [i for i, s in enumerate(states) if s.num_logprobs is not None]
        logprobs = raw_logprobs(logits, states, logprob_rows) if logprob_rows else None
        penalized = self._penalized(logits, states, None)
        random_rows = [i for i, s in enumerate(states) if not s.greedy]
        if len(random_rows) < len(states):
            tokens = row_argmax(penalized)
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=logits.device)
        if random_rows:
            rows_states = [states[i] for i in random_rows]
            weights = self._rows(penalized, random_rows, may_reuse=penalized is not logits)
            _truncated_weights_(weights, rows_states)
            tokens[random_rows] = _inverse_cdf_draw_(weights, rows_states, generator)
        token_list = tokens.tolist()
        out: list[SampledLogprobs | None] = [None] * len(states)
        if logprobs is not None:
            for i in logprob_rows:
                out[i] = logprobs(i, token_list[i])
        return SamplerOutput(token_list, out)

    def processed_probs(self, logits: torch.Tensor, states: Sequence[SamplingState],
                        extra_output_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The distribution `sample` draws each row from, as a new [B, V] float32 tensor.

        Greedy rows give a point mass on the penalized argmax. `extra_output_ids[i]` are tokens
        before row i's position that its state does not hold yet (earlier drafted tokens when
        one sequence fills several rows); penalties count them as output. States may repeat.
        """
        _check(logits, states)
        penalized = self._penalized(logits, states, extra_output_ids)
        probs = penalized.float().clone() if penalized is logits else penalized.clone()
        greedy_rows = [i for i, s in enumerate(states) if s.greedy]
        random_rows = [i for i, s in enumerate(states) if not s.greedy]
        if random_rows:
            weights = probs[random_rows]
            _truncated_weights_(weights, [states[i] for i in random_rows])
            probs[random_rows] = weights / row_sums(weights)
        if greedy_rows:
            top = row_argmax(probs[greedy_rows])
            probs[greedy_rows] = 0.0
            probs[greedy_rows, top] = 1.0
        return probs

    def _penalized(self, logits: torch.Tensor, states: Sequence[SamplingState],
                   extra_output_ids: Sequence[Sequence[int]] | None) -> torch.Tensor:
        """`logits` itself when no row changes them, else a scratch copy with the penalties, the
        logit bias, the min_tokens mask and the grammar masks applied (speculative verification
        reads the same)."""
        extra = [len(e) for e in extra_output_ids] if extra_output_ids is not None else [0] * len(states)
        biased = [i for i, s in enumerate(states) if s.bias_ids is not None]
        held = [i for i, s in enumerate(states) if s.holds_off_stops(extra[i])]
        constrained = [i for i, s in enumerate(states) if s.grammar is not None]
        allowed = [i for i, s in enumerate(states) if s.allowed_ids is not None]
        drafted = extra_output_ids if extra_output_ids is not None else [()] * len(states)
        banned = [(i, b) for i, s in enumerate(states) if (b := s.banned_ids(drafted[i]))]
        if not any(s.uses_penalties for s in states) and not (biased or held or constrained or allowed or banned):
            return logits
        work = self._buffer(0, logits.shape, logits.device)
        work.copy_(logits)
        apply_penalties_(work, states, extra_output_ids)
        for i in biased:
            work[i].index_add_(0, states[i].bias_ids, states[i].bias_values)
        for i in held:
            work[i, states[i].min_tokens_ids] = float("-inf")
        for i in allowed:
            keep = work[i, states[i].allowed_ids]
            work[i].fill_(float("-inf"))
            work[i, states[i].allowed_ids] = keep
        for i, ids in banned:
            work[i, ids] = float("-inf")
        if constrained:
            if self._masks is None:
                from actors.worker.grammar_state import TokenMasks   # deferred: imports xgrammar

                self._masks = TokenMasks()
            self._masks.apply_(work, [(i, states[i].grammar, drafted[i]) for i in constrained])
        return work

    def _rows(self, src: torch.Tensor, rows: list[int], may_reuse: bool) -> torch.Tensor:
        """float32 rows of `src` in a scratch buffer (or `src` itself when it is scratch already)."""
        if may_reuse and len(rows) == src.shape[0]:
            return src
        out = self._buffer(1, (len(rows), src.shape[1]), src.device)
        if len(rows) == src.shape[0]:
            return out.copy_(src)
        if src.dtype != torch.float32:
            return out.copy_(src[rows])
        return torch.index_select(src, 0, torch.tensor(rows, device=src.device), out=out)

    def _buffer(self, slot: int, shape: tuple[int, int] | torch.Size, device: torch.device) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buf = self._scratch[slot]
        if buf.numel() < numel or buf.device != device:
            buf = self._scratch[slot] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel].view(shape[0], shape[1])


def apply_penalties_(logits: torch.Tensor, states: Sequence[SamplingState],
                     extra_output_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """vLLM's penalties, in place on float32 `logits` [B, V]; touches only the tokens seen.

    repetition: a seen token's logit is divided by the penalty when positive, multiplied when
    not (seen = in the prompt or the output); frequency: minus penalty times the output count;
    presence: minus penalty when the token occurs in the output.
    """
    vocab, device = logits.shape[1], logits.device
    flat = logits.view(-1)
    rows = [i for i, s in enumerate(states) if s.uses_penalties]
    if not rows:
        return logits
    outputs, prompts = [], []
    for i in rows:
        extra = list(extra_output_ids[i]) if extra_output_ids is not None else []
        outputs.append(torch.tensor(states[i].output_token_ids + extra, dtype=torch.long, device=device) + i * vocab)
        prompts.append(states[i].prompt_token_ids + i * vocab)
    out_ids, out_counts = torch.unique(torch.cat(outputs), return_counts=True)
    seen = torch.unique(torch.cat(prompts + [out_ids]))

    def per_row(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([float(getattr(s.params, name)) for s in states], dtype=dtype, device=device)

    # In float64 and saturated: a penalty near 0 (any value > 0 is accepted, 1e-45 included) would
    # overflow float32 to inf, and inf - inf in the softmax is NaN.
    rep = per_row("repetition_penalty", torch.float64)[seen // vocab]
    values = flat[seen].double()
    flat[seen] = torch.where(values > 0, values / rep, values * rep).clamp_(-_FLOAT32_MAX, _FLOAT32_MAX).float()
    freq, pres = per_row("frequency_penalty")[out_ids // vocab], per_row("presence_penalty")[out_ids // vocab]
    flat.index_add_(0, out_ids, -(freq * out_counts.to(flat.dtype) + pres))
    return logits


def _truncated_weights_(w: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """In place: logits rows -> probabilities after temperature, then unnormalised ones after min-p
    (relative to the row's best), top-k and top-p.

    Removed tokens get weight exactly 0. Rows are independent, so a row's result never depends
    on the rest of the batch.
    """
    device, vocab = w.device, w.shape[1]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=w.dtype, device=device).unsqueeze(1)

    # The max goes first, then the temperature: x / t overflows for a large finite x and a small t,
    # (x - max) / t never does. Then softmax in place, one row at a time by its construction (so a
    # row's weights never depend on its neighbours): 4-6x faster than exp_, which leaves its vector
    # path for inputs whose result underflows (-inf from a grammar mask or a logit bias, anything 87
    # below the best at a low temperature).
    w.sub_(w.amax(dim=-1, keepdim=True))
    if any(s.params.temperature != 1.0 for s in states):
        w.div_(column([s.params.temperature for s in states]))
    torch._softmax(w, -1, False, out=w)
    if any(s.uses_min_p for s in states):
        w.masked_fill_(w < column([s.params.min_p for s in states]) * w.amax(dim=-1, keepdim=True), 0.0)
    if any(s.top_k for s in states):
        ks = [min(s.top_k, vocab) for s in states]
        best = w.topk(max(ks), dim=-1).values
        kth = best.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1))
        kth.masked_fill_(column([float(k == 0) for k in ks]).bool(), 0.0)  # rows without top-k keep all
        w.masked_fill_(w < kth, 0.0)
    if any(s.uses_top_p for s in states):
        w.masked_fill_(w < _top_p_cut(w, states), 0.0)


def _top_p_cut(w: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Per row, the weight of the last token in the smallest most-likely set holding top_p of
    the mass (ties with it are kept); 0 for rows without top-p.

    That set lies among the tokens of weight >= (1 - top_p) * total / vocab (those below it hold
    less than 1 - top_p of the mass), a few hundred of a 49k vocabulary on a language model's
    logits: only they are sorted. Their running sums, in float64 and rounded to float32 as torch's
    cumsum does them, are the whole sorted row's first ones, so the cut is the same."""
    if w.device.type != "cpu":
        return _top_p_cut_on_device(w, states)
    total = row_sums(w).squeeze(1)
    top_p = torch.tensor([s.params.top_p for s in states], dtype=w.dtype, device=w.device)
    goals = (total * top_p).tolist()
    bounds = (total * (1.0 - top_p) / w.shape[1]).tolist()
    rows = w.numpy()
    cut = [0.0] * len(states)
    for j, s in enumerate(states):
        if not s.uses_top_p:
            continue
        goal = np.float32(goals[j])
        best = np.sort(rows[j][rows[j] >= np.float32(bounds[j])])[::-1]
        cumulative = np.cumsum(best, dtype=np.float64).astype(np.float32)
        if best.size == 0 or cumulative[-1] < goal:   # rounding: the whole row, sorted
            best = np.sort(rows[j])[::-1]
            cumulative = np.cumsum(best, dtype=np.float64).astype(np.float32)
        # The first token whose running mass reaches the goal is the last one kept.
        cut[j] = best[min(int(np.count_nonzero(cumulative < goal)), best.size - 1)]
    return torch.tensor(cut, dtype=w.dtype, device=w.device).unsqueeze(1)


def _top_p_cut_on_device(w: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """_top_p_cut on an accelerator's tensors, where copying them to the host would cost more than
    sorting the best _TOP_P_CANDIDATES of each row there."""
    device = w.device
    top_p = torch.tensor([s.params.top_p for s in states], dtype=w.dtype, device=device)
    goal = row_sums(w).squeeze(1) * top_p
    best = w.topk(min(_TOP_P_CANDIDATES, w.shape[1]), dim=-1).values
    cumulative = best.cumsum(dim=-1)
    reached = cumulative[:, -1] >= goal
    # The first candidate whose running mass reaches the goal is the last one kept.
    last = (cumulative < goal.unsqueeze(1)).sum(dim=-1).clamp_(max=best.shape[1] - 1)
    cut = best.gather(1, last.unsqueeze(1)).squeeze(1)
    for j in (~reached & (top_p < 1.0)).nonzero().flatten().tolist():  # flat distribution: sort the row
        row = w[j].sort(descending=True).values
        idx = int((row.cumsum(dim=0) < goal[j]).sum().clamp(max=row.numel() - 1))
        cut[j] = row[idx]
    cut.masked_fill_(top_p >= 1.0, 0.0)
    return cut.unsqueeze(1)


def _inverse_cdf_draw_(w: torch.Tensor, states: Sequence[SamplingState],
                       generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from weights `w` (turned into running sums in place), one uniform each."""
    device = w.device
    u = torch.empty(len(states), dtype=w.dtype, device=device)
    if any(s.generator is None for s in states):
        u.uniform_(generator=generator)
    for j, s in enumerate(states):
        if s.generator is not None:
            u[j] = torch.rand((), generator=s.generator, dtype=w.dtype, device=device)
    w.cumsum_(dim=-1)
    total = w[:, -1]
    # u * total < total, so some running sum exceeds it; a zero-weight token never does first.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(w, target.unsqueeze(1), right=True).squeeze(1)


def raw_logprobs(logits: torch.Tensor, states: Sequence[SamplingState], rows: list[int]):
    """Returns f(row, token) -> SampledLogprobs from the unmodified logits of `rows`.

    The subtraction is in float64: x - logsumexp overflows float32 for logits far apart."""
    raw = logits[rows].float()
    lse = row_logsumexp(raw)
    max_n = max(states[i].num_logprobs for i in rows)
    top_vals, top_ids = raw.topk(min(max_n, raw.shape[1]), dim=-1) if max_n else (raw[:, :0], raw[:, :0].long())
    top_vals = (top_vals.double() - lse.double()).tolist()
    top_ids = top_ids.tolist()
    lse_list = lse.squeeze(1).tolist()
    where = {i: j for j, i in enumerate(rows)}

    def for_row(i: int, token: int) -> SampledLogprobs:
        j, n = where[i], states[i].num_logprobs
        return SampledLogprobs(token, float(raw[j, token]) - lse_list[j], list(zip(top_ids[j][:n], top_vals[j][:n])))

    return for_row


def target_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> list[PromptLogprob]:
    """Per row of `logits` [R, V]: the logprob of targets[r] (from the unmodified logits, as
    raw_logprobs), its rank (1 + the tokens more likely) and the top `num_top`: prompt logprobs."""
    raw = logits.float()
    lse = row_logsumexp(raw).double()
    picked = raw.gather(1, torch.tensor(targets, dtype=torch.long, device=raw.device).unsqueeze(1))
    ranks = ((raw > picked).sum(dim=-1) + 1).tolist()
    values = (picked.double() - lse).squeeze(1).tolist()
    k = min(num_top, raw.shape[1])
    if k:
        top_vals, top_ids = raw.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), (top_vals.double() - lse).tolist())]
    else:
        tops = [[] for _ in targets]
    return [PromptLogprob(t, v, top, r) for t, v, top, r in zip(targets, values, tops, ranks)]


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first maximum, NaN counting as one): numpy's on a float32 CPU tensor, which
    takes 4 us over a 49k vocabulary where torch's takes 86, a greedy decode step's largest host cost."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.argmax(dim=-1)
    return torch.from_numpy(x.numpy().argmax(axis=-1))


def argmax_list(x: torch.Tensor) -> list[int]:
    """row_argmax(x).tolist(), without the round trip through a torch tensor on the CPU."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.argmax(dim=-1).tolist()
    return x.numpy().argmax(axis=-1).tolist()


def _check(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
