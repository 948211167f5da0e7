"""Chained block hashes: stable across processes, chained, salted, incremental."""

import subprocess
import sys
from pathlib import Path

from prefix_store.hashing import hash_block, hash_full_blocks


def test_hash_is_a_sha256_digest_stable_across_processes():
    code = "from prefix_store.hashing import hash_full_blocks; print(hash_full_blocks(list(range(40)), 16, 'salt')[1].hex())"
    outs = set()
    for seed in ("0", "123"):  # a different PYTHONHASHSEED must not change anything
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                check=True, cwd=Path(__file__).parents[2]).stdout.strip())
    here = hash_full_blocks(list(range(40)), 16, "salt")[1]
    assert outs == {here.hex()}
    assert isinstance(here, bytes) and len(here) == 32


def test_hashes_never_change():
    # Engines and gateways of different builds share one index: a changed encoding would
    # silently turn every cluster lookup into a miss.
    assert [h.hex() for h in hash_full_blocks(list(range(40)), 16, "salt")] == [
        "8d30e8e631bdcf24283062fbefcfbdb793d62b949421eea4f792bb4b74b19ce6",
        "625a54eef8df49d8246d5ba3d635a2871de4f104c70a198041768fe49d52ec17",
    ]
    assert hash_full_blocks(list(range(20)), 16)[0].hex() == "6ef8b15403d1ac0c9107d736aa771ad669cb90a9d53846ab9e327cad5e521304"


def test_only_full_blocks_are_hashed():
    assert len(hash_full_blocks(list(range(31)), 16)) == 1
    assert len(hash_full_blocks(list(range(32)), 16)) == 2
    assert hash_full_blocks(list(range(15)), 16) == []


def test_chain_makes_a_block_depend_on_everything_before_it():
    a = hash_full_blocks([1] * 16 + [2] * 16, 16)
    b = hash_full_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same tokens in block 1, different parents
    assert a[1] == hash_block(a[0], [2] * 16)


def test_salt_changes_every_block_through_the_chain():
    tokens = list(range(48))
    plain, salted, other = (hash_full_blocks(tokens, 16, s) for s in (None, "tenant-a", "tenant-b"))
    assert all(len({p, s, o}) == 3 for p, s, o in zip(plain, salted, other))
    assert hash_full_blocks(tokens, 16, "tenant-a") == salted


def test_incremental_hashing_equals_hashing_from_scratch():
    tokens = list(range(100))
    prior = hash_full_blocks(tokens[:40], 16, "s")
    assert hash_full_blocks(tokens, 16, "s", prior=prior) == hash_full_blocks(tokens, 16, "s")
    assert hash_full_blocks(tokens, 16, "s", limit=3) == hash_full_blocks(tokens[:48], 16, "s")


def test_encoding_is_unambiguous():
    # A naive concatenation would confuse these; the explicit msgpack framing does not.
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])
    assert hash_block(None, [1], ("a",)) != hash_block(None, [1], ())
