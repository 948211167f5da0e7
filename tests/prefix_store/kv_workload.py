"""A real KV cache manager under a small shared-prefix workload, to produce real event streams.

The pool is small so requests evict each other's cached blocks: the stream then holds
stored, removed (and, when asked, cleared) events, as a busy engine's would.
"""

from __future__ import annotations

import random
from collections import deque

from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig, KVRequest
from prefix_store.hashing import hash_full_blocks

BLOCK_SIZE = 4


class ManagerEvents:
    """A KV manager of this process as the publisher reads one (`prefix_store.KVEventSource`):
    the engine's source asks its KV actor; this one answers from the manager itself."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    async def take_events(self):
        return self.kv.take_events()

    async def snapshot(self):
        return self.kv.snapshot()


class KVWorkload:
    def __init__(self, seed: int, num_blocks: int = 40, max_live: int = 3, max_events: int = 100_000):
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                               max_events=max_events))
        self.events = ManagerEvents(self.kv)
        # A few shared "system prompts" so requests hit each other's blocks.
        self.prefixes = [[self.rng.randrange(1000) for _ in range(self.rng.randrange(4, 20))]
                         for _ in range(4)]
        self._live: deque[str] = deque()
        self._max_live = max_live
        self._n = 0
        self.history: list[list[int]] = []

    def prompt(self) -> list[int]:
        tail = [self.rng.randrange(1000) for _ in range(self.rng.randrange(1, 12))]
        return self.rng.choice(self.prefixes) + tail

    def run(self, num_requests: int, cache_salt: str | None = None) -> None:
        for _ in range(num_requests):
            self.submit(self.prompt(), cache_salt)

    def submit(self, prompt: list[int], cache_salt: str | None = None) -> None:
        """Admit and fully prefill `prompt`, freeing the oldest live requests to make room."""
        request = KVRequest(f"r{self._n}", prompt, cache_salt)
        self.history.append(prompt)
        self._n += 1
        while True:
            hit = self.kv.get_computed_blocks(request)
            new = len(prompt) - hit.num_computed_tokens
            if self.kv.can_allocate(request.seq_id, new, hit=hit):
                break
            self.kv.free(self._live.popleft())
        self.kv.allocate_slots(request.seq_id, new, hit=hit)
        self._live.append(request.seq_id)
        while len(self._live) > self._max_live:
            self.kv.free(self._live.popleft())

    def probes(self, n: int) -> list[list[bytes]]:
        """Block hashes of prompts that share some, all or none of what the cache holds."""
        prompts = [self.rng.choice(self.history) if self.history and i % 2 else self.prompt()
                   for i in range(n)]
        return [hash_full_blocks(p, BLOCK_SIZE) for p in prompts]

    def truth(self, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` the manager holds now: what the index must answer."""
        cached = set(self.kv.snapshot()[1])
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n
