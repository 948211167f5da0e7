"""A peer's pull served from the KV tier's disk: the read runs on a thread, so the holder's event loop
keeps answering other actors meanwhile, and the peer gets the block's bytes. The block's file is a
named pipe, a read that blocks until the test writes it: were the read on the loop, nothing else
would run until then. A step's own disk reads count in the tier's reload time; a waiting request's are
read ahead of its step, which then does not wait for the disk."""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import torch

from actors.kv import KVCacheConfig
from actors.kv.kv_actor import KVManagerActor
from actors.kv.tier_disk import DiskTier
from actors.messages.handoff import KVPull, KVPulled
from actors.messages.kv import GetKVStats, KVAdmit, KVReadAhead, KVStep
from prefix_store import hash_full_blocks
from runtime import ActorSystem
from tests.actors.test_kv_tier import BS, IDENTITY, OTHER, PROMPT, Engine, kv_of


class PipeWriter(threading.Thread):
    """Opens the pipe for writing (which returns once a reader opened it), tells the loop, then waits for
    the loop's answer (or `patience` seconds) before writing the file's bytes."""

    def __init__(self, path: str, raw: bytes, loop: asyncio.AbstractEventLoop, patience: float = 5.0):
        super().__init__(daemon=True)
        self.path, self.raw, self.loop, self.patience = path, raw, loop, patience
        self.reading: asyncio.Future = loop.create_future()
        self.answered = threading.Event()
        self.answered_in_time = False

    def run(self) -> None:
        with open(self.path, "wb") as pipe:
            self.loop.call_soon_threadsafe(self.reading.set_result, None)
            self.answered_in_time = self.answered.wait(self.patience)
            pipe.write(self.raw)


async def test_a_pull_read_from_disk_leaves_the_holders_loop_free(tmp_path):
    e = Engine(num_blocks=5, memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, 1 << 20))
    holder = KVManagerActor(KVCacheConfig(num_blocks=5, block_size=BS), e.tier, e.io)
    e.kv = holder.kv
    e.run("a", PROMPT)
    e.run("b", OTHER)                        # PROMPT's two blocks leave the pool: only the disk has them
    e.tier.disk.flush()
    hashes = hash_full_blocks(PROMPT, BS)
    assert e.kv.held_run(hashes) == 2 and e.kv.share_disk_reads(hashes) == hashes
    path = os.path.join(e.tier.disk.blocks_dir, hashes[1].hex() + ".kvb")
    raw = open(path, "rb").read()
    os.unlink(path)
    os.mkfifo(path)

    system = ActorSystem("share-test")
    await system.start()
    try:
        holder_ref = await system.spawn(holder, name="holder")
        other = await system.spawn(KVManagerActor(KVCacheConfig(num_blocks=4, block_size=BS)), name="other")
        writer = PipeWriter(path, raw, asyncio.get_running_loop())
        writer.start()
        pull = asyncio.ensure_future(holder_ref.ask(KVPull(hashes, "any"), timeout=30))
        await writer.reading                  # the holder is inside the block's read now
        stats = await other.ask(GetKVStats(), timeout=5)   # another actor of the process answers meanwhile
        assert stats.num_free_blocks == 4
        writer.answered.set()
        pulled: KVPulled = await pull
        writer.join()
        assert writer.answered_in_time, "the holder's event loop stood still while it read the block"
        assert len(pulled.blocks) == 2
        for block, block_hash in zip(pulled.blocks, hashes):   # each one's KV, layer by layer
            assert block == _expected_bytes(e, block_hash)
        assert e.kv.num_free_blocks == e.kv.num_total_blocks
    finally:
        await system.shutdown()
        e.tier.close()


def _expected_bytes(e: Engine, block_hash: bytes) -> bytes:
    """A block's bytes as the tier stores them: what computing it writes, in every layer's K and V."""
    scratch = e.io.tensors
    saved = [t[0].clone() for t in scratch]
    for t in scratch:
        t[0] = kv_of(block_hash)
    try:
        return bytes(e.io.read([0]))
    finally:
        for t, s in zip(scratch, saved):
            t[0] = s


@contextlib.asynccontextmanager
async def prompt_on_disk_alone(disk: DiskTier):
    """(the Engine, its KV actor's ref) over a disk-only tier where PROMPT's two blocks left the pool: only
    the disk has them."""
    e = Engine(num_blocks=5, memory_bytes=0, disk=disk)
    actor = KVManagerActor(KVCacheConfig(num_blocks=5, block_size=BS), e.tier, e.io)
    e.kv = actor.kv
    e.run("a", PROMPT)
    e.run("b", OTHER)
    e.tier.disk.flush()
    system = ActorSystem("disk-alone-test")
    await system.start()
    try:
        yield e, await system.spawn(actor, name="kv")
    finally:
        await system.shutdown()
        e.tier.close()


class SlowDisk(DiskTier):
    """A disk store whose every block read takes `delay` seconds."""

    delay = 0.1

    def get(self, block_hash):
        import time
        time.sleep(self.delay)
        return super().get(block_hash)


async def test_a_steps_disk_reads_count_in_the_tiers_reload_time(tmp_path):
    """The step waits for the blocks it reloads from disk (read ahead on a thread): that wait is reload time,
    as `matinee_kv_tier_load_seconds_total` says, not only the copy into the pool after it."""
    async with prompt_on_disk_alone(SlowDisk(str(tmp_path), IDENTITY, 1 << 20)) as (e, ref):
        before = await ref.ask(GetKVStats(), timeout=5)
        result = await ref.ask(KVStep([], [], [], [KVAdmit(1, PROMPT)], 64), timeout=30)
        assert result.admitted[0].num_cached_tokens == 8 and result.tier_hit_tokens == 8
        after = await ref.ask(GetKVStats(), timeout=5)
        assert after.tier_hits_disk - before.tier_hits_disk == 2
        assert after.tier_load_s - before.tier_load_s >= 2 * SlowDisk.delay


class CountingDisk(SlowDisk):
    """SlowDisk that counts the reads a step makes (`get`) apart from those read ahead (`peek`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gets = self.peeks = 0

    def get(self, block_hash):
        self.gets += 1
        return super().get(block_hash)

    def peek(self, block_hash):
        import time
        self.peeks += 1
        time.sleep(self.delay)
        return super().peek(block_hash)


async def test_a_waiting_requests_disk_blocks_are_read_ahead_and_its_step_does_not_wait(tmp_path):
    """KVReadAhead reads a request's disk blocks on a thread while the actor answers others; its step then
    takes them without a read of its own, and they hold the KV computed for them."""
    disk = CountingDisk(str(tmp_path), IDENTITY, 1 << 20)
    disk.delay = 0.5                             # the read-ahead takes a second
    async with prompt_on_disk_alone(disk) as (e, ref):
        ref.tell(KVReadAhead(KVAdmit(1, PROMPT)))
        t0 = asyncio.get_running_loop().time()
        await ref.ask(GetKVStats(), timeout=5)   # answered while the blocks are being read
        assert asyncio.get_running_loop().time() - t0 < 2 * disk.delay
        async with asyncio.timeout(10):
            while e.tier.warm_bytes < 2 * e.io.bytes_per_block:
                await asyncio.sleep(0.02)
        assert (disk.peeks, disk.gets) == (2, 0)
        result = await ref.ask(KVStep([], [], [], [KVAdmit(1, PROMPT)], 64), timeout=30)
        assert disk.gets == 0 and result.admitted[0].num_cached_tokens == 8
        table = result.admitted[0].block_table
        for i, block_hash in enumerate(hash_full_blocks(PROMPT, BS)):
            for layer in e.io.tensors:
                assert torch.equal(layer[table[i]], kv_of(block_hash))
        stats = await ref.ask(GetKVStats(), timeout=5)
        assert (stats.tier_hits_disk, stats.tier_hits_read_ahead) == (2, 2) and e.tier.warm_bytes == 0


async def test_a_step_waits_for_its_requests_read_ahead_instead_of_reading_again(tmp_path):
    """Admitted while its read-ahead is still reading, a request's step takes those reads when they end:
    each block is read from disk once."""
    disk = CountingDisk(str(tmp_path), IDENTITY, 1 << 20)
    async with prompt_on_disk_alone(disk) as (e, ref):
        ref.tell(KVReadAhead(KVAdmit(1, PROMPT)))
        result = await ref.ask(KVStep([], [], [], [KVAdmit(1, PROMPT)], 64), timeout=30)
        assert result.admitted[0].num_cached_tokens == 8 and (disk.peeks, disk.gets) == (2, 0)
        stats = await ref.ask(GetKVStats(), timeout=5)
        assert (stats.tier_hits_disk, stats.tier_hits_read_ahead) == (2, 2)
