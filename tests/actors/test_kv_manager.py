"""KV cache manager behaviour: allocation, prefix hits, salts, LRU eviction, events, trim, fork."""

import pytest

from actors.kv import KVCacheConfig, KVCacheManager, KVRequest, StalePrefixHit
from prefix_store import AllBlocksCleared, BlockRemoved, BlockStored, hash_full_blocks

BS = 4


def make(num_blocks=16, **kw) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=BS, **kw))


def admit(m, rid, tokens, salt=None, chunk=None):
    """Look up, then allocate the whole prompt (or a chunk of it); returns the hit."""
    hit = m.get_computed_blocks(KVRequest(rid, list(tokens), salt))
    n = len(tokens) - hit.num_computed_tokens if chunk is None else chunk
    assert m.can_allocate(rid, n, hit=hit)
    m.allocate_slots(rid, n, hit=hit)
    return hit


def decode(m, rid, token):
    """One decode step: the token sampled last step is fed now (its KV is written)."""
    m.append_token_ids(rid, [token])
    assert m.can_allocate(rid, 1)
    m.allocate_slots(rid, 1)


def test_blocks_are_allocated_as_they_fill():
    m = make()
    admit(m, "a", range(5))
    assert len(m.block_table("a")) == 2 and m.num_computed_tokens("a") == 5
    for t in (100, 101, 102):  # positions 5, 6, 7: still block 1
        decode(m, "a", t)
    assert len(m.block_table("a")) == 2
    decode(m, "a", 103)  # position 8 opens block 2
    assert len(m.block_table("a")) == 3
    assert m.num_free_blocks == 13 and m.usage == pytest.approx(3 / 16)
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks == m.num_total_blocks == 16


def test_chunked_prefill_allocates_chunk_by_chunk():
    m = make()
    admit(m, "a", range(10), chunk=3)
    assert len(m.block_table("a")) == 1 and m.num_computed_tokens("a") == 3
    m.allocate_slots("a", 7)
    assert len(m.block_table("a")) == 3 and m.num_computed_tokens("a") == 10
    with pytest.raises(ValueError, match="known tokens"):
        m.can_allocate("a", 1)  # the next position's token is not known yet


def test_prefix_hit_maps_the_same_blocks_and_skips_their_prefill():
    m = make()
    prompt = list(range(10))
    admit(m, "a", prompt)
    hit = admit(m, "b", prompt + [50, 51])
    assert hit.num_computed_tokens == 8  # two full blocks; the partial third is not cached
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] != m.block_table("a")[2]
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.stats.requests == 2 and m.stats.queried_tokens == 22 and m.stats.hit_tokens == 8


def test_hits_never_cover_the_whole_prompt():
    m = make()
    admit(m, "a", range(8))
    m.free("a")
    hit = m.get_computed_blocks(KVRequest("b", list(range(8))))
    assert hit.num_computed_tokens == 4  # the last token must be computed so it has logits
    assert m.get_computed_blocks(KVRequest("c", list(range(9)))).num_computed_tokens == 8
    assert m.get_computed_blocks(KVRequest("d", [])).num_computed_tokens == 0


def test_freed_blocks_stay_cached_until_evicted():
    m = make()
    admit(m, "a", range(12))
    table = m.block_table("a")
    m.free("a")
    assert m.num_free_blocks == 16 and m.num_cached_blocks == 3
    hit = admit(m, "b", range(13))
    assert m.block_table("b")[:3] == table and hit.num_computed_tokens == 12


def test_cache_salt_separates_tenants():
    m = make()
    prompt = list(range(9))
    admit(m, "a", prompt, salt="tenant-1")
    assert m.get_computed_blocks(KVRequest("b", prompt, "tenant-2")).num_computed_tokens == 0
    assert m.get_computed_blocks(KVRequest("c", prompt, None)).num_computed_tokens == 0
    assert m.get_computed_blocks(KVRequest("d", prompt, "tenant-1")).num_computed_tokens == 8
    admit(m, "e", prompt)
    assert m.get_computed_blocks(KVRequest("f", prompt)).num_computed_tokens == 8


def test_generated_tokens_fill_blocks_that_get_cached():
    m = make()
    admit(m, "a", range(6))
    outputs = [90, 91, 92, 93, 94]
    for t in outputs:
        decode(m, "a", t)  # positions 6..10 computed; 11 tokens, blocks 0 and 1 full
    m.append_token_ids("a", [95])  # sampled, not yet fed
    m.free("a")
    full = list(range(6)) + outputs + [95]
    assert m.get_computed_blocks(KVRequest("b", full + [7])).num_computed_tokens == 8
    assert m.num_cached_blocks == 2  # position 11 never got KV, so block 2 was not cached


def test_duplicate_blocks_computed_concurrently_keep_one_cached_copy():
    m = make()
    prompt = list(range(9))
    hit_a = m.get_computed_blocks(KVRequest("a", prompt))
    hit_b = m.get_computed_blocks(KVRequest("b", prompt))  # looked up before a is allocated
    m.allocate_slots("a", 9, hit=hit_a)
    m.allocate_slots("b", 9, hit=hit_b)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2  # b's copies are private, not announced
    m.free("b")
    m.free("a")
    m.check_invariants()
    assert m.num_cached_blocks == 2


def test_lru_eviction_order_and_removed_events():
    m = make(num_blocks=6)
    admit(m, "a", range(8))  # blocks A0 A1
    admit(m, "b", range(100, 108))  # blocks B0 B1
    ha = hash_full_blocks(list(range(8)), BS)
    hb = hash_full_blocks(list(range(100, 108)), BS)
    m.free("a")
    m.free("b")
    m.take_events()
    # Two uncached free blocks go first, then a's last block, a's first, b's last, b's first.
    admit(m, "c", range(200, 211))  # 3 blocks: 2 plain + A1
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [ha[1]]
    assert m.get_computed_blocks(KVRequest("x", list(range(9)))).num_computed_tokens == 4  # A0 survives
    admit(m, "d", range(300, 311))  # 3 more: A0, B1, B0
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [ha[0], hb[1], hb[0]]
    assert m.num_free_blocks == 0 and not m.can_allocate("c", 0, num_lookahead_tokens=2)


def test_a_hit_refreshes_recency():
    m = make(num_blocks=4)
    admit(m, "a", range(4 * BS))
    ha = hash_full_blocks(list(range(4 * BS)), BS)
    m.free("a")  # free queue: A3 A2 A1 A0
    admit(m, "b", list(range(5)))  # hits A0, takes A3 fresh
    m.free("b")  # b's partial block (uncached) goes to the head, A0 to the tail
    m.take_events()
    admit(m, "c", range(1000, 1000 + 3 * BS))
    removed = [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [ha[2], ha[1]]  # A3 was b's private block; A0 was used last


def test_can_allocate_counts_cached_free_blocks_a_hit_takes():
    m = make(num_blocks=3)
    admit(m, "a", range(9))
    m.free("a")  # all 3 blocks free, 2 cached
    hit = m.get_computed_blocks(KVRequest("b", list(range(9)) + [1, 2, 3, 4]))
    assert hit.num_computed_tokens == 8
    assert m.can_allocate("b", 4, hit=hit)  # 2 hit blocks + 1 fresh = 3
    assert not m.can_allocate("b", 5, hit=hit)  # would need a 4th
    with pytest.raises(RuntimeError, match="can_allocate"):
        m.allocate_slots("b", 5, hit=hit)
    assert not m.has_seq("b") and m.num_free_blocks == 3  # nothing changed
    m.check_invariants()


def test_stale_hit_is_refused():
    m = make(num_blocks=2)
    admit(m, "a", range(5))
    m.free("a")
    hit = m.get_computed_blocks(KVRequest("b", list(range(5))))
    assert hit.num_computed_tokens == 4
    admit(m, "c", range(50, 58))  # evicts the cached block
    with pytest.raises(StalePrefixHit):
        m.can_allocate("b", 1, hit=hit)


def test_misuse_is_an_error():
    m = make()
    admit(m, "a", range(5))
    with pytest.raises(ValueError):
        m.get_computed_blocks(KVRequest("a", [1]))
    with pytest.raises(ValueError):
        m.can_allocate("new", 1)  # a first allocation needs its PrefixHit
    with pytest.raises(ValueError):
        m.can_allocate("a", -1)
    m.free("a")
    with pytest.raises(KeyError):
        m.free("a")  # double free
    with pytest.raises(KeyError):
        m.block_table("a")
    with pytest.raises(ValueError):
        KVCacheConfig(num_blocks=0)
    with pytest.raises(ValueError):
        KVCacheConfig(num_blocks=4, block_size=0)


def test_speculative_lookahead_then_trim():
    m = make()
    admit(m, "a", range(6))
    m.append_token_ids("a", [60])  # sampled: 7 tokens, 6 computed
    m.allocate_slots("a", 1, num_lookahead_tokens=5)  # feed token 6 + 5 drafts: positions 6..11
    assert len(m.block_table("a")) == 3 and m.num_computed_tokens("a") == 7
    assert m.num_cached_blocks == 1  # drafts are never cached
    m.append_token_ids("a", [61, 62])  # one draft accepted, plus a bonus token
    m.trim("a", 8)  # positions 0..7 valid
    assert len(m.block_table("a")) == 2 and m.num_computed_tokens("a") == 8
    assert m.num_cached_blocks == 2  # block 1 (positions 4..7) is now full and computed
    m.check_invariants()


def test_trim_refuses_to_cut_inside_a_cached_block_but_allows_boundaries():
    m = make()
    admit(m, "a", range(10))
    with pytest.raises(ValueError, match="shared or cached"):
        m.trim("a", 6)
    with pytest.raises(ValueError):
        m.trim("a", 13)  # past the slots held
    table = m.block_table("a")
    m.trim("a", 4)
    assert m.block_table("a") == table[:1] and m.num_computed_tokens("a") == 4
    m.allocate_slots("a", 6)  # recompute the same tokens: blocks get re-offered, no duplicates
    m.check_invariants()
    m.free("a")
    assert m.num_free_blocks == 16


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    m = make()
    admit(m, "p", range(10))
    copies = m.fork("p", "p#1")
    src, dst = m.block_table("p"), m.block_table("p#1")
    assert dst[:2] == src[:2] and copies == [(src[2], dst[2])] and dst[2] != src[2]
    assert m.num_computed_tokens("p#1") == 10
    decode(m, "p", 1)
    decode(m, "p#1", 2)
    assert m.block_table("p")[2] != m.block_table("p#1")[2]
    m.free("p")
    m.check_invariants()
    assert m.block_table("p#1")[:2] == src[:2]  # still held by the fork
    m.free("p#1")
    m.check_invariants()
    assert m.num_free_blocks == 16


def test_fork_on_a_block_boundary_copies_nothing():
    m = make(num_blocks=3)
    admit(m, "p", range(8))
    assert m.fork("p", "q") == [] and m.block_table("q") == m.block_table("p")
    decode(m, "p", 5)  # opens a private block for p
    assert m.num_free_blocks == 0
    m.append_token_ids("q", [6])
    assert not m.can_allocate("q", 1)  # q needs its own block for position 8
    with pytest.raises(ValueError):
        m.fork("p", "q")
    m.free("q")
    m.free("p")
    m.check_invariants()


def test_fork_without_a_free_block_is_refused():
    m = make(num_blocks=2)
    admit(m, "p", range(6))
    assert m.num_free_blocks == 0
    assert not m.can_fork("p")
    with pytest.raises(RuntimeError):
        m.fork("p", "q")
    assert not m.has_seq("q")


def test_events_are_numbered_and_cover_store_remove_clear():
    m = make(num_blocks=3)
    admit(m, "a", range(9))
    m.free("a")
    admit(m, "b", range(100, 112))  # evicts both cached blocks
    m.reset_prefix_cache()
    events = m.take_events()
    assert [e.seq for e in events] == list(range(len(events)))
    kinds = [type(e) for e in events]
    assert kinds[0] is BlockStored and BlockRemoved in kinds and kinds[-1] is AllBlocksCleared
    first = events[0]
    assert first.parent_block_hash is None and first.token_ids == list(range(8)) and first.block_size == BS
    assert first.block_hashes == hash_full_blocks(list(range(8)), BS)
    stored_b = [e for e in events if isinstance(e, BlockStored)][1]
    assert stored_b.block_hashes == hash_full_blocks(list(range(100, 112)), BS)
    assert m.take_events() == []


def test_event_log_is_bounded_and_a_gap_is_visible():
    m = KVCacheManager(KVCacheConfig(num_blocks=64, block_size=BS, max_events=3))
    for i in range(5):
        admit(m, f"r{i}", range(i * 100, i * 100 + 4))
    events = m.take_events()
    assert [e.seq for e in events] == [2, 3, 4]
    next_seq, hashes = m.snapshot()
    assert next_seq == 5 and len(hashes) == 5


def test_reset_prefix_cache_drops_hits_but_running_requests_go_on():
    m = make()
    admit(m, "a", range(9))
    m.reset_prefix_cache()
    assert m.num_cached_blocks == 0
    assert m.get_computed_blocks(KVRequest("b", list(range(9)))).num_computed_tokens == 0
    for t in range(5):
        decode(m, "a", t)
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks == 16


def removed_hashes(m) -> list:
    return [h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]


def test_forgetting_a_failed_step_drops_only_the_blocks_it_never_wrote():
    m = make()
    other = list(range(100, 112))
    admit(m, "other", other)
    m.free("other")
    prompt = list(range(13))
    admit(m, "a", prompt, chunk=5)  # a step that wrote positions 0-4: block 0 is full
    m.allocate_slots("a", 8)        # the step that fails: blocks 1 and 2 hashed, never written
    m.take_events()
    m.forget_unwritten("a", 5)
    assert removed_hashes(m) == hash_full_blocks(prompt, BS)[1:3]  # the cluster index forgets them too
    assert m.num_computed_tokens("a") == 5
    m.free("a")
    m.check_invariants()
    assert m.get_computed_blocks(KVRequest("b", prompt)).num_computed_tokens == 4
    assert m.get_computed_blocks(KVRequest("c", other + [7])).num_computed_tokens == 12


def test_forgetting_keeps_the_prefix_hit_a_failed_sequence_started_from():
    m = make()
    prompt = list(range(13))
    admit(m, "a", prompt)
    m.free("a")
    hit = admit(m, "b", prompt[:8] + [50, 51, 52, 53, 54])  # hits blocks 0-1, hashes its own block 2
    assert hit.num_computed_tokens == 8
    m.take_events()
    m.forget_unwritten("b", hit.num_computed_tokens)
    assert removed_hashes(m) == hash_full_blocks(prompt[:8] + [50, 51, 52, 53], BS)[2:]
    m.free("b")
    m.check_invariants()
    assert m.get_computed_blocks(KVRequest("c", prompt)).num_computed_tokens == 12
    admit(m, "d", range(5))
    with pytest.raises(ValueError, match="computed positions"):
        m.forget_unwritten("d", 6)


def test_prefix_caching_off_means_no_hits_and_no_events():
    m = make(enable_prefix_caching=False)
    admit(m, "a", range(9))
    m.free("a")
    assert admit(m, "b", range(9)).num_computed_tokens == 0
    assert m.take_events() == [] and m.num_cached_blocks == 0


def test_fork_at_a_block_boundary_below_the_computed_length_needs_no_free_block():
    m = make(num_blocks=3)
    admit(m, "p", range(10))  # 3 blocks, none free
    assert m.can_fork("p", num_tokens=8) and not m.can_fork("p")
    assert m.fork("p", "q", num_tokens=8) == []
    assert m.block_table("q") == m.block_table("p")[:2] and m.num_computed_tokens("q") == 8
    with pytest.raises(ValueError):
        m.fork("p", "r", num_tokens=11)  # more than p has computed
    m.free("p")
    m.allocate_slots("q", 2)  # q recomputes positions 8 and 9 itself (it knows their tokens)
    assert m.num_computed_tokens("q") == 10
    m.free("q")
    m.check_invariants()
    assert m.num_free_blocks == 3


def test_a_steps_fork_shares_whole_blocks_only_even_in_a_full_pool():
    """A sample forks at the prompt's last block boundary: no fresh block is taken (not even for
    a moment), so a pool with nothing free still forks, and a fork off a boundary is refused first."""
    from actors.kv.kv_actor import apply_kv_step
    from actors.messages.kv import KVFork, KVStep

    m = make(num_blocks=3)
    admit(m, "0", range(10))  # 3 blocks, none free
    res = apply_kv_step(m, KVStep([], [KVFork(0, 1, 8)], [], [], 0))
    assert res.forked == [True] and m.num_free_blocks == 0
    assert m.block_table("1") == m.block_table("0")[:2] and m.num_computed_tokens("1") == 8
    with pytest.raises(ValueError):
        apply_kv_step(m, KVStep([], [KVFork(0, 2, 9)], [], [], 0))
    assert not m.has_seq("2")
    m.check_invariants()
