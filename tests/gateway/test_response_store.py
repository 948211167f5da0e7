"""The response store's bounds and expiry, on a fake clock: entries, bytes, LRU order, TTL."""
import pytest

from gateway.config import GatewayConfig
from gateway.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def body(text: str = "x") -> dict:
    return {"id": "r", "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}


def test_the_least_recently_used_goes_first_when_entries_run_out():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20, ttl_s=60, clock=Clock())
    assert store.put("a", body(), []) and store.put("b", body(), [])
    assert store.get("a") is not None      # a is now the most recently used
    store.put("c", body(), [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2


def test_bytes_are_bounded_and_counted_back_on_delete():
    probe = ResponseStore(1000, 1 << 20, 60)   # measures one entry's size
    probe.put("a", body("y" * 100), [{"role": "user", "content": "hi"}])
    size = probe.nbytes
    assert size > 100
    store = ResponseStore(max_entries=100, max_bytes=2 * size + size // 2, ttl_s=60, clock=Clock())
    for rid in ("a", "b", "c"):
        store.put(rid, body("y" * 100), [{"role": "user", "content": "hi"}])
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    assert store.nbytes == 2 * size
    assert store.delete("b") and not store.delete("b")
    assert store.nbytes == size and len(store) == 1


def test_an_entry_larger_than_the_store_is_not_kept_and_evicts_nothing():
    store = ResponseStore(max_entries=10, max_bytes=300, ttl_s=60, clock=Clock())
    assert store.put("small", body(), [])
    assert not store.put("big", body("z" * 1000), [])
    assert store.get("big") is None and store.get("small") is not None


def test_entries_expire_ttl_after_they_were_stored_even_when_used():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60, clock=clock)
    store.put("a", body(), [])
    clock.now += 30
    store.put("b", body(), [])
    clock.now += 29.9
    assert store.get("a") is not None     # used, but its age still counts from when it was stored
    clock.now += 0.1
    assert store.get("a") is None and store.get("b") is not None
    clock.now += 30
    assert store.get("b") is None and len(store) == 0 and store.nbytes == 0


def test_storing_again_under_the_same_id_replaces_the_entry():
    store = ResponseStore(max_entries=10, max_bytes=1 << 20, ttl_s=60, clock=Clock())
    store.put("a", body("one"), [])
    size = store.nbytes
    store.put("a", body("two"), [])
    assert len(store) == 1 and store.nbytes == size
    assert store.get("a").body["output"][0]["content"][0]["text"] == "two"


def test_zero_entries_keeps_nothing_and_bad_bounds_are_refused():
    assert not ResponseStore(0, 1 << 20, 60).put("a", body(), [])
    with pytest.raises(ValueError):
        ResponseStore(1, 1, 0)
    with pytest.raises(ValueError):
        GatewayConfig(response_store_ttl_s=0)
    with pytest.raises(ValueError):
        GatewayConfig(response_store_entries=-1)
