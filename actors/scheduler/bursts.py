"""Decode bursts' share of the scheduler (the worker runs them: actors/worker/decode_burst.py): how
many more decode steps a plan may run, and what the KV holds once the burst is over.

A burst reserves lookahead slots for each running sequence; after it, each sequence's KV holds one
position per step run (the last sampled token's is not written yet) and the slots past that go
back. Plain functions of the sequences: the scheduler owns the queues and the step in flight.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.messages.kv import KVTrim
from actors.scheduler.sequence import Sequence, SeqStatus


def burst_length(running: list[Sequence], max_burst: int, max_model_len: int, others: bool) -> int:
    """Further decode steps the worker may run after this one: only when every running sequence
    decodes and nothing else wants the next step (`others`: a waiting request, a fork, drafts), and
    never past a sequence's output or context room. A handoff's blocks may still be arriving: its
    commit pulls the brake."""
    decodes = [s for s in running if s.num_tokens - s.num_computed == 1]
    if (max_burst < 2 or others or not decodes or len(decodes) != len(running)
            or any(s.request.handoff_to is not None for s in decodes)):
        return 0
    room = min(s.room(max_model_len) for s in decodes)
    return max(min(max_burst, room) - 1, 0)


def burst_trims(seqs: Iterable[Sequence | None], num_steps: int) -> list[KVTrim]:
    """After a burst of `num_steps` steps, for its sequences still running (None: gone meanwhile):
    the KV positions its steps wrote count as computed, and the lookahead slots past them go back."""
    trims = []
    for seq in seqs:
        if seq is not None and seq.status is SeqStatus.RUNNING:
            seq.num_computed += num_steps - 1
            trims.append(KVTrim(seq.seq_id, seq.num_computed))
    return trims
