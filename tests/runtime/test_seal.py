"""Sealed records on their own: a round trip in any split, and every tampered record dropped
(flipped bit, replay, reorder, the other direction's key) without stopping the genuine ones."""
import pytest

from runtime import auth, seal

SECRET = b"seal-test-secret"


class Wire:
    """A transport that keeps what is written to it."""

    def __init__(self):
        self.records: list[bytes] = []

    def write(self, data) -> None:
        self.records.append(bytes(data))


def pair():
    to_server, to_client = auth.session_keys(SECRET, b"s" * 32, b"c" * 32)
    wire = Wire()
    return wire, seal.Sealer(to_server, wire), seal.Opener(to_server), to_client


def test_round_trip_in_any_split():
    wire, sealer, opener, _ = pair()
    sealer.write(b"hello ")
    sealer.write(bytearray(b"world"))
    stream = b"".join(wire.records)
    assert b"hello" not in stream and b"world" not in stream
    got = b"".join(opener.open(stream[i:i + 3]) for i in range(0, len(stream), 3))
    assert got == b"hello world" and opener.rejected == 0


def test_a_large_write_is_split_into_bounded_records():
    wire, sealer, opener, _ = pair()
    data = bytes(range(256)) * (seal.RECORD_PLAIN_MAX // 100)
    sealer.write(data)
    assert len(wire.records) == 3
    assert all(len(r) <= 4 + seal.RECORD_MAX for r in wire.records)
    assert opener.open(b"".join(wire.records)) == data


def test_a_flipped_bit_is_dropped_and_the_stream_goes_on():
    wire, sealer, opener, _ = pair()
    sealer.write(b"first")
    sealer.write(b"second")
    bad = bytearray(wire.records[0])
    bad[7] ^= 0x01
    assert opener.open(bytes(bad)) == b""
    assert opener.open(wire.records[0] + wire.records[1]) == b"firstsecond"
    assert opener.rejected == 1


def test_replayed_and_reordered_records_are_dropped():
    wire, sealer, opener, _ = pair()
    for word in (b"one", b"two", b"three"):
        sealer.write(word)
    one, two, three = wire.records
    assert opener.open(one) == b"one"
    assert opener.open(one) == b""      # replay
    assert opener.open(three) == b""    # ahead of its turn
    assert opener.open(two + three) == b"twothree"
    assert opener.open(two) == b""      # an older one again
    assert opener.rejected == 3


def test_each_direction_has_its_own_key_and_counter():
    wire, sealer, opener, to_client = pair()
    back_wire = Wire()
    back = seal.Sealer(to_client, back_wire)
    back.write(b"reply")
    assert opener.open(back_wire.records[0]) == b""   # reflected: the other direction's key
    assert seal.Opener(to_client).open(back_wire.records[0]) == b"reply"
    sealer.write(b"ask")
    assert opener.open(wire.records[0]) == b"ask"     # counter 0 here, whatever the other side sent
    other, _ = auth.session_keys(SECRET, b"s" * 32, b"d" * 32)
    assert other != auth.session_keys(SECRET, b"s" * 32, b"c" * 32)[0]   # fresh nonces, fresh keys


def test_a_record_longer_than_the_cap_is_a_framing_error():
    _, _, opener, _ = pair()
    with pytest.raises(seal.RecordTooLarge):
        opener.open((seal.RECORD_MAX + 1).to_bytes(4, "big") + b"x" * 64)
    assert opener.open(b"\0\0\0\x05short") == b"" and opener.rejected == 1   # too short for a tag
