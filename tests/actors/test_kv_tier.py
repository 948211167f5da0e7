"""The KV tier under the KV manager: evicted blocks come back byte for byte instead of being computed,
from host memory or from a disk store that outlives the process; salts keep tenants apart; a damaged
file, another identity or a failing disk only costs a recompute."""

import os

import pytest
import torch

from actors.kv import KVCacheConfig, KVCacheManager, KVRequest
from actors.kv.kv_actor import apply_kv_step, kv_stats
from actors.kv.tier import KVTier
from actors.kv.tier_disk import DiskTier
from actors.messages.kv import KVAdmit, KVStep
from actors.worker.kv_blocks import KVBlockIO
from prefix_store import BlockRemoved, BlockStored, hash_full_blocks

BS = 4
IDENTITY = {"model": "tiny", "dtype": "float32", "kv_layout": "2x(...)", "block_size": BS}


def cache(num_blocks: int) -> KVBlockIO:
    return KVBlockIO([(torch.zeros(num_blocks, BS, 2, 8), torch.zeros(num_blocks, BS, 2, 8)) for _ in range(2)])


def kv_of(block_hash: bytes) -> torch.Tensor:
    """What "computing" a block writes: a function of its chained hash alone."""
    g = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little"))
    return torch.randn(BS, 2, 8, generator=g)


class Engine:
    """A KV manager over a real cache whose 'forward' writes kv_of(hash) into each computed block."""

    def __init__(self, num_blocks=5, memory_bytes=1 << 20, disk=None):
        self.io = cache(num_blocks)
        self.tier = KVTier(self.io, memory_bytes, disk)
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS), self.tier)

    def run(self, rid, tokens, salt=None):
        """Admit the whole prompt, compute what the hit did not cover, check every full block's KV, free."""
        hit = self.kv.get_computed_blocks(KVRequest(rid, list(tokens), salt))
        n = len(tokens) - hit.num_computed_tokens
        self.kv.allocate_slots(rid, n, hit=hit)
        hashes = hash_full_blocks(list(tokens), BS, salt)
        table = self.kv.block_table(rid)
        for i in range(hit.num_computed_tokens // BS, len(hashes)):
            for layer in self.io.tensors:
                layer[table[i]] = kv_of(hashes[i])
        for i, block_hash in enumerate(hashes):
            for layer in self.io.tensors:
                assert torch.equal(layer[table[i]], kv_of(block_hash)), f"block {i} of {rid} holds other KV"
        self.kv.check_invariants()
        self.kv.free(rid)
        return hit


PROMPT = list(range(100, 109))   # two full blocks and one token
OTHER = list(range(200, 217))    # four full blocks and one token: every block of a pool of 5


def test_evicted_blocks_come_back_from_memory_instead_of_being_computed():
    e = Engine()
    assert e.run("a", PROMPT).num_computed_tokens == 0
    e.run("b", OTHER)                       # the pool hands PROMPT's blocks out again: they go to the tier
    assert e.kv.num_cached_blocks == 4 and e.tier.num_blocks >= 2
    hit = e.run("a2", PROMPT)
    assert hit.num_computed_tokens == 8 and len(hit.loaded) == 2 and hit.block_ids == []
    assert e.kv.stats.tier_hit_tokens == 8 and e.kv.stats.hit_tokens == 8
    stats = kv_stats(e.kv)
    assert stats.tier_hits_memory == 2 and stats.tier_bytes_loaded == 2 * e.io.bytes_per_block
    # Copied back, the blocks are cached in the pool again: the next request maps them.
    assert e.run("a3", PROMPT).block_ids != []


@pytest.mark.parametrize("budget, admitted", [(3, 1), (4, 2)])
def test_a_tier_hit_continues_the_pools_run_and_counts_against_the_step_budget(budget, admitted):
    e = Engine(num_blocks=8)
    long = list(range(300, 317))            # 4 full blocks
    e.run("a", long)
    e.run("b", OTHER)                       # OTHER's 5 blocks evict the least recently freed: long's last one
    pool_hit = e.kv.get_computed_blocks(KVRequest("x", long))
    assert len(pool_hit.block_ids) == 3 and len(pool_hit.loaded) == 1
    step = apply_kv_step(e.kv, KVStep([], [], [], [KVAdmit(7, long + [1]), KVAdmit(8, [5, 6])], budget))
    first = step.admitted[0]
    assert first.num_cached_tokens == 16 and first.num_new_tokens == 2 and step.tier_hit_tokens == 4
    # 2 tokens computed and 4 copied back at an eighth of a token each (rounded up): 3 of the budget.
    assert len(step.admitted) == admitted


def test_two_tenants_with_the_same_prompt_never_share_a_block_through_the_tier():
    e = Engine()
    e.run("a", PROMPT, salt="tenant-a")
    e.run("b", OTHER)
    assert e.run("b1", PROMPT, salt="tenant-b").num_computed_tokens == 0
    assert e.run("b2", PROMPT).num_computed_tokens == 0            # nor an unsalted request
    e.run("c", OTHER)
    hit = e.run("a1", PROMPT, salt="tenant-a")                     # the owner still finds its own
    assert hit.num_computed_tokens == 8


def test_the_memory_tier_keeps_only_its_size_least_recently_used_first():
    io = cache(5)
    e = Engine(memory_bytes=3 * io.bytes_per_block)
    e.run("a", PROMPT)
    e.run("b", OTHER)
    e.run("c", list(range(400, 417)))       # evicts OTHER's four blocks: PROMPT's go from the tier
    assert e.tier.memory_used <= 3 * io.bytes_per_block
    assert e.run("a2", PROMPT).num_computed_tokens == 0


def test_the_disk_tier_survives_a_restart_and_another_identity_empties_it(tmp_path):
    e = Engine(memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, 1 << 20))
    e.run("a", PROMPT)
    e.run("b", OTHER)
    e.tier.close()
    again = Engine(memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, 1 << 20))   # a fresh pool
    hit = again.run("a", PROMPT)
    assert hit.num_computed_tokens == 8 and hit.loaded_from_disk == 2
    assert kv_stats(again.kv).tier_hits_disk == 2
    again.tier.close()
    other = DiskTier(str(tmp_path), IDENTITY | {"dtype": "bfloat16"}, 1 << 20)
    assert len(other) == 0 and "dtype='float32'" in other.reset_reason
    assert os.listdir(other.blocks_dir) == []
    other.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_block_file_is_deleted_and_the_block_computed(tmp_path, damage):
    e = Engine(memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, 1 << 20))
    e.run("a", PROMPT)
    e.run("b", OTHER)
    e.tier.disk.flush()
    first, second = hash_full_blocks(PROMPT, BS)
    path = os.path.join(e.tier.disk.blocks_dir, second.hex() + ".kvb")
    raw = open(path, "rb").read()
    if damage == "flip":
        raw = raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
    elif damage == "truncate":
        raw = raw[:len(raw) // 2]
    else:   # another block's (valid) file under this name
        raw = open(os.path.join(e.tier.disk.blocks_dir, first.hex() + ".kvb"), "rb").read()
    open(path, "wb").write(raw)
    hit = e.run("a2", PROMPT)               # run() checks the KV of every block, the computed one too
    assert hit.num_computed_tokens == 4 and not os.path.exists(path)
    assert kv_stats(e.kv).tier_discarded == 1
    e.tier.close()


def test_a_disk_whose_writes_fail_costs_only_the_recompute(tmp_path):
    e = Engine(memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, 1 << 20))
    os.rmdir(e.tier.disk.blocks_dir)
    open(e.tier.disk.blocks_dir, "w").close()   # every write now fails, as on a full disk
    e.run("a", PROMPT)
    e.run("b", OTHER)
    e.tier.disk.flush()
    assert kv_stats(e.kv).tier_write_failures >= 2
    assert e.tier.fetch(hash_full_blocks(PROMPT, BS)) == ([], 0) and len(e.tier.disk) == 0
    events = e.kv.take_events()               # the index hears the blocks came and went
    assert sum(len(ev.block_hashes) for ev in events if isinstance(ev, BlockStored) and ev.tier) == \
        sum(len(ev.block_hashes) for ev in events if isinstance(ev, BlockRemoved) and ev.tier) > 0
    assert e.run("a2", PROMPT).num_computed_tokens == 0
    assert e.kv.num_free_blocks == e.kv.num_total_blocks
    e.tier.close()


def test_the_disk_tier_keeps_to_its_size_oldest_first(tmp_path):
    io = cache(5)
    cap = 3 * (io.bytes_per_block + 64)
    e = Engine(memory_bytes=0, disk=DiskTier(str(tmp_path), IDENTITY, cap))
    for i in range(4):
        e.run(f"r{i}", list(range(500 + 20 * i, 517 + 20 * i)))
    e.tier.disk.flush()
    used = sum(os.path.getsize(os.path.join(e.tier.disk.blocks_dir, f)) for f in os.listdir(e.tier.disk.blocks_dir))
    assert 0 < used == e.tier.disk.bytes_used <= cap
    e.tier.close()


def test_a_directory_that_cannot_hold_the_tier_is_a_clear_error(tmp_path):
    (tmp_path / "blocks").write_text("not a directory")
    with pytest.raises(ValueError, match="cannot be used"):
        DiskTier(str(tmp_path), IDENTITY, 1 << 20)


def test_a_block_read_ahead_leaves_with_its_file_and_is_taken_once():
    """Blocks read ahead of their step (`warm`) are taken by the fetch instead of the disk, once; one whose
    file the disk store drops meanwhile is dropped with it, and none outlives `clear`."""
    import tempfile
    with tempfile.TemporaryDirectory() as path:
        e = Engine(num_blocks=5, memory_bytes=0, disk=DiskTier(path, IDENTITY, 1 << 20))
        e.run("a", PROMPT)
        e.run("b", OTHER)
        e.tier.disk.flush()
        first, second = hash_full_blocks(PROMPT, BS)[:2]
        e.tier.warm({first: e.tier.disk.peek(first), second: e.tier.disk.peek(second), b"absent" * 6: None})
        assert e.tier.warm_bytes == 2 * e.io.bytes_per_block and e.tier.in_memory(first)
        assert e.kv.disk_reads(KVRequest("x", PROMPT)) == []          # nothing left for a step to read
        e.tier.disk._forget(second)                                  # the store drops the second block's file
        e.tier._announce([], [second])
        assert e.tier.warm_bytes == e.io.bytes_per_block and not e.tier.in_memory(second)
        blocks, from_disk = e.tier.fetch([first])
        assert from_disk == 1 and e.tier.hits_warm == 1 and e.tier.warm_bytes == 0
        e.tier.warm({first: e.tier.disk.peek(first)})
        e.tier.clear()
        assert e.tier.warm_bytes == 0 and not e.tier.in_memory(first)
        e.tier.close()
