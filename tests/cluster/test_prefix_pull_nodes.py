"""A prefix pulled between two engine processes over the sealed cluster transport: the puller's greedy
tokens equal the holder's and its prompt is reloaded, not prefilled; with the holder killed, the pull
fails and the puller computes the same tokens."""
from __future__ import annotations

import asyncio

import pytest

from actors.messages.front_end import GetEngineInfo, SamplingParams, SubmitRequest, TokenDeltas
from runtime import Actor, ActorSystem
from runtime.redis_registry import RedisRegistry
from tests.cluster import harness as h
from tests.cluster.test_cluster import model  # noqa: F401  (the module's tiny model)

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class Replies(Actor):
    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.done: dict[str, asyncio.Event] = {}

    async def receive(self, msg):
        if isinstance(msg, TokenDeltas):
            for d in msg.deltas:
                self.tokens.setdefault(d.request_id, []).extend(d.token_ids)
                self.cached[d.request_id] = d.num_cached_tokens
                if d.finish_reason is not None:
                    self.done.setdefault(d.request_id, asyncio.Event()).set()


async def _scenario(redis_url: str, kill_holder) -> None:
    registry = RedisRegistry(redis_url, secret=h.SECRET)
    system = ActorSystem("pull-probe", secret=h.SECRET)
    await system.start()
    try:
        fronts = [system.ref_for(node, path) for node, path in (await registry.entries("engines/")).values()]
        infos = [await f.ask(GetEngineInfo(), timeout=10) for f in fronts]
        (holder, holder_info), (puller, _) = sorted(zip(fronts, infos), key=lambda fi: fi[1].engine_id)
        replies = Replies()
        ref = await system.spawn(replies, name="replies")

        async def run(front, rid, prompt, pull_from=None):
            replies.done[rid] = asyncio.Event()
            front.tell(SubmitRequest(rid, prompt, GREEDY, ref, pull_from=pull_from))
            await asyncio.wait_for(replies.done[rid].wait(), 120)
            return replies.tokens[rid], replies.cached[rid]

        prompt = [(i * 31) % 350 + 4 for i in range(200)]
        expected, cached = await run(holder, "h1", prompt)
        assert cached == 0
        tokens, cached = await run(puller, "p1", prompt, holder_info.kv_receiver)
        assert tokens == expected and cached == (len(prompt) - 1) // 16 * 16

        other = [(i * 17) % 350 + 4 for i in range(120)]
        expected, _ = await run(holder, "h2", other)
        kill_holder()
        tokens, cached = await run(puller, "p2", other, holder_info.kv_receiver)
        assert tokens == expected and cached == 0
    finally:
        await system.shutdown()
        await registry.close()


def test_a_prefix_pulled_between_engine_processes(model, tmp_path):  # noqa: F811
    redis = h.RedisServer()
    redis.start()
    nodes = []
    try:
        for port in (h.free_port(), h.free_port()):
            nodes.append(h.Node(h.engine_args(model, redis.url, port) + ["--kv-offload-memory", "64MiB"],
                                str(tmp_path / f"engine-{port}.log")).start())
        h.wait_until(lambda: len(h.engine_loads(redis.url)) == 2, 180, "2 engines registered", nodes)
        by_id = {f"engine-{n.args[n.args.index('--listen-port') + 1]}": n for n in nodes}
        holder = by_id[min(by_id)]
        asyncio.run(_scenario(redis.url, holder.kill))
    finally:
        for n in nodes:
            n.kill()
        redis.stop()
