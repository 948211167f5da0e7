"""A gateway routing to two engine processes draws each engine's own first-token and inter-token
latency: the quantiles an engine measured travel in the stats the gateway polls, so an engine
that served nothing shows none, and an engine's time to first token sits inside the gateway's."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.cluster.test_cluster import Cluster

pytestmark = pytest.mark.slow

LATENCIES = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.actors.conftest import build_tiny_model
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("dashboard-tiny")))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    c = Cluster(model, tmp_path_factory.mktemp("dashboard-logs"), "--routing", "round_robin")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def snapshot_where(base: str, done, n: int = 30) -> list[dict]:
    """The stream's snapshots up to the first for which `done` holds (one a second, at most n)."""
    seen = []
    with urllib.request.urlopen(base + "/dashboard/stream", timeout=30) as r:
        for line in r:
            if line.startswith(b"data: "):
                seen.append(json.loads(line[6:]))
                if done(seen[-1]):
                    return seen
                if len(seen) == n:
                    raise AssertionError(f"no snapshot as wanted in {n}: {seen[-1]}")
    raise AssertionError("the stream ended")


def measured(engine: dict) -> bool:
    return all(engine[k] is not None for k in LATENCIES)


def test_each_engine_shows_its_own_first_token_and_inter_token_latency(cluster):
    seen = snapshot_where(cluster.base, lambda s: len(s["engines"]) == 2)
    ids = sorted(seen[-1]["engines"])
    assert all(e[k] is None for e in seen[-1]["engines"].values() for k in LATENCIES)   # nothing served yet

    cluster.complete([5, 6, 7, 8], max_tokens=6)   # round robin: one engine serves it
    seen = snapshot_where(cluster.base, lambda s: any(e["generation_tokens"] == 6 and measured(e)
                                                      for e in s["engines"].values()))
    now = seen[-1]
    served = next(i for i in ids if now["engines"][i]["generation_tokens"] == 6)
    idle = next(i for i in ids if i != served)
    for s in seen:   # the idle engine never shows the other's figures
        assert all(s["engines"][idle][k] is None for k in LATENCIES), s
    e = now["engines"][served]
    assert 0 < e["ttft_p50"] <= e["ttft_p90"] and 0 < e["itl_p50"] <= e["itl_p90"]
    # One request in every window: the engine's first token (from arrival at its scheduler) came
    # within the gateway's (from the HTTP request to the first delta back).
    assert now["ttft_p50"] is not None and e["ttft_p90"] <= now["ttft_p50"]

    cluster.complete([9, 10, 11], max_tokens=4)   # and the other engine serves the next
    seen = snapshot_where(cluster.base, lambda s: s["engines"][idle]["generation_tokens"] == 4
                          and measured(s["engines"][idle]))
    e = seen[-1]["engines"][idle]
    assert 0 < e["ttft_p50"] <= e["ttft_p90"] and 0 < e["itl_p50"] <= e["itl_p90"]
