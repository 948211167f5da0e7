"""The Batch API in a cluster: two gateways and two engines as processes on loopback, with a
redis-server of their own holding the files and batches. A batch made through one gateway is read,
cancelled and downloaded through the other; its lines spread over the engines, those sharing a
prefix together; when the gateway running a batch is killed the other takes it over and answers
every line exactly once; and when an engine is killed its lines continue on the other."""
from __future__ import annotations

import asyncio
import functools
import io
import json
import random
import time

import openai
import pytest
import redis

from tests.cluster import harness as h
from tests.gateway import test_batches_api

pytestmark = pytest.mark.slow
LEASE_S = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("batch-cluster-tiny")))


class Cluster:
    def __init__(self, model: str, logs):
        self.redis = h.RedisServer()
        self.redis.start()
        self.engines = [h.Node(h.engine_args(model, self.redis.url, port), str(logs / f"engine-{port}.log")).start()
                        for port in (h.free_port(), h.free_port())]
        self.gateways, self.clients = [], []
        for i in range(2):
            port = h.free_port()
            self.gateways.append(h.Node(h.gateway_args(model, self.redis.url, port, "--batch-lease", str(LEASE_S),
                                                       "--batch-concurrency", "8", "--disable-access-log"),
                                        str(logs / f"gateway-{i}.log")).start())
            self.clients.append(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                              max_retries=0, timeout=60))
        for client in self.clients:
            base = str(client.base_url).removesuffix("/v1/")
            h.wait_until(lambda: h.metric(base, "matinee_engines") == 2, 180, "both engines behind each gateway",
                         self.nodes())

    def nodes(self):
        return [*self.engines, *self.gateways]

    def engine_stats(self) -> dict:
        """{engine address: its EngineStats}, asked of each engine."""
        from actors.messages.front_end import GetStats
        from runtime import ActorSystem
        from runtime.redis_registry import RedisRegistry

        async def probe() -> dict:
            registry = RedisRegistry(self.redis.url, secret=h.SECRET)
            system = ActorSystem("probe", secret=h.SECRET)
            await system.start()
            try:
                return {node: await system.ref_for(node, path).ask(GetStats(), timeout=5)
                        for node, path in (await registry.entries("engines/")).values()}
            finally:
                await system.shutdown()
                await registry.close()

        return asyncio.run(probe())

    def batch_lines_finished(self) -> dict[str, int]:
        """{engine address: batch lines it has finished}."""
        return {node: s.ballast_finished for node, s in self.engine_stats().items()}

    def wait_idle(self) -> None:
        """Until no engine runs or queues a request (an earlier test's lines may still be ending), and the
        gateways have polled that (every 0.25 s): a load left over would rightly steer routing."""
        h.wait_until(lambda: all(s.requests_running == s.requests_waiting == 0
                                 for s in self.engine_stats().values()), 60, "idle engines", self.nodes())
        time.sleep(1.0)

    def holder(self, batch_id: str) -> int:
        """Which gateway holds the batch's lease (its token names the process)."""
        token = redis.Redis.from_url(self.redis.url).get(f"matinee:batch:lease:{batch_id}")
        pid = int(token.decode().split(":")[1])
        return next(i for i, g in enumerate(self.gateways) if g.proc.pid == pid)

    def results(self, batch_id: str) -> list[dict]:
        raw = redis.Redis.from_url(self.redis.url).hvals(f"matinee:batch:results:{batch_id}")
        return [json.loads(r) for r in raw]

    def stop(self) -> None:
        for node in self.nodes():
            node.kill()
        self.redis.stop()


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, tmp_path_factory.mktemp("batch-cluster-logs"))
    try:
        yield c
    finally:
        c.stop()


def jsonl(n: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Line {i}"}],
                                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode()
                    + b"\n" for i in range(n))


def create(client, n: int, max_tokens: int):
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(n, max_tokens))), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


wait = functools.partial(test_batches_api.wait, timeout=180.0)   # processes start and route: more time


def lines_answered(base: str) -> float:
    """Batch lines this gateway ran and recorded (none before its first)."""
    value = h.metric(base, "matinee_batch_lines_total")
    return 0.0 if value != value else value


def custom_ids(client, file_id: str) -> list[str]:
    return [json.loads(line)["custom_id"] for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_made_through_one_gateway_is_read_through_the_other(cluster):
    a, b = cluster.clients
    batch = create(a, 4, 4)
    assert b.batches.retrieve(batch.id).input_file_id == batch.input_file_id
    assert b.files.retrieve(batch.input_file_id).bytes > 0
    assert b.files.content(batch.input_file_id).text.count("\n") == 4
    done = wait(b, batch.id, nodes=cluster.nodes())
    assert done.status == "completed" and done.request_counts.completed == 4
    assert sorted(custom_ids(b, done.output_file_id)) == ["l0", "l1", "l2", "l3"]
    assert custom_ids(a, done.output_file_id) == custom_ids(b, done.output_file_id)
    assert batch.id in [x.id for x in b.batches.list().data]


def test_a_cancel_through_the_other_gateway_stops_the_batch(cluster):
    # Long enough that the cancel lands mid-batch: the gateway running it reads a cancel asked of another at its
    # next upkeep (a third of the lease), and 30 lines of 24 tokens had all been answered by then on a Xeon.
    a, b = cluster.clients
    n = 48
    batch = create(a, n, 96)
    running = cluster.holder(batch.id)
    other = cluster.clients[1 - running]
    wait(other, batch.id, until=lambda x: x.request_counts.completed >= 1, nodes=cluster.nodes())
    assert other.batches.cancel(batch.id).status == "cancelling"
    done = wait(other, batch.id, nodes=cluster.nodes())
    assert done.status == "cancelled" and done.cancelled_at, done
    assert 1 <= done.request_counts.completed < n
    assert len(custom_ids(b, done.output_file_id)) == done.request_counts.completed


def test_lines_spread_over_the_engines_and_those_sharing_a_prefix_go_together(cluster):
    """Two system prompts of six blocks, five lines on one and three on the other, sent all at once
    (before any engine has computed either prefix, so before the prefix index knows of them): each
    group runs whole on one engine, and the two groups on different engines."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(4, 360) for _ in range(6 * 16)] for _ in range(2)]
    groups = [0, 1, 0, 1, 0, 1, 0, 0]
    # Long enough that the lines run together: a line done before the next is routed leaves both engines
    # idle, and then either may take the other prefix.
    lines = [{"custom_id": f"g{g}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": prefixes[g] + [rng.randrange(4, 360) for _ in range(3)],
                       "max_tokens": 48, "temperature": 0, "ignore_eos": True}} for i, g in enumerate(groups)]
    cluster.wait_idle()
    before = cluster.batch_lines_finished()
    client = cluster.clients[0]
    f = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(json.dumps(x).encode() + b"\n" for x in lines))),
                            purpose="batch")
    done = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                              completion_window="24h").id, nodes=cluster.nodes())
    assert done.status == "completed" and done.request_counts.completed == 8
    after = cluster.batch_lines_finished()
    ran = sorted(after[node] - before.get(node, 0) for node in after)
    assert ran == [3, 5], ran   # not 4 and 4 (by load alone), nor 8 and 0 (by prefix alone)


def test_a_gateway_killed_mid_batch_leaves_it_to_the_other_which_answers_every_line_once(cluster):
    n = 32
    batch = create(cluster.clients[0], n, 32)
    wait(cluster.clients[1], batch.id, until=lambda x: x.request_counts.completed >= 2, nodes=cluster.nodes())
    running = cluster.holder(batch.id)
    survivor = 1 - running
    base = str(cluster.clients[survivor].base_url).removesuffix("/v1/")
    answered_before = lines_answered(base)
    cluster.gateways[running].kill()   # SIGKILL: nothing aborted, nothing flushed, its lease left to lapse
    recorded = len(cluster.results(batch.id))
    assert 2 <= recorded < n
    client = cluster.clients[survivor]
    done = wait(client, batch.id, nodes=cluster.nodes())
    assert done.status == "completed" and done.request_counts.completed == n
    assert sorted(custom_ids(client, done.output_file_id)) == sorted(f"l{i}" for i in range(n))   # none twice
    assert sorted(r["index"] for r in cluster.results(batch.id)) == list(range(n))
    answered = lines_answered(base) - answered_before
    assert answered == n - recorded   # the survivor ran only the lines the dead gateway had not recorded


def test_an_engine_killed_mid_batch_loses_no_line_and_answers_none_twice(cluster):
    """After the gateway kill above, one gateway is left: an engine SIGKILLed while batch lines run on it.
    Its lines continue on the other engine; every line is answered once, with the text the live endpoint
    gives the same request."""
    alive = next(i for i, g in enumerate(cluster.gateways) if g.proc.poll() is None)
    client = cluster.clients[alive]
    n = 24
    batch = create(client, n, 32)
    base = str(client.base_url).removesuffix("/v1/")
    migrated = h.metric(base, "matinee_request_migrations_total")
    wait(client, batch.id, until=lambda x: x.request_counts.completed >= 2, nodes=cluster.nodes())
    cluster.engines[0].kill()
    done = wait(client, batch.id, timeout=300, nodes=cluster.nodes())
    assert done.status == "completed" and done.request_counts.completed == n and done.request_counts.failed == 0
    assert h.metric(base, "matinee_request_migrations_total") > migrated   # lines were running on the dead one
    lines = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(f"l{i}" for i in range(n))   # each once
    texts = {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in lines}
    for i in range(n):
        live = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Line {i}"}],
                                              max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
        assert texts[f"l{i}"] == live.choices[0].message.content, i
