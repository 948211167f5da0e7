"""The pool of physical KV blocks: refcounts, the free queue and the hash -> block prefix cache.

Only the KV cache manager touches it; callers outside `actors/kv` see block ids, never blocks.
Freed blocks that hold a hash stay in the cache (and in the free queue) until a fresh block is
needed and they are the least recently freed; blocks without a hash are handed out first.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from collections.abc import Callable

from actors.kv.event_log import EventLog
from prefix_store.hashing import BlockHash


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: EventLog | None,
                 on_evict: Callable[[list[int], list[BlockHash]], None] | None = None) -> None:
        self.block_size = block_size
        self._on_evict = on_evict   # (block ids, hashes) of cached blocks about to be handed out again
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0, in eviction order: the head is handed out next. An OrderedDict
        # gives O(1) pop from the head, push to either end and removal from the middle (a hit).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self._events = events

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def lookup(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def take_fresh(self, n: int) -> list[Block]:
        """Hand out n blocks with ref_cnt 1, evicting the least recently freed cached ones."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        if self._on_evict is not None:   # their KV is still intact: the tier copies it out first
            heads = [self.blocks[block_id] for block_id in islice(self._free, n)]
            cached = [block for block in heads if block.block_hash is not None]
            if cached:
                self._on_evict([b.block_id for b in cached], [b.block_hash for b in cached])
        taken, evicted = [], []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:
                evicted.append(self._unhash(block))
            block.ref_cnt = 1
            taken.append(block)
        if evicted and self._events is not None:
            self._events.removed(evicted)
        return taken

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to blocks already holding KV (prefix hits, forks)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[Block]) -> None:
        """Drop a reference from each block; `blocks` come most evictable first.

        A block with a hash joins the tail of the free queue (it is evicted last); one without
        goes to the head, since it holds nothing worth keeping.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, blocks: list[Block], hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int]) -> None:
        """Register consecutive full blocks of one sequence under their chained hashes.

        A hash already cached keeps its first block; the later duplicate stays private and is
        not announced, so every stored event is matched by exactly one removal.
        """
        run_hashes: list[BlockHash] = []
        run_start = 0
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                if not run_hashes:
                    run_start = i
                run_hashes.append(block_hash)
                continue
            self._announce(run_hashes, run_start, parent, hashes, token_ids)
            run_hashes = []
        self._announce(run_hashes, run_start, parent, hashes, token_ids)

    def uncache(self, blocks: list[Block]) -> None:
        """Take blocks in use out of the prefix cache (their KV cannot be trusted); their holders keep them."""
        removed = [self._unhash(block) for block in blocks if block.block_hash is not None]
        if removed and self._events is not None:
            self._events.removed(removed)

    def clear_hashes(self) -> None:
        """Forget every cached hash; blocks in use keep their KV, free ones become plain free."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.cleared()

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def _unhash(self, block: Block) -> BlockHash:
        block_hash, block.block_hash = block.block_hash, None
        del self._cached[block_hash]
        return block_hash

    def _announce(self, run: list[BlockHash], start: int, parent: BlockHash | None,
                  hashes: list[BlockHash], token_ids: list[int]) -> None:
        if not run or self._events is None:
            return
        bs = self.block_size
        run_parent = hashes[start - 1] if start > 0 else parent
        tokens = token_ids[start * bs:(start + len(run)) * bs]
        self._events.stored(run, run_parent, tokens, bs)
