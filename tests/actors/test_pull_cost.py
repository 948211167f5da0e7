"""The pull-or-compute decision follows the measured rates: a block's bytes over the link rate against
its tokens over the prefill rate, smoothed; the tier's eighth as the start; probes past a slow link."""
from __future__ import annotations

import pytest

from actors.messages.front_end import SamplingParams, SubmitRequest
from actors.scheduler.pull_cost import PullCost, RateMeter
from actors.scheduler.pulls import PullGate
from runtime import ActorSystem
from tests.actors.test_kv_handoff import Front

BLOCK_TOKENS, BLOCK_BYTES = 16, 12_288


def test_before_any_measurement_a_pull_costs_an_eighth_of_a_prefill():
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES)
    assert cost.block_ratio() == 1 / 8 and cost.should_pull()
    cost.prefilled(1_000, 10.0)              # one rate alone still leaves the assumption
    assert cost.block_ratio() == 1 / 8
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES)
    cost.pulled(1_000, 100.0)
    assert cost.block_ratio() == 1 / 8 and cost.should_pull()


@pytest.mark.parametrize("link_bytes_per_s, pulls", [(10 * BLOCK_BYTES, False), (1_000 * BLOCK_BYTES, True)])
def test_the_decision_follows_the_measured_rates(link_bytes_per_s, pulls):
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES)
    cost.prefilled(1_600, 1.0)                # 100 blocks a second computed
    cost.pulled(link_bytes_per_s, 1.0)        # 10 or 1,000 blocks a second pulled
    assert cost.block_ratio() == pytest.approx(100 * BLOCK_BYTES / link_bytes_per_s)
    assert cost.should_pull() is pulls


def test_a_faster_prefill_turns_a_worthwhile_pull_into_a_compute():
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES)
    cost.pulled(50 * BLOCK_BYTES, 1.0)        # 50 blocks a second over the link
    cost.prefilled(16 * 10, 1.0)              # 10 blocks a second computed: pull
    assert cost.should_pull()
    for _ in range(30):                       # the prefill measured at 1,000 blocks a second from now on
        cost.prefilled(16_000, 1.0)
    assert cost.prefill.rate == pytest.approx(16_000, rel=0.01) and not cost.should_pull()


def test_rates_are_smoothed_and_nothing_measures_nothing():
    meter = RateMeter(weight=0.25)
    meter.observe(0, 1.0)
    meter.observe(10, 0.0)
    assert meter.rate is None and meter.samples == 0
    meter.observe(100, 1.0)
    meter.observe(500, 1.0)                   # one outlier moves it a quarter of the way
    assert meter.rate == pytest.approx(200) and meter.samples == 2
    with pytest.raises(ValueError, match="smoothing weight"):
        RateMeter(weight=0)
    with pytest.raises(ValueError, match="cannot be priced"):
        PullCost(0, BLOCK_BYTES)


def test_a_slow_link_is_probed_again_every_so_often():
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES, probe_every=4)
    cost.prefilled(16_000, 1.0)
    cost.pulled(BLOCK_BYTES, 1.0)              # a block a second: far slower than computing it
    assert [cost.should_pull() for _ in range(8)] == [False, False, False, True] * 2
    assert cost.skipped == 6
    for _ in range(30):                        # the probes find the link fast again
        cost.pulled(10_000 * BLOCK_BYTES, 1.0)
    assert all(cost.should_pull() for _ in range(4))


def test_each_peer_is_its_own_link():
    cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES, probe_every=4)
    cost.prefilled(1_600, 1.0)                        # 100 blocks a second computed
    cost.pulled(10 * BLOCK_BYTES, 1.0, "far")         # 10 a second from one peer: compute instead
    cost.pulled(1_000 * BLOCK_BYTES, 1.0, "near")     # 1,000 a second from the other: pull
    assert not cost.should_pull("far") and cost.should_pull("near")
    assert cost.block_ratio("new") == 1 / 8 and cost.should_pull("new")   # unmeasured: the tier's eighth
    assert [cost.should_pull("far") for _ in range(3)] == [False, False, True]   # its own probe count
    assert cost.link.samples == 2                     # the stats' rate counts every peer's pulls


async def test_the_gate_holds_a_request_for_its_pull_only_when_pulling_pays():
    system = ActorSystem("gate-test")
    await system.start()
    try:
        peer = await system.spawn(Front(), name="peer")
        gate = PullGate()
        gate.enabled = True
        gate.cost = PullCost(BLOCK_TOKENS, BLOCK_BYTES)

        def submit(rid):
            return SubmitRequest(rid, [1, 2, 3], SamplingParams(), peer, pull_from=peer)

        assert gate.hold(submit("a"))             # unmeasured: pulled
        gate.cost.prefilled(16_000, 1.0)
        gate.cost.pulled(BLOCK_BYTES, 1.0, "elsewhere")
        assert gate.hold(submit("b"))              # another peer's slow link says nothing of this one's
        gate.cost.pulled(BLOCK_BYTES, 1.0, peer.node)
        assert not gate.hold(submit("c"))          # measured slow: computed here
    finally:
        await system.shutdown()
