"""The KV cache manager: paged block tables per sequence, prefix caching, refcounts and eviction.

A plain synchronous class (the actor shell around it only turns messages into calls). Callers
check, then change: `can_allocate` before `allocate_slots`, `can_fork` before `fork`; a change
that would fail raises before touching any state. Outside this package a block is just an id.
"""

from __future__ import annotations

from collections import Counter

from actors.kv.block_pool import Block, BlockPool
from actors.kv.event_log import EventLog
from actors.kv.structs import KVCacheConfig, KVRequest, PrefixCacheStats, PrefixHit, StalePrefixHit
from actors.kv.tier import KVTier
from prefix_store.events import TIER_TAG, KVEvent
from prefix_store.hashing import BlockHash, hash_full_blocks


class _Seq:
    """What the manager knows of one sequence."""

    __slots__ = ("token_ids", "cache_salt", "blocks", "block_hashes", "num_computed", "num_cached_blocks")

    def __init__(self, token_ids: list[int], cache_salt: str | None, blocks: list[Block],
                 block_hashes: list[BlockHash], num_computed: int) -> None:
        self.token_ids = token_ids  # the manager's own copy: prompt + appended output tokens
        self.cache_salt = cache_salt
        self.blocks = blocks
        self.block_hashes = block_hashes  # chained hashes of the leading full blocks known so far
        self.num_computed = num_computed  # positions whose KV is written (or is being written this step)
        self.num_cached_blocks = len(blocks)  # leading full blocks already offered to the prefix cache


class KVCacheManager:
    """`tier`: where evicted cached blocks go, and come back from when a prompt's chain continues there."""

    def __init__(self, config: KVCacheConfig, tier: KVTier | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self._events = EventLog(config.max_events) if config.record_events and config.enable_prefix_caching else None
        self.tier = tier if config.enable_prefix_caching else None
        if self.tier is not None:
            self.tier.events = self._events
        self._pool = BlockPool(config.num_blocks, config.block_size, self._events,
                               self.tier.save if self.tier is not None else None)
        self._seqs: dict[str, _Seq] = {}
        self._requests = self._queried_tokens = self._hit_tokens = self._tier_hit_tokens = 0

    # ---- admission ----------------------------------------------------------------------

    def get_computed_blocks(self, request: KVRequest, *, from_tier: bool = True) -> PrefixHit:
        """Longest run of cached leading full blocks of a new sequence: the pool's, then those the
        tier holds where the pool's run ends (their bytes, read now). Changes nothing in the pool.

        At least one token is always left to compute, so the last position has logits.
        """
        if request.seq_id in self._seqs:
            raise ValueError(f"sequence {request.seq_id!r} already holds blocks")
        if not self.config.enable_prefix_caching or not request.read_cache:
            return PrefixHit(request, [], [], 0)
        hashes, max_hit, block_ids = self._pool_run(request)
        loaded, from_disk = [], 0
        if from_tier and self.tier is not None and len(block_ids) < max_hit:
            loaded, from_disk = self.tier.fetch(hashes[len(block_ids):max_hit])
        return PrefixHit(request, block_ids, hashes, (len(block_ids) + len(loaded)) * self.block_size,
                         loaded, from_disk)

    def disk_reads(self, request: KVRequest) -> list[BlockHash]:
        """The blocks a `get_computed_blocks` of this request would read from the tier's disk (to read
        them ahead, off the event loop)."""
        if self.tier is None or self.tier.disk is None or not request.read_cache:
            return []
        hashes, max_hit, block_ids = self._pool_run(request)
        return self.tier.on_disk_only(hashes[len(block_ids):max_hit])

    def in_pool(self, block_hash: BlockHash) -> bool:
        return self._pool.lookup(block_hash) is not None

    def held_run(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of `hashes` this engine serves without computing: the pool's, then the tier's."""
        n = 0
        while n < len(hashes) and self._pool.lookup(hashes[n]) is not None:
            n += 1
        while self.tier is not None and n < len(hashes) and hashes[n] in self.tier:
            n += 1
        return n

    def shareable(self, hashes: list[BlockHash]) -> list[int | bytes]:
        """For a peer engine, the leading blocks of `hashes` this one can give: a pool block's id where
        no sequence holds it (so a step is not writing it now), else the tier's bytes."""
        out: list[int | bytes] = []
        for block_hash in hashes:
            block = self._pool.lookup(block_hash)
            if block is not None and block.ref_cnt == 0:
                out.append(block.block_id)
                continue
            found = self.tier.fetch([block_hash])[0] if self.tier is not None and block is None else []
            if not found:
                break
            out.append(found[0])
        return out

    def share_disk_reads(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """The blocks a `shareable` of `hashes` would read from the tier's disk (to read them ahead, off
        the event loop): those of its leading run the pool lacks and only the disk holds."""
        if self.tier is None or self.tier.disk is None:
            return []
        wanted = []
        for block_hash in hashes:
            block = self._pool.lookup(block_hash)
            if block is not None:
                if block.ref_cnt:
                    break
                continue
            if block_hash not in self.tier:
                break
            if not self.tier.in_memory(block_hash):
                wanted.append(block_hash)
        return wanted

    def _pool_run(self, request: KVRequest) -> tuple[list[BlockHash], int, list[int]]:
        """(the request's full-block hashes, how many may hit, the pool's blocks of its leading run)."""
        hashes = hash_full_blocks(request.token_ids, self.block_size, request.cache_salt)
        max_hit = max(len(request.token_ids) - 1, 0) // self.block_size
        block_ids = []
        for block_hash in hashes[:max_hit]:
            block = self._pool.lookup(block_hash)
            if block is None:
                break
            block_ids.append(block.block_id)
        return hashes, max_hit, block_ids

    def can_allocate(self, seq_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                     hit: PrefixHit | None = None) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed."""
        fresh, reused = self._blocks_to_take(seq_id, num_new_tokens, num_lookahead_tokens, hit)
        return fresh + reused <= self._pool.num_free

    def allocate_slots(self, seq_id: str, num_new_tokens: int, *, num_lookahead_tokens: int = 0,
                       hit: PrefixHit | None = None) -> None:
        """Give the sequence KV slots for `num_new_tokens` more positions, plus lookahead ones.

        The first call for a sequence passes the `hit` from `get_computed_blocks` (an empty hit
        when nothing is cached). `num_new_tokens` are positions whose token ids are known (a
        prefill chunk, or the last sampled token in decode) and whose KV this step writes; full
        blocks among them enter the prefix cache now. Lookahead positions (speculative tokens)
        get slots but are not counted as computed until `trim` confirms them.
        """
        fresh, reused = self._blocks_to_take(seq_id, num_new_tokens, num_lookahead_tokens, hit)
        if fresh + reused > self._pool.num_free:
            raise RuntimeError(f"allocate_slots without room for {seq_id!r}: call can_allocate first")
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._admit(hit)
            fresh -= len(hit.loaded)
        seq.blocks.extend(self._pool.take_fresh(fresh))
        seq.num_computed += num_new_tokens
        self._cache_full_blocks(seq)

    # ---- growth and rollback ---------------------------------------------------------------

    def append_token_ids(self, seq_id: str, token_ids: list[int]) -> None:
        """Record tokens the sequence gained (sampled or accepted); hashing needs them."""
        seq = self._seq(seq_id)
        seq.token_ids.extend(token_ids)
        self._cache_full_blocks(seq)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Set the sequence's KV length to `num_tokens` positions and return blocks wholly past it.

        Speculative decoding calls it after verification with the accepted length: positions up
        to it count as computed (their full blocks get cached), the rest are rolled back. A cut
        inside a block that is cached or shared would let this sequence overwrite KV that others
        read, so that is refused; cuts on a block boundary are always fine.
        """
        seq = self._seq(seq_id)
        if not 0 <= num_tokens <= len(seq.blocks) * self.block_size:
            raise ValueError(f"trim to {num_tokens} outside the {len(seq.blocks)} blocks of {seq_id!r}")
        keep, offset = divmod(num_tokens, self.block_size)
        if offset:
            cut = seq.blocks[keep]
            if cut.ref_cnt > 1 or cut.block_hash is not None:
                raise ValueError(f"trim to {num_tokens} would rewrite a shared or cached block of {seq_id!r}")
            keep += 1
        self._pool.release(seq.blocks[keep:][::-1])
        del seq.blocks[keep:]
        seq.num_computed = num_tokens
        seq.num_cached_blocks = min(seq.num_cached_blocks, num_tokens // self.block_size)
        self._cache_full_blocks(seq)

    def forget_unwritten(self, seq_id: str, num_written: int) -> None:
        """The step that was to write the sequence's KV past its first `num_written` positions
        failed: the blocks holding any of those positions leave the prefix cache (announced as
        removed, like an eviction), and only `num_written` positions count as computed.

        Blocks wholly before them keep their hashes: earlier steps wrote them, or they were the
        prefix hits the sequence started from.
        """
        seq = self._seq(seq_id)
        if not 0 <= num_written <= seq.num_computed:
            raise ValueError(f"{seq_id!r} has {seq.num_computed} computed positions, not {num_written}")
        first = num_written // self.block_size
        self._pool.uncache(seq.blocks[first:])
        seq.num_computed = num_written
        seq.num_cached_blocks = min(seq.num_cached_blocks, first)

    # ---- n > 1 sampling ---------------------------------------------------------------------

    def can_fork(self, src_id: str, num_tokens: int | None = None) -> bool:
        return self._fork_length(src_id, num_tokens) % self.block_size == 0 or self._pool.num_free >= 1

    def fork(self, src_id: str, dst_id: str, num_tokens: int | None = None) -> list[tuple[int, int]]:
        """Start `dst_id` holding the KV of `src_id`'s first `num_tokens` positions (default: all
        computed ones); returns the KV copies the worker must make.

        Full blocks are shared (refcounted, never written again). A partly filled last block
        would be written by both, so dst gets a fresh block instead, and the caller must copy
        the KV of each returned (src_block, dst_block) pair, in every layer, before dst's next
        forward pass. With `num_tokens` on a block boundary there is nothing to copy: dst then
        recomputes src's remaining positions itself (at most block_size - 1 of a prompt).
        dst's token ids are src's first `num_computed_tokens(src_id)` ones; append its own
        sampled tokens afterwards. For n > 1 sampling, fork once src's prompt is computed.
        """
        src = self._seq(src_id)
        if dst_id in self._seqs:
            raise ValueError(f"sequence {dst_id!r} already holds blocks")
        if not self.can_fork(src_id, num_tokens):
            raise RuntimeError(f"fork of {src_id!r} without a free block: call can_fork first")
        length = self._fork_length(src_id, num_tokens)
        num_full, partial = divmod(length, self.block_size)
        blocks = src.blocks[:num_full]
        self._pool.touch(blocks)
        copies = []
        if partial:
            fresh = self._pool.take_fresh(1)[0]
            copies.append((src.blocks[num_full].block_id, fresh.block_id))
            blocks = blocks + [fresh]
        dst = _Seq(src.token_ids[:src.num_computed], src.cache_salt, blocks, src.block_hashes[:num_full], length)
        dst.num_cached_blocks = min(src.num_cached_blocks, num_full)
        self._seqs[dst_id] = dst
        return copies

    # ---- release ------------------------------------------------------------------------------

    def free(self, seq_id: str) -> None:
        """Give back all of a finished, aborted or preempted sequence's blocks (once)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"free of unknown sequence {seq_id!r} (freed twice?)")
        # Last blocks first: they join the free queue earliest, so they are evicted first and a
        # shared prefix survives longest.
        self._pool.release(seq.blocks[::-1])

    def save_cached_to_tier(self) -> None:
        """Copy the blocks the pool caches and no sequence holds into the tier (at shutdown: a disk tier
        then keeps them for the next start). A held block may be one a cut step never wrote."""
        if self.tier is not None:
            cached = [block for block in self._pool.blocks if block.block_hash is not None and block.ref_cnt == 0]
            self.tier.save([b.block_id for b in cached], [b.block_hash for b in cached])

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (after a weight change, say); running sequences go on."""
        # Blocks already offered by running sequences are not offered again: their KV may
        # predate the change that made the cache stale.
        self._pool.clear_hashes()
        if self.tier is not None:
            self.tier.clear()

    # ---- queries ------------------------------------------------------------------------------

    def block_table(self, seq_id: str) -> list[int]:
        return [block.block_id for block in self._seq(seq_id).blocks]

    def num_tokens(self, seq_id: str) -> int:
        """Tokens the manager knows of the sequence: its prompt and the outputs appended so far."""
        return len(self._seq(seq_id).token_ids)

    def num_computed_tokens(self, seq_id: str) -> int:
        return self._seq(seq_id).num_computed

    def has_seq(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def num_table_blocks(self) -> int:
        """Blocks in all sequences' tables, a shared block counted once per table."""
        return sum(len(seq.blocks) for seq in self._seqs.values())

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (including cached ones waiting for eviction)."""
        return self._pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return len(self._pool.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached

    @property
    def usage(self) -> float:
        return 1.0 - self._pool.num_free / len(self._pool.blocks)

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._requests, self._queried_tokens, self._hit_tokens, self._tier_hit_tokens)

    def take_events(self) -> list[KVEvent]:
        """Drain the recorded block stored / removed / cleared events, oldest first."""
        return self._events.take() if self._events is not None else []

    @property
    def next_event_seq(self) -> int:
        """The sequence number the next recorded event will carry (0 while none are recorded)."""
        return self._events.next_seq if self._events is not None else 0

    def snapshot(self) -> tuple[int, list[BlockHash]]:
        """(sequence number of the next event, hashes cached now): a consumer that saw a gap
        replaces its view with these hashes and applies only events from that number on. The tier's
        blocks come under their index keys (`prefix_store.events.TIER_TAG`)."""
        tier = [TIER_TAG + h for h in self.tier.hashes()] if self.tier is not None and self._events else []
        return self.next_event_seq, self._pool.cached_hashes() + tier

    def check_invariants(self) -> None:
        """Raise RuntimeError when the bookkeeping is inconsistent (tests and debugging)."""
        refs = Counter(block.block_id for seq in self._seqs.values() for block in seq.blocks)
        free = set(self._pool.free_block_ids())
        for block in self._pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise RuntimeError(f"{block} is referenced by {refs.get(block.block_id, 0)} tables")
            if (block.ref_cnt == 0) != (block.block_id in free):
                raise RuntimeError(f"{block} free-queue membership is wrong")
            if block.block_hash is not None and self._pool.lookup(block.block_hash) is not block:
                raise RuntimeError(f"{block} has a hash the cache does not map to it")
        if self._pool.num_cached != sum(b.block_hash is not None for b in self._pool.blocks):
            raise RuntimeError("the cache maps hashes to blocks that do not hold them")
        for seq_id, seq in self._seqs.items():
            if len(seq.blocks) * self.block_size < seq.num_computed:
                raise RuntimeError(f"{seq_id!r} has fewer slots than computed positions")

    # ---- internals ----------------------------------------------------------------------------

    def _fork_length(self, src_id: str, num_tokens: int | None) -> int:
        computed = self._seq(src_id).num_computed
        if num_tokens is None:
            return computed
        if not 0 <= num_tokens <= computed:
            raise ValueError(f"fork of {num_tokens} positions of {src_id!r}, which has {computed} computed")
        return num_tokens

    def _seq(self, seq_id: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq

    def _blocks_to_take(self, seq_id: str, num_new: int, num_lookahead: int,
                        hit: PrefixHit | None) -> tuple[int, int]:
        """(fresh blocks, free cached hit blocks) this allocation takes out of the free queue."""
        if num_new < 0 or num_lookahead < 0:
            raise ValueError(f"negative token counts ({num_new}, {num_lookahead}) for {seq_id!r}")
        seq = self._seqs.get(seq_id)
        if seq is None:
            if hit is None or hit.request.seq_id != seq_id:
                raise ValueError(f"first allocation of {seq_id!r} needs its PrefixHit")
            hit_blocks = self._hit_blocks(hit)
            num_known, num_computed = len(hit.request.token_ids), hit.num_computed_tokens
            num_held, reused = len(hit_blocks), sum(block.ref_cnt == 0 for block in hit_blocks)
        else:
            if hit is not None:
                raise ValueError(f"sequence {seq_id!r} already holds blocks; a PrefixHit is for new ones")
            num_known, num_computed, num_held, reused = len(seq.token_ids), seq.num_computed, len(seq.blocks), 0
        if num_computed + num_new > num_known:
            raise ValueError(f"{seq_id!r}: {num_computed} + {num_new} positions but only {num_known} "
                             "known tokens (append sampled tokens first; speculative ones are lookahead)")
        total = -(-(num_computed + num_new + num_lookahead) // self.block_size)
        return max(total - num_held, 0), reused

    def _hit_blocks(self, hit: PrefixHit) -> list[Block]:
        blocks = [self._pool.blocks[block_id] for block_id in hit.block_ids]
        for block, block_hash in zip(blocks, hit.block_hashes):
            if block.block_hash != block_hash:
                raise StalePrefixHit(f"cached block {block.block_id} of {hit.request.seq_id!r} was evicted")
        return blocks

    def _admit(self, hit: PrefixHit) -> _Seq:
        """The sequence starts from its hit: the pool's blocks mapped, the tier's copied into fresh
        blocks (which enter the prefix cache as if computed)."""
        blocks = self._hit_blocks(hit)
        self._pool.touch(blocks)
        if hit.loaded:
            restored = self._pool.take_fresh(len(hit.loaded))
            self.tier.restore([block.block_id for block in restored], hit.loaded, hit.loaded_from_disk)
            blocks = blocks + restored
        request = hit.request
        seq = _Seq(list(request.token_ids), request.cache_salt, blocks, list(hit.block_hashes), hit.num_computed_tokens)
        seq.num_cached_blocks = len(hit.block_ids)
        self._seqs[request.seq_id] = seq
        self._requests += 1
        self._queried_tokens += len(request.token_ids)
        self._hit_tokens += hit.num_computed_tokens
        self._tier_hit_tokens += len(hit.loaded) * self.block_size
        self._cache_full_blocks(seq)
        return seq

    def _cache_full_blocks(self, seq: _Seq) -> None:
        """Offer the newly full, computed blocks to the prefix cache (each block hashed once)."""
        if not self.config.enable_prefix_caching:
            return
        num_full = min(seq.num_computed, len(seq.token_ids)) // self.block_size
        start = seq.num_cached_blocks
        if num_full <= start:
            return
        if len(seq.block_hashes) < num_full:
            seq.block_hashes = hash_full_blocks(seq.token_ids, self.block_size, seq.cache_salt,
                                                prior=seq.block_hashes, limit=num_full)
        bs = self.block_size
        parent = seq.block_hashes[start - 1] if start > 0 else None
        self._pool.cache(seq.blocks[start:num_full], seq.block_hashes[start:num_full], parent,
                         seq.token_ids[start * bs:num_full * bs])
        seq.num_cached_blocks = num_full
