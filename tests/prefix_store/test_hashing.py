"""Gateway-side prompt hashing agrees with the engine's, and tenants stay apart."""

from __future__ import annotations

import pytest

from actors.kv.structs import KVRequest
from prefix_store import ApplyResult, PromptHasher, TenantSalts
from tests.prefix_store.kv_workload import BLOCK_SIZE, KVWorkload


def test_gateway_hashes_equal_the_kv_managers():
    work = KVWorkload(seed=3)
    hasher = PromptHasher(BLOCK_SIZE, TenantSalts("server-secret"))
    prompt = list(range(100, 131))  # 7 full blocks and 3 tokens
    for api_key in (None, "key-a"):
        salt = hasher.cache_salt(api_key)
        hit = work.kv.get_computed_blocks(KVRequest(f"q-{api_key}", prompt, salt))
        assert hasher.block_hashes(prompt, salt) == hit.block_hashes
        assert len(hit.block_hashes) == 7


def test_salts_are_per_key_stable_and_secret():
    salts = TenantSalts("server-secret")
    assert salts.salt_for("key-a") == TenantSalts(b"server-secret").salt_for("key-a")
    assert salts.salt_for("key-a") != salts.salt_for("key-b")
    assert salts.salt_for("key-a") != TenantSalts("another-secret").salt_for("key-a")
    assert "key-a" not in salts.salt_for("key-a")
    assert salts.salt_for(None) is None
    with pytest.raises(ValueError):
        TenantSalts("")


async def test_tenants_never_match_each_others_prompts(store):
    work = KVWorkload(seed=4)
    hasher = PromptHasher(BLOCK_SIZE, TenantSalts("server-secret"))
    next_seq, hashes = work.kv.snapshot()
    await store.publish_snapshot("e", hashes, next_seq)
    prompt = list(range(40))
    salt_a, salt_b = hasher.cache_salt("key-a"), hasher.cache_salt("key-b")
    work.submit(prompt, salt_a)
    assert await store.apply_events("e", work.kv.take_events()) is ApplyResult.APPLIED

    assert await store.match(hasher.block_hashes(prompt, salt_a)) == {"e": 10}
    assert await store.match(hasher.block_hashes(prompt, salt_b)) == {"e": 0}
    assert await store.match(hasher.block_hashes(prompt, None)) == {"e": 0}
    # The engine agrees: tenant B gets no cached block of tenant A's prompt.
    assert work.kv.get_computed_blocks(KVRequest("b", prompt, salt_b)).num_computed_tokens == 0


def test_block_size_is_validated():
    with pytest.raises(ValueError):
        PromptHasher(0)
