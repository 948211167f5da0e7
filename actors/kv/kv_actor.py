"""The KV manager actor: a thin shell that turns messages into calls on the pure KVCacheManager.

`apply_kv_step` runs one scheduler step's transaction (trims, forks, frees, grows, admits) with the
manager's check-then-change calls and returns the block table of each sequence it scheduled, so a
step costs one round trip whatever its batch size. The manager's events leave only as messages
(`KVActorEvents` reads them for the prefix index).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from actors.kv.manager import KVCacheManager
from actors.kv.structs import KVCacheConfig, KVRequest
from actors.kv.tier import KVTier
from actors.messages.handoff import KVPull, KVPulled
from actors.messages.kv import (
    DrainKVEvents, GetKVSnapshot, GetKVStats, KVAdmit, KVAdmitted, KVConfirm, KVEvents, KVEventsWaiting, KVFree,
    KVHeldRun, KVReadAhead, KVReserve, KVReserved, KVSnapshot, KVStats, KVStep, KVStepResult, KVTierPut,
    SubscribeKVEvents,
)
from prefix_store.events import KVEvent
from prefix_store.hashing import BlockHash
from runtime import Actor, ActorRef, get_logger

if TYPE_CHECKING:
    from actors.worker.kv_blocks import KVBlockIO   # torch: only where an engine runs

log = get_logger(component="kv-manager")

# A block copied back from the tier costs the step a memory copy, not a forward: its tokens take an
# eighth of the budget computing them would (counted like a short prefill chunk of the step).
RELOADED_PER_BUDGET_TOKEN = 8


def apply_kv_step(kv: KVCacheManager, msg: KVStep) -> KVStepResult:
    """Trims (speculative rollback), forks, frees, grows in order (stopping at the first that does not fit), then admissions while
    the token budget and the pool allow. A grow that did not fit changes nothing."""
    for fork in msg.forks:  # checked before anything changes: the worker copies no KV for a fork
        if fork.num_tokens % kv.block_size:
            raise ValueError(f"fork of {fork.num_tokens} positions is not on a block boundary")
    for trim in msg.trims:  # a sequence freed since its verification holds nothing to trim
        if kv.has_seq(str(trim.seq_id)):
            kv.trim(str(trim.seq_id), trim.num_tokens)
    forked, unforked = [], set()
    for fork in msg.forks:
        parent, child = str(fork.parent_seq_id), str(fork.child_seq_id)
        # Only whole shared blocks: the child recomputes the partial one, so no KV copy.
        if kv.has_seq(parent) and kv.can_fork(parent, fork.num_tokens):
            kv.fork(parent, child, fork.num_tokens)
            forked.append(True)
        else:
            forked.append(False)
            unforked.add(fork.child_seq_id)
    _free(kv, msg.frees)
    for grow in msg.grows:  # all of them: tokens are facts, even for grows not reached below
        if grow.seq_id not in unforked:
            seq_id = str(grow.seq_id)
            known = kv.num_tokens(seq_id)
            if len(grow.token_ids) > known:
                kv.append_token_ids(seq_id, grow.token_ids[known:])
    grown, grow_failed = [], False
    writers: dict[int, int] = {}  # block id -> the sequence whose KV this step writes into it
    for grow in msg.grows:
        if grow.seq_id in unforked:
            grown.append([])
            continue
        seq_id = str(grow.seq_id)
        lookahead = grow.num_lookahead_tokens
        if not kv.can_allocate(seq_id, grow.num_new_tokens, num_lookahead_tokens=lookahead):
            grow_failed = True
            break
        start = kv.num_computed_tokens(seq_id)
        kv.allocate_slots(seq_id, grow.num_new_tokens, num_lookahead_tokens=lookahead)
        grown.append(kv.block_table(seq_id))
        _note_writes(writers, kv, grow.seq_id, start)
    admitted, budget = [], msg.token_budget
    stats_before = kv.stats
    for admit in [] if grow_failed else msg.admits:
        if budget <= 0:
            break
        seq_id = str(admit.seq_id)
        hit = kv.get_computed_blocks(KVRequest(seq_id, admit.token_ids, admit.cache_salt,
                                               admit.read_prefix_cache))
        num_new = min(len(admit.token_ids) - hit.num_computed_tokens, budget)
        if not kv.can_allocate(seq_id, num_new, hit=hit):
            break  # first come, first served: nobody jumps a request that does not fit
        kv.allocate_slots(seq_id, num_new, hit=hit)
        # Blocks hashed at allocation get their KV in this step's forward: a hit on them is good only
        # if their writer's step succeeds.
        reads_from = sorted({writers[b] for b in hit.block_ids if b in writers})
        admitted.append(KVAdmitted(admit.seq_id, hit.num_computed_tokens, num_new, kv.block_table(seq_id), reads_from))
        _note_writes(writers, kv, admit.seq_id, hit.num_computed_tokens)
        budget -= num_new + -(-len(hit.loaded) * kv.block_size // RELOADED_PER_BUDGET_TOKEN)
    stats = kv.stats
    return KVStepResult(forked, grown, grow_failed, admitted, kv.num_free_blocks,
                        stats.queried_tokens - stats_before.queried_tokens,
                        stats.hit_tokens - stats_before.hit_tokens, kv.num_table_blocks,
                        stats.tier_hit_tokens - stats_before.tier_hit_tokens)


def _note_writes(writers: dict[int, int], kv: KVCacheManager, seq_id: int, start: int) -> None:
    """The sequence's blocks from the one holding position `start` on get their KV in this step."""
    for block_id in kv.block_table(str(seq_id))[start // kv.block_size:]:
        writers[block_id] = seq_id


def apply_kv_free(kv: KVCacheManager, msg: KVFree) -> None:
    """Failed sequences forget the KV their step never wrote, then every listed sequence is freed."""
    for unwritten in msg.unwritten:
        seq_id = str(unwritten.seq_id)
        if kv.has_seq(seq_id):  # one aborted during its step forgot then, with its free
            kv.forget_unwritten(seq_id, unwritten.num_tokens)
    _free(kv, msg.seq_ids)


def apply_kv_reserve(kv: KVCacheManager, msg: KVReserve) -> KVReserved:
    """Blocks for a handed-over sequence: cached leading blocks where the prefix cache has them,
    fresh ones for the rest, held as lookahead slots so that nothing is hashed before the KV is
    written (KVConfirm does that). Nothing is copied back from the tier: a reservation may come while
    a forward runs, and the sender has the blocks anyway."""
    seq_id = str(msg.seq_id)
    hit = kv.get_computed_blocks(KVRequest(seq_id, msg.token_ids, msg.cache_salt), from_tier=False)
    rest = msg.num_tokens - hit.num_computed_tokens
    if not kv.can_allocate(seq_id, 0, num_lookahead_tokens=rest, hit=hit):
        return KVReserved(None)
    kv.allocate_slots(seq_id, 0, num_lookahead_tokens=rest, hit=hit)
    return KVReserved(kv.block_table(seq_id), len(hit.block_ids))


def kv_stats(kv: KVCacheManager) -> KVStats:
    """The pool's occupancy and, with a tier, what the tier holds and has moved."""
    tier = kv.tier
    if tier is None:
        return KVStats(kv.num_total_blocks, kv.num_free_blocks, kv.num_cached_blocks)
    disk = tier.disk
    return KVStats(kv.num_total_blocks, kv.num_free_blocks, kv.num_cached_blocks, True, tier.num_blocks,
                   tier.memory_used, disk.bytes_used if disk is not None else 0, tier.hits_memory, tier.hits_disk,
                   tier.bytes_saved, tier.bytes_loaded, tier.load_s, tier.save_s,
                   disk.write_failures + disk.dropped if disk is not None else 0,
                   disk.discarded if disk is not None else 0, tier.bytes_pulled, tier.pulls, tier.pull_failures,
                   tier.pull_s, tier.hits_warm)


def _free(kv: KVCacheManager, seq_ids: list[int]) -> None:
    for seq_id in seq_ids:
        seq_id = str(seq_id)
        if kv.has_seq(seq_id):  # a sequence aborted before it ever got blocks holds none
            kv.free(seq_id)


class _Warmed:
    """The disk blocks a KVReadAhead read, back on the actor's loop (a tell to itself)."""

    def __init__(self, blocks: dict[BlockHash, bytes | None]):
        self.blocks = blocks


class KVManagerActor(Actor):
    """`blocks`: the cache as bytes, to give a peer engine the blocks it pulls."""

    def __init__(self, config: KVCacheConfig, tier: KVTier | None = None, blocks: KVBlockIO | None = None):
        self.config = config
        self.blocks = blocks
        self.kv = KVCacheManager(config, tier)
        self._subscribers: list[ActorRef] = []
        self._warming: dict[BlockHash, asyncio.Task] = {}   # being read for a KVReadAhead, by which read

    async def on_stop(self) -> None:
        """At shutdown and on a restart: what the pool caches goes to a disk tier too, and its writer
        finishes what is queued (a restarted process finds it all) and goes on; the engine closes the
        tier once every actor stopped."""
        for task in set(self._warming.values()):
            task.cancel()
        if self.kv.tier is not None and self.kv.tier.disk is not None:
            self.kv.save_cached_to_tier()
            await asyncio.to_thread(self.kv.tier.disk.flush)

    async def receive(self, msg: Any) -> Any:
        match msg:
            case KVStep():
                before = self.kv.next_event_seq
                await self._read_ahead(msg)
                try:
                    result = apply_kv_step(self.kv, msg)
                finally:
                    if self.kv.tier is not None:
                        self.kv.tier.unstage()
                self._events_recorded(before)
                return result
            case KVFree():
                before = self.kv.next_event_seq
                apply_kv_free(self.kv, msg)
                self._events_recorded(before)
                return None
            case KVReserve():
                return apply_kv_reserve(self.kv, msg)
            case KVConfirm(seq_id=seq_id, num_tokens=n):
                before = self.kv.next_event_seq
                self.kv.trim(str(seq_id), n)
                self._events_recorded(before)
                return None
            case GetKVStats():
                return kv_stats(self.kv)
            case KVHeldRun(block_hashes=hashes):
                return self.kv.held_run(hashes)
            case KVPull(block_hashes=hashes):
                if self.blocks is None:
                    return KVPulled([])
                before = self.kv.next_event_seq
                await self._read_ahead_for_share(hashes)
                try:
                    return KVPulled(self._share(hashes))
                finally:
                    if self.kv.tier is not None:
                        self.kv.tier.unstage()
                    self._events_recorded(before)
            case KVReadAhead(admit=admit):
                self._read_while_waiting(admit)
                return None
            case _Warmed(blocks=blocks):
                self._warm(blocks)
                return None
            case KVTierPut(block_hashes=hashes, blocks=blocks, seconds=seconds, failed=failed):
                before = self.kv.next_event_seq
                if self.kv.tier is not None:
                    self.kv.tier.pulled(hashes, blocks, seconds, failed)
                self._events_recorded(before)
                return None
            case DrainKVEvents():
                return KVEvents(self.kv.take_events(), self.kv.next_event_seq)
            case GetKVSnapshot():
                next_seq, hashes = self.kv.snapshot()
                return KVSnapshot(next_seq, hashes)
            case SubscribeKVEvents(subscriber=subscriber):
                self._subscribers.append(subscriber)
                return None
        return await super().receive(msg)

    def _share(self, hashes: list[bytes]) -> list[bytes]:
        return [b if isinstance(b, bytes) else bytes(self.blocks.read([b])) for b in self.kv.shareable(hashes)]

    async def _read_ahead(self, msg: KVStep) -> None:
        """Tier blocks the step's admissions will want from disk are read on a thread first: the
        event loop (and, in one process, the gateway's streams) never waits on the disk. Those a
        request's read-ahead is reading already are waited for, not read again."""
        requests = [KVRequest(str(a.seq_id), a.token_ids, a.cache_salt, a.read_prefix_cache) for a in msg.admits]
        reading = {self._warming[h] for r in requests for h in self.kv.disk_reads(r) if h in self._warming}
        started = time.perf_counter()
        for task in reading:
            self._warm(await asyncio.shield(task))
        if reading:
            self.kv.tier.load_s += time.perf_counter() - started   # the step waited for them: reload time
        wanted = [h for r in requests for h in self.kv.disk_reads(r)]
        if wanted:
            started = time.perf_counter()
            blocks = await asyncio.to_thread(self.kv.tier.read_disk, list(dict.fromkeys(wanted)))
            self.kv.tier.stage(blocks, time.perf_counter() - started)   # the step waited for it: reload time

    def _read_while_waiting(self, admit: KVAdmit) -> None:
        """A waiting request's disk blocks, read on a thread while this actor goes on (`DiskTier.peek`
        changes nothing the actor's transactions use) and handed to the tier when read."""
        wanted = [h for h in self.kv.disk_reads(KVRequest(str(admit.seq_id), admit.token_ids, admit.cache_salt,
                                                          admit.read_prefix_cache)) if h not in self._warming]
        if not wanted:
            return
        disk, me = self.kv.tier.disk, self.context.self_ref

        async def read() -> dict[BlockHash, bytes | None]:
            try:
                blocks = await asyncio.to_thread(lambda: {h: disk.peek(h) for h in wanted})
            except Exception:   # a read-ahead that fails costs only the step's own read
                log.exception("a KV tier read-ahead failed")
                blocks = dict.fromkeys(wanted)
            me.tell(_Warmed(blocks))
            return blocks
        task = asyncio.get_running_loop().create_task(read())
        self._warming.update(dict.fromkeys(wanted, task))

    def _warm(self, blocks: dict[BlockHash, bytes | None]) -> None:
        """A read-ahead's blocks into the tier, but those a step took from disk meanwhile (the pool has them)."""
        for block_hash in blocks:
            self._warming.pop(block_hash, None)
        if self.kv.tier is not None:
            self.kv.tier.warm({h: b for h, b in blocks.items() if not self.kv.in_pool(h)})

    async def _read_ahead_for_share(self, hashes: list[BlockHash]) -> None:
        """The tier's disk blocks a peer's pull wants are read on a thread first, as a step's are: a slow
        disk holds up the pull, never this process's event loop."""
        wanted = self.kv.share_disk_reads(hashes)
        if wanted:
            self.kv.tier.stage(await asyncio.to_thread(self.kv.tier.read_disk, wanted))

    def _events_recorded(self, before: int) -> None:
        """Subscribers hear of a transaction's events; the events wait in the log for their drain."""
        if self.kv.next_event_seq != before:
            for subscriber in self._subscribers:
                subscriber.tell(KVEventsWaiting())


class KVActorEvents:
    """The KV actor's events as the prefix index's publisher reads them (`prefix_store.KVEventSource`):
    each read is one ask, answered between two of the actor's transactions."""

    def __init__(self, kv: ActorRef, timeout_s: float = 10.0) -> None:
        self.kv = kv
        self.timeout_s = timeout_s

    async def take_events(self) -> list[KVEvent]:
        drained: KVEvents = await self.kv.ask(DrainKVEvents(), timeout=self.timeout_s)
        return drained.events

    async def snapshot(self) -> tuple[int, list[BlockHash]]:
        snap: KVSnapshot = await self.kv.ask(GetKVSnapshot(), timeout=self.timeout_s)
        return snap.next_seq, snap.block_hashes
