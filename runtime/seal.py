"""Sealed records: after the handshake every byte a connection writes travels as AES-256-GCM
records, [4-byte length][ciphertext + 16-byte tag], under its direction's session key with that
direction's record counter as the nonce. A Sealer stands in for the transport; an Opener turns
received bytes back into the plaintext stream, dropping records that fail authentication."""
from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from runtime.codec import HEADER

TAG_BYTES = 16
RECORD_PLAIN_MAX = 1 << 20                  # larger writes are split into several records
RECORD_MAX = RECORD_PLAIN_MAX + TAG_BYTES   # a longer length on the wire is a framing error
_pack_nonce = struct.Struct(">4xQ").pack    # 96-bit GCM nonce: 32 zero bits, 64-bit counter
_pack_header = HEADER.pack
_unpack_header = HEADER.unpack_from


class RecordTooLarge(ValueError):
    pass


class Sealer:
    """`write(data)` seals `data` into records (one per RECORD_PLAIN_MAX bytes) and writes them."""

    __slots__ = ("transport", "_seal", "_count")

    def __init__(self, key: bytes, transport):
        self.transport = transport
        self._seal = AESGCM(key).encrypt
        self._count = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) > RECORD_PLAIN_MAX:
            view = memoryview(data)
            for start in range(0, len(view), RECORD_PLAIN_MAX):
                self.write(view[start:start + RECORD_PLAIN_MAX])
            return
        head = _pack_header(len(data) + TAG_BYTES)   # authenticated with the record
        self.transport.write(head + self._seal(_pack_nonce(self._count), data, head))
        self._count += 1


class Opener:
    """`open(data)` returns the plaintext of the whole records received so far, in order.

    A record that fails authentication (forged, altered, replayed, reordered) is dropped and
    counted in `rejected`; the counter does not advance, so the next genuine record still opens.
    A length over RECORD_MAX raises RecordTooLarge: the stream's framing cannot be trusted."""

    __slots__ = ("_open", "_count", "_rx", "rejected")

    def __init__(self, key: bytes):
        self._open = AESGCM(key).decrypt
        self._count = 0
        self._rx = bytearray()
        self.rejected = 0

    def open(self, data: bytes) -> bytes:
        rx = self._rx
        if rx:
            rx += data
            data = rx
        out = []
        n = len(data)
        pos = 0
        view = memoryview(data)
        while n - pos >= 4:
            size = _unpack_header(data, pos)[0]
            if size > RECORD_MAX:
                view.release()
                raise RecordTooLarge(f"record of {size} bytes exceeds the cap of {RECORD_MAX}")
            end = pos + 4 + size
            if end > n:
                break
            try:
                out.append(self._open(_pack_nonce(self._count), view[pos + 4:end], data[pos:pos + 4]))
                self._count += 1
            except InvalidTag:
                self.rejected += 1
            pos = end
        view.release()
        if data is rx:
            del rx[:pos]
        elif pos < n:
            rx += data[pos:]
        return out[0] if len(out) == 1 else b"".join(out)
