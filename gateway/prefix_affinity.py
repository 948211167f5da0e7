"""Where this gateway just sent batch lines' prompt blocks: so the lines of a batch that share a
prefix go to one engine from the first, before that engine has computed the blocks and the prefix
index (which learns of blocks only once they exist) could say so.

A block hash is chained over every token before it, so a remembered hash stands for the whole prefix
it ends. Entries last `ttl_s`, long enough for the index to hear of the blocks; then the index routes.
It never fails a line: an unknown prefix, or an engine gone, and routing goes on as before.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence


class PrefixAffinity:
    def __init__(self, ttl_s: float = 10.0, max_entries: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be positive and max_entries at least 1")
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._sent: OrderedDict[bytes, tuple[str, float]] = OrderedDict()   # hash -> (engine id, until)

    def remember(self, block_hashes: Sequence[bytes], engine_id: str) -> None:
        until = self._clock() + self.ttl_s
        for h in block_hashes:
            self._sent[h] = (engine_id, until)
            self._sent.move_to_end(h)
        while len(self._sent) > self.max_entries:
            self._sent.popitem(last=False)

    def match(self, block_hashes: Sequence[bytes]) -> tuple[str | None, int]:
        """(the engine sent the longest leading run of these blocks lately, how many blocks); (None, 0)."""
        now = self._clock()
        for n in range(len(block_hashes), 0, -1):
            entry = self._sent.get(block_hashes[n - 1])
            if entry is not None and entry[1] > now:
                return entry[0], n
        return None, 0
