"""HMAC challenge-response proving that both ends of a connection know the cluster secret.

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
