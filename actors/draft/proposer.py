"""Proposers: what the draft worker runs each step to draft tokens for the target to verify.

Each keeps, per sequence, the token history it has seen (prompt, computed tokens, and its own
latest drafts, which stay valid as far as they were accepted: the next step's start position
says how far). `NgramProposer` copies from earlier in the sequence (q is a point mass);
`ModelProposer` runs a model over a paged KV cache addressed by the target's block tables:
the first L layers of the target itself (layerskip), or a separate small model (draft).
"""

from __future__ import annotations

from typing import Protocol

import torch

from actors.draft.messages import DraftInput, Proposal, Propose
from actors.draft.ngram import NgramConfig, propose_ngram
from actors.messages.step import NewSequence
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from actors.worker.rejection_sampler import draw_rows
from actors.worker.sampler import Sampler, SamplingState, row_argmax


class Proposer(Protocol):
    def step(self, msg: Propose) -> list[Proposal]: ...

    @property
    def num_seqs(self) -> int: ...


class _DraftSeq:
    __slots__ = ("history", "prompt_len", "computed", "state")

    def __init__(self, new: NewSequence, state: SamplingState | None):
        self.history = list(new.prompt_token_ids)
        self.prompt_len = len(new.prompt_token_ids)
        self.computed = -1         # leading positions whose KV the draft holds (own-KV models); -1: not yet run
        self.state = state

    def advance(self, item: DraftInput) -> bool:
        """Take the step's tokens; False when the history has a gap (it cannot draft then)."""
        if len(self.history) < item.start_pos:
            return False
        del self.history[item.start_pos:]
        self.history.extend(item.token_ids)
        # A first start past 0 is a prefix-cache hit: the draft wrote those blocks' KV when they
        # were computed (a stale one would only lower acceptance, never change the output).
        self.computed = item.start_pos if self.computed < 0 else min(self.computed, item.start_pos)
        return True


class _Table:
    """Per-sequence state shared by the proposers: created, advanced, dropped as the plan says."""

    def __init__(self, make_state):
        self.seqs: dict[int, _DraftSeq] = {}
        self._make_state = make_state
        self._gone: set[int] = set()   # released before their creation arrived (an abort overtook it)

    def apply(self, msg: Propose) -> list[tuple[DraftInput, _DraftSeq | None]]:
        for sid in msg.finished_seq_ids:
            if self.seqs.pop(sid, None) is None:
                self._gone.add(sid)
        for new in msg.new_seqs:
            if new.seq_id in self._gone:
                self._gone.discard(new.seq_id)
            else:
                self.seqs[new.seq_id] = _DraftSeq(new, self._make_state(new))
        out = []
        for item in msg.seqs:
            seq = self.seqs.get(item.seq_id)
            out.append((item, seq if seq is not None and seq.advance(item) else None))
        return out


class NgramProposer:
    """Prompt lookup: no model, no KV; the draft is deterministic, so q is a point mass."""

    def __init__(self, config: NgramConfig):
        self.config = config
        self.table = _Table(lambda new: None)

    @property
    def num_seqs(self) -> int:
        return len(self.table.seqs)

    def step(self, msg: Propose) -> list[Proposal]:
        out = []
        for item, seq in self.table.apply(msg):
            if item.num_spec <= 0:
                continue
            drafts = propose_ngram(seq.history, self.config, item.num_spec) if seq is not None else []
            if drafts:
                seq.history.extend(drafts)  # tentative: the next start position says how far they hold
            out.append(Proposal(item.seq_id, drafts))
        return out


def _draft_seed(seed: int | None) -> int | None:
    # The draft's own stream: drawing from the target's would couple the two sides' random numbers.
    return None if seed is None else (seed * 0x9E3779B1 + 0x5EED) % (1 << 63)


class ModelProposer:
    """Drafts k tokens per sequence with k forwards of a model over a paged KV cache.

    `shares_target_kv`: the caches are the target's own first L layers (layerskip). Those layers
    compute exactly the KV the target writes for the same tokens, so the draft never has to catch
    up: it only runs the step's last token and its own drafts. Otherwise (a separate draft model)
    it first computes every position it has not seen (prompt, accepted and corrected tokens) when
    it next drafts for the sequence, so its KV stays in step with the target's, addressed by the
    same block tables; a sequence that does not speculate costs it nothing.
    """

    def __init__(self, runner: ModelRunner, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 shares_target_kv: bool, seed: int = 0):
        self.runner = runner
        self.kv_caches = kv_caches
        self.shares_target_kv = shares_target_kv
        self.sampler = Sampler()
        self.generator = torch.Generator(runner.device).manual_seed(seed + 1)
        device = runner.device
        self.table = _Table(lambda new: SamplingState(new.params, new.prompt_token_ids,
                                                      _draft_seed(new.seed), device))

    @property
    def num_seqs(self) -> int:
        return len(self.table.seqs)

    def step(self, msg: Propose) -> list[Proposal]:
        inputs: list[SequenceInput] = []
        drafting: list[tuple[DraftInput, _DraftSeq]] = []   # rows of the first forward's logits
        for item, seq in self.table.apply(msg):
            end = item.start_pos + len(item.token_ids)
            if seq is None or item.num_spec <= 0 or end + item.num_spec > self.runner.max_model_len:
                continue  # only the history moves on; an own-KV draft catches up when it next drafts
            if self.shares_target_kv:
                seq.computed = item.start_pos
            inputs.append(SequenceInput(seq.history[seq.computed:end], seq.computed, item.block_table, 1))
            seq.computed = end
            drafting.append((item, seq))
        drafts: dict[int, list[int]] = {item.seq_id: [] for item, _ in drafting}
        probs: dict[int, list[torch.Tensor]] = {item.seq_id: [] for item, _ in drafting}
        while inputs:
            logits = self.runner.execute(ForwardBatch(inputs), self.kv_caches)
            self._sample(logits, drafting, drafts, probs)
            inputs, still = [], []
            for item, seq in drafting:
                mine = drafts[item.seq_id]
                if len(mine) < item.num_spec:
                    pos = item.start_pos + len(item.token_ids) + len(mine) - 1
                    inputs.append(SequenceInput([mine[-1]], pos, item.block_table, 1))
                    still.append((item, seq))
            drafting = still
        out = []
        for item in msg.seqs:
            if item.num_spec <= 0:
                continue
            seq = self.table.seqs.get(item.seq_id)
            mine = drafts.get(item.seq_id, [])
            if seq is not None and mine:
                seq.history.extend(mine)           # tentative: the next start position says how far they hold
                seq.computed = item.start_pos + len(item.token_ids) + len(mine) - 1
            rows = probs.get(item.seq_id, [])
            blob = torch.stack(rows).numpy().tobytes() if rows and rows[0] is not None else b""
            out.append(Proposal(item.seq_id, mine, blob))
        return out

    def _sample(self, logits: torch.Tensor, drafting: list[tuple[DraftInput, _DraftSeq]],
                drafts: dict[int, list[int]], probs: dict[int, list[torch.Tensor]]) -> None:
        """One draft token per row, drawn from the processed distribution q (kept for verification)."""
        if not drafting:
            return
        states = [seq.state for _, seq in drafting]
        end_of = [item.start_pos + len(item.token_ids) for item, _ in drafting]
        for (item, seq), state, end in zip(drafting, states, end_of):
            state.output_token_ids = seq.history[seq.prompt_len:end]   # penalties see the known output
        extra = [drafts[item.seq_id] for item, _ in drafting]
        q = self.sampler.processed_probs(logits, states, extra)
        tokens = row_argmax(q)
        random_rows = [i for i, state in enumerate(states) if not state.greedy]
        if random_rows:
            gens = [states[i].generator if states[i].generator is not None else self.generator for i in random_rows]
            tokens[random_rows] = draw_rows(q[random_rows], gens)
        for row, ((item, _), state, token) in enumerate(zip(drafting, states, tokens.tolist())):
            drafts[item.seq_id].append(token)
            probs[item.seq_id].append(None if state.greedy else q[row].cpu())


def vocab_digest(runner: ModelRunner) -> str:
    """sha256 over a model's vocabulary (token -> id): what a draft on another node is checked against."""
    import hashlib

    items = sorted(runner.tokenizer.hf.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for token, index in items:
        h.update(f"{index}\t{token}\n".encode())
    return h.hexdigest()


def check_same_vocab(target: ModelRunner, draft: ModelRunner) -> None:
    """A draft must speak the target's vocabulary, or its tokens mean something else."""
    tv, dv = target.model_config.vocab_size, draft.model_config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                         "a draft model must use the target's tokenizer")
    t_vocab, d_vocab = target.tokenizer.hf.get_vocab(), draft.tokenizer.hf.get_vocab()
    if t_vocab != d_vocab:
        differ = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok) != i) + abs(len(t_vocab) - len(d_vocab))
        raise ValueError(f"the draft model's tokenizer differs from the target's ({differ} tokens map "
                         "differently); a draft model must use the target's tokenizer")

