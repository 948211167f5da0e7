"""The KV tier: blocks the pool evicts, kept by their chained hash, copied back instead of recomputed.

Host memory holds the most recently evicted blocks (an LRU of `memory_bytes`); with a disk store
every saved block is also written there (by the store's own thread), so the tier outlives the
memory LRU and the process. A block's bytes are what `KVBlockIO` reads and writes for it alone, the
layout a KV handoff moves. The hash carries the tenant's salt like the pool's, so a block is only ever found by
a request that would have computed the same bytes. Only the KV manager calls it, inside its step. On
the event loop it never reads a file: what a step reloads or a peer pulls from disk is read first, on a
thread the KV manager awaits (`read_disk`, then `stage`). With a codec (actors/kv/tier_codec.py) the tier
keeps each block in the codec's form, in memory and on disk, and gives it back in the pool's.
Blocks entering and leaving the tier are announced in the manager's event log, tagged as the tier's,
so the prefix index knows this engine can reload them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from actors.kv.event_log import EventLog
from actors.kv.tier_disk import DiskTier
from prefix_store.hashing import BlockHash

if TYPE_CHECKING:
    from actors.kv.tier_codec import Int8BlockCodec   # torch: only where an engine runs


class BlockBytes(Protocol):
    """The pool's blocks as bytes (actors.worker.kv_blocks.KVBlockIO)."""

    bytes_per_block: int

    def read(self, block_ids: list[int]) -> memoryview: ...

    def write(self, block_ids: list[int], data: bytes) -> None: ...


class KVTier:
    def __init__(self, blocks: BlockBytes, memory_bytes: int = 0, disk: DiskTier | None = None,
                 codec: Int8BlockCodec | None = None):
        if memory_bytes < 0:
            raise ValueError(f"the tier's memory must not be negative, got {memory_bytes}")
        self.block_bytes = codec.stored_bytes if codec is not None else blocks.bytes_per_block   # as kept here
        if memory_bytes < self.block_bytes and disk is None:
            raise ValueError(f"a KV tier of {memory_bytes} bytes holds no block of {self.block_bytes}")
        self.blocks = blocks
        self.codec = codec
        self.memory_bytes = memory_bytes
        self.disk = disk
        self._memory: OrderedDict[BlockHash, bytes] = OrderedDict()   # least recently used first
        self.events: EventLog | None = None   # the KV manager's, once it takes the tier
        self._staged: dict[BlockHash, bytes | None] = {}   # read from disk ahead of a step (None: damaged)
        # Read from disk while the block's request waited (`warm`), oldest first; at most the disk's
        # queue's bytes (its writes' bound), the oldest dropped past it.
        self._warm: OrderedDict[BlockHash, bytes] = OrderedDict()
        self.warm_bytes = 0
        self.hits_warm = 0   # of hits_disk, blocks that were read before their step
        self.hits_memory = self.hits_disk = 0   # blocks copied back, by where they were found
        self.bytes_saved = self.bytes_loaded = self.bytes_pulled = 0
        self.save_s = self.load_s = self.pull_s = 0.0
        self.pulls = self.pull_failures = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._memory or (self.disk is not None and block_hash in self.disk)

    def in_memory(self, block_hash: BlockHash) -> bool:
        """Held without a read from disk: in the memory LRU, or read ahead (`warm`)."""
        return block_hash in self._memory or block_hash in self._warm

    @property
    def memory_used(self) -> int:
        return len(self._memory) * self.block_bytes

    def hashes(self) -> list[BlockHash]:
        """Every block the tier holds, in memory or on disk, once."""
        on_disk = self.disk.hashes() if self.disk is not None else []
        return list(self._memory) + [h for h in on_disk if h not in self._memory]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes())

    def save(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """Copy out blocks the pool is about to hand out again (their KV is still there)."""
        started = time.perf_counter()
        gone = self._take_lost()
        fresh = [(b, h) for b, h in zip(block_ids, hashes) if h not in self]
        for block_hash in hashes:
            if block_hash in self._memory:
                self._memory.move_to_end(block_hash)
        if not fresh:
            self._announce([], gone)
            return
        for block_id, block_hash in fresh:   # one block at a time: a block's bytes stand alone
            gone += self._add(block_hash, self._encode(self.blocks.read([block_id])))
        self.bytes_saved += len(fresh) * self.block_bytes
        self._announce([h for _, h in fresh], gone)
        self.save_s += time.perf_counter() - started

    def pulled(self, hashes: list[BlockHash], blocks: list[bytes], seconds: float, failed: bool) -> None:
        """A pull from a peer engine is over: its blocks (the same layout, as the pull checked) come in."""
        self.pulls += 1
        self.pull_failures += failed
        self.pull_s += seconds
        size = self.blocks.bytes_per_block
        fresh = [(h, b) for h, b in zip(hashes, blocks) if h not in self and len(b) == size]
        gone = []
        for block_hash, block in fresh:
            gone += self._add(block_hash, self._encode(block))
        self.bytes_pulled += len(fresh) * size
        self._announce([h for h, _ in fresh], gone)

    def _add(self, block_hash: BlockHash, block: bytes) -> list[BlockHash]:
        """Into memory and onto disk; returns the blocks that left either to make room."""
        gone = self._keep(block_hash, block)
        if self.disk is not None:
            gone += self.disk.put(block_hash, block)
        return gone

    def fetch(self, hashes: list[BlockHash]) -> tuple[list[bytes], int]:
        """The bytes (the pool's layout) of the leading blocks of `hashes` the tier holds (up to the first
        it cannot give: absent, or damaged on disk), and how many of them were read from disk."""
        started = time.perf_counter()
        found, from_disk, gone = [], 0, self._take_lost()
        for block_hash in hashes:
            block = self._memory.get(block_hash)
            if block is not None:
                self._memory.move_to_end(block_hash)
            elif block_hash in self._staged or block_hash in self._warm or (self.disk is not None
                                                                              and block_hash in self.disk):
                block = self._staged.pop(block_hash) if block_hash in self._staged else self._unwarm(block_hash)
                if block is None:
                    block = self.disk.get(block_hash)
                if block is None:   # a damaged file, deleted: the block left the tier
                    gone.append(block_hash)
                    break
                gone += self._keep(block_hash, block)
                from_disk += 1
            else:
                break
            found.append(self.codec.decode(block) if self.codec is not None else block)
        self._announce([], gone)
        self.load_s += time.perf_counter() - started
        return found, from_disk

    def on_disk_only(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """Of the leading blocks of `hashes` the tier holds, those that only the disk has (none read ahead)."""
        wanted = []
        for block_hash in hashes:
            if block_hash not in self:
                break
            if not self.in_memory(block_hash):
                wanted.append(block_hash)
        return wanted

    def read_disk(self, hashes: list[BlockHash]) -> dict[BlockHash, bytes | None]:
        """Read blocks from disk (None: damaged, deleted). For a thread, while the KV manager waits:
        the disk store's index is the caller's alone meanwhile."""
        return {block_hash: self.disk.get(block_hash) for block_hash in hashes}

    def warm(self, blocks: dict[BlockHash, bytes | None]) -> None:
        """Blocks `DiskTier.peek` read on a thread while their request waited, so that its step takes them
        without waiting for the disk: those the disk still holds and memory does not (None: unread)."""
        limit = self.disk.max_pending_bytes if self.disk is not None else 0
        for block_hash, block in blocks.items():
            if block is None or block_hash in self._memory or block_hash in self._warm \
                    or self.disk is None or block_hash not in self.disk:
                continue
            self._warm[block_hash] = block
            self.warm_bytes += len(block)
            while self.warm_bytes > limit:
                self.warm_bytes -= len(self._warm.popitem(last=False)[1])

    def _unwarm(self, block_hash: BlockHash) -> bytes | None:
        block = self._warm.pop(block_hash, None)
        if block is not None:
            self.warm_bytes -= len(block)
            self.hits_warm += 1
        return block

    def stage(self, blocks: dict[BlockHash, bytes | None], read_s: float = 0.0) -> None:
        """Blocks `read_disk` read, for this step's `fetch`es; `unstage` drops what they left. `read_s`: the
        read's time, when it was for this engine's own reloads (counted in `load_s` as `fetch` counts its own)."""
        self._staged = blocks
        self.load_s += read_s

    def unstage(self) -> None:
        gone = [h for h, block in self._staged.items() if block is None]
        self._staged = {}
        self._announce([], gone)

    def restore(self, block_ids: list[int], blocks: list[bytes], from_disk: int) -> None:
        """Write fetched blocks into these pool blocks; `from_disk` of them were read from disk."""
        started = time.perf_counter()
        for block_id, block in zip(block_ids, blocks):
            self.blocks.write([block_id], block)
        self.hits_disk += from_disk
        self.hits_memory += len(blocks) - from_disk
        self.bytes_loaded += len(blocks) * self.block_bytes
        self.load_s += time.perf_counter() - started

    def clear(self) -> None:
        """Forget everything (the weights changed): memory and disk. Nothing is announced: the pool's
        `cleared` event clears the index's view of both."""
        self._memory.clear()
        self._warm.clear()
        self.warm_bytes = 0
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        """Let the disk writer finish what is queued (a restart then finds it)."""
        if self.disk is not None:
            self.disk.close()

    def _keep(self, block_hash: BlockHash, block: bytes) -> list[BlockHash]:
        """Into host memory; returns the least recently used blocks that leave it."""
        if self.memory_bytes < len(block):
            return []
        self._memory[block_hash] = block
        self._memory.move_to_end(block_hash)
        gone = []
        while self.memory_used > self.memory_bytes:
            gone.append(self._memory.popitem(last=False)[0])
        return gone

    def _encode(self, block: bytes | memoryview) -> bytes:
        return self.codec.encode(block) if self.codec is not None else bytes(block)

    def _take_lost(self) -> list[BlockHash]:
        return self.disk.take_lost() if self.disk is not None else []

    def _announce(self, came: list[BlockHash], gone: list[BlockHash]) -> None:
        """The index hears of the blocks `came` (new to the tier) that are still in it, and of those
        `gone` (left memory or disk) that were in it before and are in neither now: every stored
        event is matched by one removal. A block read ahead that left the disk goes too."""
        for block_hash in gone:
            if block_hash in self._warm and block_hash not in self:
                self.warm_bytes -= len(self._warm.pop(block_hash))
        if self.events is None:
            return
        new = set(came)
        stored = [h for h in came if h in self]
        removed = [h for h in dict.fromkeys(gone) if h not in self and h not in new]
        if stored:
            self.events.stored(stored, None, [], 0, tier=True)
        if removed:
            self.events.removed(removed, tier=True)
