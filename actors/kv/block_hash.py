"""Chained content hashes of full KV blocks, the identity prefix caching and the cluster index share.

A block's hash covers its parent's hash, its token ids and, on the first block only, extra keys
such as the tenant's cache salt (the chain carries them on). Never Python's `hash()`: the values
must be equal across processes and machines, so they are sha256 digests of a msgpack encoding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes  # a 32-byte sha256 digest

_encoder = msgspec.msgpack.Encoder()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block. msgpack keeps the encoding unambiguous (lengths are explicit)."""
    payload = _encoder.encode((parent, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def extra_keys_for(cache_salt: str | None) -> tuple:
    """Extra keys of a sequence's first block: different salts never share a single block."""
    return () if cache_salt is None else (cache_salt,)


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    prior: Sequence[BlockHash] = (),
    limit: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, continuing the chain `prior` (already computed).

    Only the blocks after `len(prior)` are hashed, so growing a sequence costs one hash per new
    full block. `limit` caps the number of blocks (counting `prior`).
    """
    num_full = len(token_ids) // block_size
    if limit is not None:
        num_full = min(num_full, limit)
    hashes = list(prior)
    extra = extra_keys_for(cache_salt)
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        block_tokens = token_ids[i * block_size:(i + 1) * block_size]
        hashes.append(hash_block(parent, block_tokens, extra if i == 0 else ()))
    return hashes
