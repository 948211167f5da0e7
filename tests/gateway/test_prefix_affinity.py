"""The pool's memory of where batch lines' prompt blocks were just sent: the longest leading run
wins, entries lapse after their time, and the oldest go first past the bound."""
import pytest

from gateway.prefix_affinity import PrefixAffinity
from prefix_store import PromptHasher


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_engine_sent_the_longest_shared_prefix_is_found():
    hasher, clock = PromptHasher(4), Clock()
    affinity = PrefixAffinity(ttl_s=5.0, clock=clock)
    system = list(range(12))
    affinity.remember(hasher.block_hashes(system + [50, 51, 52, 53]), "engine-a")
    affinity.remember(hasher.block_hashes(system[:4] + [90] * 8), "engine-b")
    assert affinity.match(hasher.block_hashes(system + [60, 61, 62, 63])) == ("engine-a", 3)
    assert affinity.match(hasher.block_hashes(system[:4] + [90] * 4 + [1] * 4)) == ("engine-b", 2)
    assert affinity.match(hasher.block_hashes([7] * 12)) == (None, 0)
    assert affinity.match(hasher.block_hashes(system, cache_salt="another tenant")) == (None, 0)
    assert affinity.match(hasher.block_hashes([1, 2])) == (None, 0)   # shorter than a block
    clock.t += 5.0   # by now the prefix index knows where the blocks are
    assert affinity.match(hasher.block_hashes(system)) == (None, 0)


def test_it_stays_bounded():
    hasher = PromptHasher(4)
    affinity = PrefixAffinity(max_entries=3)
    affinity.remember(hasher.block_hashes(list(range(8))), "old")
    affinity.remember(hasher.block_hashes([9] * 8), "new")
    assert len(affinity._sent) == 3
    assert affinity.match(hasher.block_hashes(list(range(4)))) == (None, 0)   # the oldest entry went first
    assert affinity.match(hasher.block_hashes(list(range(8)))) == ("old", 2)  # a chained hash: the whole prefix
    assert affinity.match(hasher.block_hashes([9] * 8)) == ("new", 2)
    with pytest.raises(ValueError):
        PrefixAffinity(ttl_s=0)
