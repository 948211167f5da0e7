"""The step the worker is computing, as the scheduler remembers it until the step's outcome.

A failure must forget exactly the KV it left unwritten: each sequence's KV length before the step,
and which sequences took prefix hits on blocks another one writes in it. Plain data, no decisions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from actors.messages.kv import KVUnwritten
from actors.messages.step import SeqOutput


@dataclass
class InFlightStep:
    starts: dict[int, int] = field(default_factory=dict)   # seq id -> positions whose KV it had before
    # seq id -> admitted sequences whose prefix hit maps blocks it writes in this step: their KV
    # exists only if it succeeds
    readers: dict[int, list[int]] = field(default_factory=dict)
    step_id: int = 0
    burst: bool = False    # a decode burst: its steps' tokens arrive while it is in flight
    decode_rows: int | None = None   # its rows where every one decodes (no prompt tokens): what a row costs

    def failed(self, outputs: list[SeqOutput]) -> dict[int, str]:
        """Sequences the worker failed, and those whose prefix hit read KV one of them never wrote
        (hashes chain, so every such reader maps a failed sequence's block itself): seq id -> detail."""
        failed = {out.seq_id: out.error for out in outputs if out.error is not None}
        for writer in list(failed):
            for reader in self.readers.get(writer, []):
                failed.setdefault(reader, f"its prefix hit read KV that failed sequence {writer} never wrote")
        return failed

    def unwritten(self, seq_ids: Iterable[int]) -> list[KVUnwritten]:
        """What these sequences' KV holds, for the manager to forget the rest."""
        return [KVUnwritten(seq_id, self.starts[seq_id]) for seq_id in seq_ids]
