"""The scheduler's counters reach EngineStats by name: each one is declared once in Counters (or
HandoffCounters) and once in EngineStats, and copied without a line of its own."""

from __future__ import annotations

from dataclasses import fields

import msgspec

from actors.messages.front_end import EngineStats
from actors.messages.handoff import HandoffSent
from actors.scheduler.counters import Counters, HandoffCounters, stats_fields
from runtime.histogram import Histogram

STATS_FIELDS = set(EngineStats.__struct_fields__)


def _filled(counters) -> dict:
    """A value of each counter, distinct from every other's."""
    for i, f in enumerate(fields(counters), start=3):
        value = getattr(counters, f.name)
        if isinstance(value, Histogram):
            value.observe(0.002 * i, times=i)
        elif isinstance(value, dict):
            value[f"adapter{i}"] += i
        elif isinstance(value, list):
            value.extend([i, i + 1])
        else:
            setattr(counters, f.name, type(value)(i))
    return stats_fields(counters)


def test_every_counter_names_a_field_of_the_engine_stats():
    for counters in (Counters(), HandoffCounters()):
        missing = set(stats_fields(counters)) - STATS_FIELDS
        assert not missing, f"{type(counters).__name__} fields EngineStats lacks: {sorted(missing)}"


def test_the_stats_carry_each_counter_s_value():
    counters, handoffs = Counters(), HandoffCounters()
    expected = {**_filled(counters), **_filled(handoffs)}
    assert not set(stats_fields(counters)) & set(stats_fields(handoffs))
    stats = EngineStats(requests_running=0, requests_waiting=0, kv_blocks_total=0, kv_blocks_free=0,
                        **expected)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=EngineStats)
    for name, value in expected.items():
        assert getattr(decoded, name) == value, name
    assert decoded.ttft_buckets[:-1] != [0] * (len(decoded.ttft_buckets) - 1)   # a histogram's counts came
    assert decoded.lora_requests and decoded.spec_decode_accepted_per_pos


def test_stats_fields_copies_so_the_stats_do_not_move_with_the_counters():
    counters = Counters()
    counters.spec_decode_accepted_per_pos = [1, 2]
    taken = stats_fields(counters)
    counters.spec_decode_accepted_per_pos[0] = 9
    counters.ttft.observe(0.1)
    assert taken["spec_decode_accepted_per_pos"] == [1, 2] and sum(taken["ttft_buckets"]) == 0


def test_a_handoff_sent_counts_what_it_moved_and_a_failed_one_only_itself():
    h = HandoffCounters()
    h.sent(HandoffSent(seq_id=1, ok=True, refused=False, num_blocks=4, num_bytes=400, seconds=0.5,
                       num_blocks_ahead=1, num_bytes_ahead=100))
    h.sent(HandoffSent(seq_id=2, ok=False, refused=True, num_blocks=9, num_bytes=900, seconds=1.0))
    assert stats_fields(h) == {"kv_handoffs_sent": 1, "kv_handoffs_failed": 1, "kv_handoffs_received": 0,
                               "kv_handoffs_refused": 0, "kv_transfer_blocks": 4, "kv_transfer_blocks_ahead": 1,
                               "kv_transfer_bytes": 400, "kv_transfer_bytes_ahead": 100, "kv_transfer_s": 0.5}
