"""What the draft worker hears of each step: queued until a step drafts, then sent in one Propose.

The draft worker keeps every sequence's token history, but needs it only when it drafts. A step in
which no sequence drafts (speculation switched off for poor acceptance, or a batch too large to
gain) used to cost a message and a thread hop on the draft side; now its tokens wait here and go
with the next step that drafts, in order, so the draft's history is the same as if each had gone
at once. A plain synchronous class: the scheduler owns one.
"""

from __future__ import annotations

from actors.draft.messages import DraftInput, Propose
from actors.messages.step import NewSequence

MAX_QUEUED = 256   # items held back at most: past this they go without a draft (memory stays bounded)


class DraftFeed:
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self.max_queued = max_queued
        self._items: list[DraftInput] = []
        self._new: list[NewSequence] = []
        self._sent: set[int] = set()        # sequences whose creation the draft worker has had

    def step(self, step_id: int, items: list[DraftInput], new: list[NewSequence]) -> Propose | None:
        """The planned step's share: a Propose to send now, or None (queued)."""
        self._items += items
        self._new += new
        if not any(d.num_spec for d in items) and len(self._items) < self.max_queued:
            return None
        out = Propose(step_id, self._items, self._new)
        self._sent.update(n.seq_id for n in self._new)
        self._items, self._new = [], []
        return out

    def release(self, seq_id: int) -> bool:
        """A sequence ended: drop what is queued for it. True when the draft worker holds its state
        (tell it to drop that); a sequence it never heard of stays unknown to it."""
        if any(d.seq_id == seq_id for d in self._items):
            self._items = [d for d in self._items if d.seq_id != seq_id]
        if seq_id in self._sent:
            self._sent.discard(seq_id)
            return True
        self._new = [n for n in self._new if n.seq_id != seq_id]
        return False

    @property
    def num_queued(self) -> int:
        return len(self._items)
