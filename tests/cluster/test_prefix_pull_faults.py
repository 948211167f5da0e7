"""A holder engine killed in the middle of a prefix pull, between two engine processes: the puller keeps
the chunks that came, computes the rest of the prompt with the same greedy tokens, gets every block
back, and serves its other requests meanwhile and after.

The holder's blocks are on its disk tier, and one block file past the first chunk is a named pipe: the
holder's read of it waits until the test kills the holder, so the kill lands while the puller waits
for that chunk, never before or after it."""
from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from actors.messages.front_end import GetEngineInfo, GetStats, SubmitRequest
from prefix_store import hash_full_blocks
from runtime import ActorSystem
from runtime.redis_registry import RedisRegistry
from tests.cluster import harness as h
from tests.cluster.test_cluster import model  # noqa: F401  (the module's tiny model)
from tests.cluster.test_prefix_pull_nodes import GREEDY, Replies

pytestmark = pytest.mark.slow

BLOCKS_PER_CHUNK = 4
BYTES_PER_BLOCK = 3 * 2 * 16 * 2 * 16 * 4   # the tiny llama: 3 layers, K and V, 16 tokens, 2 heads of 16, float32
PROMPT = [(i * 31) % 350 + 4 for i in range(200)]      # 12 full blocks: three chunks
OTHERS = [[(i * k) % 350 + 4 for i in range(200)] for k in (17, 23)]


def _args(model: str, redis_url: str, port: int, *extra: str) -> list[str]:
    args = h.engine_args(model, redis_url, port)
    args[args.index("--num-blocks") + 1] = "16"   # two more prompts push the first one's blocks to disk
    return args + ["--kv-transfer-chunk", str(BLOCKS_PER_CHUNK * BYTES_PER_BLOCK), *extra]


def _open_for_writing(path: str) -> int | None:
    """The pipe's write end, once a reader has it open (None before)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return None
        raise


async def _scenario(redis_url: str, tier: str, holder_node: h.Node) -> None:
    registry = RedisRegistry(redis_url, secret=h.SECRET)
    system = ActorSystem("pull-fault-probe", secret=h.SECRET)
    await system.start()
    try:
        fronts = [system.ref_for(node, path) for node, path in (await registry.entries("engines/")).values()]
        infos = [await f.ask(GetEngineInfo(), timeout=10) for f in fronts]
        by_id = {info.engine_id: (f, info) for f, info in zip(fronts, infos)}
        (holder, holder_info), (puller, _) = by_id[holder_node.engine_id], by_id[holder_node.peer_id]
        replies = Replies()
        ref = await system.spawn(replies, name="replies")

        def submit(front, rid, prompt, pull_from=None) -> asyncio.Event:
            replies.done[rid] = asyncio.Event()
            front.tell(SubmitRequest(rid, prompt, GREEDY, ref, pull_from=pull_from))
            return replies.done[rid]

        async def run(front, rid, prompt):
            await asyncio.wait_for(submit(front, rid, prompt).wait(), 120)
            return replies.tokens[rid]

        expected = await run(holder, "h0", PROMPT)
        others = [await run(holder, f"h{i + 1}", p) for i, p in enumerate(OTHERS)]
        # The first block file of the second chunk becomes a pipe, once the tier's writer wrote it.
        path = os.path.join(tier, "blocks", hash_full_blocks(PROMPT, 16)[BLOCKS_PER_CHUNK].hex() + ".kvb")
        h.wait_until(lambda: os.path.exists(path), 30, "the block written to the holder's disk tier")
        os.unlink(path)
        os.mkfifo(path)

        pulled = submit(puller, "p", PROMPT, holder_info.kv_receiver)
        deadline, pipe = time.monotonic() + 60, None
        while pipe is None:                   # the holder reads the second chunk's first block now
            assert time.monotonic() < deadline, "the holder never read the block from its disk tier"
            await asyncio.sleep(0.05)
            pipe = _open_for_writing(path)
        try:
            # The puller serves another request while its pull waits.
            assert await run(puller, "meanwhile", OTHERS[0]) == others[0]
            assert not pulled.is_set()
            holder_node.kill()
        finally:
            os.close(pipe)
        await asyncio.wait_for(pulled.wait(), 120)
        assert replies.tokens["p"] == expected
        assert replies.cached["p"] == BLOCKS_PER_CHUNK * 16   # the first chunk came, the rest was computed
        assert await run(puller, "after", OTHERS[1]) == others[1]
        stats = await puller.ask(GetStats(), timeout=10)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        tier = stats.kv_tier
        assert (tier.tier_pulls, tier.tier_pull_failures) == (1, 1)
        assert tier.tier_bytes_pulled == BLOCKS_PER_CHUNK * BYTES_PER_BLOCK
    finally:
        await system.shutdown()
        await registry.close()


def test_a_holder_killed_mid_pull_costs_only_the_rest_of_the_prefill(model, tmp_path):  # noqa: F811
    redis = h.RedisServer()
    redis.start()
    tier = str(tmp_path / "holder-tier")
    holder_port, puller_port = h.free_port(), h.free_port()
    holder = h.Node(_args(model, redis.url, holder_port, "--kv-offload-dir", tier), str(tmp_path / "holder.log"))
    puller = h.Node(_args(model, redis.url, puller_port, "--kv-offload-memory", "64MiB"), str(tmp_path / "puller.log"))
    holder.engine_id, holder.peer_id = f"engine-{holder_port}", f"engine-{puller_port}"
    nodes = [holder.start(), puller.start()]
    try:
        h.wait_until(lambda: len(h.engine_loads(redis.url)) == 2, 180, "2 engines registered", nodes)
        asyncio.run(_scenario(redis.url, tier, holder))
    finally:
        for n in nodes:
            n.kill()
        redis.stop()
