"""Speculative decoding's share of each step: how many tokens each decoding sequence drafts, what
the draft worker hears of the step, and what a verification kept.

A plain synchronous class the scheduler owns when the engine has a draft worker. It never touches
the queues or the KV: it says how many lookahead slots a sequence wants (`seq.spec_k`), and after
the verification which rolled-back slots the KV manager trims.
"""

from __future__ import annotations

from actors.draft.controller import SpecController
from actors.draft.messages import DraftInput, Propose
from actors.messages.kv import KVTrim
from actors.messages.step import NewSequence, ScheduledSeq
from actors.scheduler.counters import Counters
from actors.scheduler.draft_feed import DraftFeed
from actors.scheduler.sequence import Sequence


class SpeculationPlanner:
    def __init__(self, controller: SpecController, counters: Counters, max_model_len: int):
        self.controller = controller
        self.counters = counters
        self.max_model_len = max_model_len
        counters.spec_decode_accepted_per_pos = [0] * controller.max_k
        self.feed = DraftFeed()                # holds the draft worker's share back while no sequence drafts
        self._drafts: list[DraftInput] = []    # the planned step's share, sequence by sequence
        self._propose: Propose | None = None   # the draft worker's message for the planned step
        self._released: list[int] = []         # sequences whose draft state goes at once

    def choose(self, running: list[Sequence]) -> dict[int, int]:
        """k per decoding sequence, capped so that the drafts fit the output and the context."""
        decoding = [s for s in running if s.num_tokens - s.num_computed == 1]
        chosen = self.controller.choose([s.seq_id for s in decoding])
        out = {}
        for seq in decoding:
            k = min(chosen[seq.seq_id], seq.room(self.max_model_len) - 1)
            if k > 0:
                out[seq.seq_id] = k
        return out

    def scheduled(self, seq: Sequence, scheduled: ScheduledSeq) -> None:
        """A sequence of the step being planned: the draft worker follows its tokens, and drafts
        `seq.spec_k` after them where it samples."""
        self._drafts.append(DraftInput(seq.seq_id, scheduled.token_ids, scheduled.start_pos, scheduled.block_table,
                                       seq.spec_k if scheduled.sample else 0))

    def planned(self, step_id: int, new: list[NewSequence]) -> None:
        """The step is planned: its share goes to the draft worker now, or waits (see DraftFeed)."""
        self._propose = self.feed.step(step_id, self._drafts, new)
        self._drafts = []

    def take_propose(self) -> Propose | None:
        """The draft worker's message for the step just planned: None while no sequence drafts (its
        tokens go with the next message, see DraftFeed)."""
        out, self._propose = self._propose, None
        return out

    def take_released(self) -> list[int]:
        """Finished sequences whose draft state to drop now (not with the next step: there may be none)."""
        out, self._released = self._released, []
        return out

    def verified(self, seq: Sequence, drafted: int, accepted: int, running: bool) -> list[KVTrim]:
        """After a step that reserved drafted slots: count, learn, and give the rejected slots back
        (the trim for the KV manager, none once the sequence stopped)."""
        c = self.counters
        c.spec_decode_draft_tokens += drafted
        c.spec_decode_accepted_tokens += accepted
        c.spec_decode_num_drafts += drafted > 0
        per_pos = c.spec_decode_accepted_per_pos
        if accepted > len(per_pos):   # never past the controller's max_k; kept whole if it were
            per_pos.extend([0] * (accepted - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1
        self.controller.observe(seq.seq_id, drafted, accepted)
        seq.spec_k = 0
        if not running:
            return []
        seq.num_computed += accepted   # accepted drafts have their KV; the emitted correction or bonus token not yet
        return [KVTrim(seq.seq_id, seq.num_computed)]

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: the controller forgets it, and the draft worker drops its state."""
        self.controller.forget(seq.seq_id)
        if self.feed.release(seq.seq_id):
            self._released.append(seq.seq_id)
