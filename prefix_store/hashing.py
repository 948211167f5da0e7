"""Chained block hashes, the identity of a KV block that the engines and the prefix index share.

A block's hash covers its parent's hash, its token ids and, on the first block only, extra keys
such as the tenant's cache salt (the chain carries them on). Never Python's `hash()`: the values
must be equal across processes and machines, so they are sha256 digests of a msgpack encoding.
The KV manager and the gateway's `PromptHasher` call the same `hash_full_blocks`, so they cannot
drift; the gateway passes the salt it hashed with to the engine as the request's `cache_salt`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import msgspec

BlockHash = bytes  # a 32-byte sha256 digest
# What a stored hash means; a disk KV tier written under another scheme is not read.
HASH_SCHEME = "sha256(msgpack(parent, tokens, extra)); cache_salt in the first block's extra keys; v1"

_encoder = msgspec.msgpack.Encoder()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """Hash one full block. msgpack keeps the encoding unambiguous (lengths are explicit)."""
    payload = _encoder.encode((parent, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def extra_keys_for(cache_salt: str | None) -> tuple:
    """Extra keys of a sequence's first block: different salts never share a single block."""
    return () if cache_salt is None else (cache_salt,)


def adapter_salt(cache_salt: str | None, lora_name: str | None, lora_key: str | None = None) -> str | None:
    """The prefix-cache salt of a request generating with LoRA adapter `lora_name`, known by `lora_key`, its
    identity (name@contents: LoRAAdapter.key), where the caller has it: one prompt under two adapters (or
    under one and the base model, or under two contents of one name) has different KV, so their blocks hash
    apart."""
    adapter = lora_key if lora_key is not None else lora_name
    if adapter is None:
        return cache_salt
    return f"lora:{len(adapter)}:{adapter}:{cache_salt or ''}"


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


class TenantSalts:
    """Server-side salt per API key: HMAC(secret, key), so a client can neither pick nor guess
    another tenant's salt, and tenants never share a cached block or a prefix hit."""

    def __init__(self, secret: bytes | str):
        if isinstance(secret, str):
            secret = secret.encode()
        if not secret:
            raise ValueError("the tenant salt secret must be non-empty")
        self._secret = secret

    def salt_for(self, api_key: str | None) -> str | None:
        """The `cache_salt` of a request made with `api_key`; None (no salt) without a key."""
        if api_key is None:
            return None
        return hmac.new(self._secret, api_key.encode(), hashlib.sha256).hexdigest()


class PromptHasher:
    """A prompt's block hashes as the engine's KV manager will compute them, salted per tenant."""

    def __init__(self, block_size: int, salts: TenantSalts | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.salts = salts

    def cache_salt(self, api_key: str | None) -> str | None:
        return self.salts.salt_for(api_key) if self.salts is not None else None

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """Chained hashes of the prompt's full blocks; a partial last block has none."""
        return hash_full_blocks(token_ids, self.block_size, cache_salt)
