"""What the cluster secret proves and keys: the HMAC challenge-response that opens a connection,
the per-direction session keys its records are sealed with (seal.py), and registry entry MACs.

The secret never travels; each side signs the other's random nonce bound to its node name."""
from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def client_proof(secret: bytes, server_nonce: bytes, client_node: str) -> bytes:
    return hmac.new(secret, b"matinee-auth\0" + server_nonce + client_node.encode(), hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_node: str) -> bytes:
    return hmac.new(secret, b"matinee-welcome\0" + client_nonce + server_node.encode(), hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def session_keys(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) for one connection, HKDF-SHA256 style: both
    nonces are fresh, so no two connections (nor the two directions of one) share a key."""
    prk = _mac(secret, b"matinee-session\0" + server_nonce + client_nonce)
    return _mac(prk, b"client->server\x01"), _mac(prk, b"server->client\x01")


def registry_key(secret: bytes) -> bytes:
    """The key registry entries are signed with; a label of its own, apart from session keys."""
    return _mac(secret, b"matinee-registry\0")


def entry_mac(key: bytes, name: str, node: str, path: str) -> bytes:
    """Binds an entry to its registry key name, so a valid entry cannot be moved to another name."""
    fields = [f.encode() for f in (name, node, path)]
    return _mac(key, b"".join(len(f).to_bytes(4, "big") + f for f in fields))


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()
