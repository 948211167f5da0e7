"""A prompt's block hashes as the engine's KV manager will compute them, salted per tenant.

The gateway routes on these hashes and passes the same salt to the engine as the request's
`cache_salt`; the hashing itself is the KV manager's, never a copy, so the two cannot drift.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from actors.kv.block_hash import BlockHash, hash_full_blocks


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
