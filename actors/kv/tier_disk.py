"""The KV tier's disk store: evicted blocks as files in a directory, found again after a restart.

`tier.json` names what the blocks were computed with (model, dtype, KV layout, block size, hash
scheme); a directory written under another identity is emptied, never read. Each block is one file
named by its chained hash, with the hash, its length and a checksum in front of the bytes: a file
that is truncated, corrupted or under the wrong name is deleted and reads as a miss, so the block
is computed instead. Writes go through one thread (never the step's), to a temporary name and then
renamed; a write that fails only loses that block. Oldest files go past `max_bytes`; a disk found full
(ENOSPC, a quota) lowers `max_bytes` to what the store holds then, so from there on the oldest files
make room for new ones (deleted before the new one is written) instead of every write failing.

Which blocks it holds changes only on the caller's thread (a block counts from its `put`, and is read
from the queue until written); the writer reports the blocks it could not write (`take_lost`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import struct
import threading
from collections import OrderedDict

from prefix_store.hashing import BlockHash
from runtime import get_logger

log = get_logger(component="kv-tier-disk")

MAGIC = b"MKVB1\0"
_HEAD = struct.Struct("<6s32sQ16s")   # magic, block hash, data length, blake2b-128 of the data
SUFFIX = ".kvb"


def checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class DiskTier:
    def __init__(self, path: str, identity: dict, max_bytes: int, max_pending_bytes: int = 256 << 20):
        if max_bytes < 1:
            raise ValueError(f"the disk tier's size must be positive, got {max_bytes}")
        self.path = path
        self.blocks_dir = os.path.join(path, "blocks")
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()   # _pending, _lost and pending_bytes are shared with the writer
        self._files: OrderedDict[BlockHash, int] = OrderedDict()   # hash -> file size, oldest first
        self._pending: dict[BlockHash, bytes] = {}   # queued, not yet written
        self._lost: list[BlockHash] = []             # the writer could not write them
        self._full = False                           # a write found the disk full since the last take_lost
        self.bytes_used = 0
        self.pending_bytes = 0
        self.write_failures = self.dropped = self.discarded = 0
        self.full_at: int | None = None        # bytes held when the disk was last found full
        self.reset_reason: str | None = None   # why an existing directory was emptied at the start
        self._queue: queue.Queue = queue.Queue()   # (hash, bytes) to write, (hash, None) to delete, None: stop
        try:
            self._open(identity)
        except OSError as e:
            raise ValueError(f"the KV tier directory {path!r} cannot be used: {e}") from e
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ---- the step's side: cheap and never blocking on a write ---------------------------------

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def hashes(self) -> list[BlockHash]:
        return list(self._files)

    def put(self, block_hash: BlockHash, data: bytes) -> list[BlockHash]:
        """Queue the block for writing (dropped when the writer is that far behind); returns the
        oldest blocks that leave to make room."""
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return []
        size = _HEAD.size + len(data)
        with self._lock:
            if self.pending_bytes + len(data) > self.max_pending_bytes or size > self.max_bytes:
                self.dropped += 1
                return []
            self.pending_bytes += len(data)
            self._pending[block_hash] = data
        self._files[block_hash] = size
        self.bytes_used += size
        gone = self._shrink()   # their deletes are queued first: on a full disk they make the room
        self._queue.put((block_hash, data))
        return gone

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes, or None when absent or damaged (a damaged file is deleted)."""
        if block_hash not in self._files:
            return None
        self._files.move_to_end(block_hash)
        data, unreadable = self._load(block_hash)
        if unreadable:
            self._forget(block_hash)
        if unreadable == "damaged":
            self.discarded += 1
            self._unlink(block_hash)
        return data

    def peek(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes as `get` reads them, for a thread while the caller goes on: it changes nothing
        (no order, no deletion), and a file gone or damaged meanwhile reads as None."""
        return self._load(block_hash)[0]

    def _load(self, block_hash: BlockHash) -> tuple[bytes | None, str | None]:
        """(the block's bytes, from the writer's queue or its file; None and "gone" or "damaged" when unreadable)."""
        with self._lock:
            data = self._pending.get(block_hash)
        if data is not None:
            return data, None
        try:
            with open(self._file(block_hash), "rb") as f:
                raw = f.read()
        except OSError:
            return None, "gone"
        data = _unpack(raw, block_hash)
        return data, None if data is not None else "damaged"

    def take_lost(self) -> list[BlockHash]:
        """Blocks whose write failed since the last call: no longer held."""
        with self._lock:
            lost, self._lost = self._lost, []
            full, self._full = self._full, False
            pending = self.pending_bytes + len(self._pending) * _HEAD.size
        for block_hash in lost:
            self._forget(block_hash)
        if full:   # the disk holds no more than what is written now: keep to that
            self.full_at = self.max_bytes = max(self.bytes_used - pending, 0)
            log.warning("the KV tier's disk is full: oldest blocks now make room for new ones",
                        path=self.path, max_bytes=self.max_bytes)
            return lost + self._shrink()
        return lost

    def clear(self) -> None:
        self.flush()
        self.take_lost()
        for block_hash in list(self._files):
            self._unlink(block_hash)
        self._files.clear()
        self.bytes_used = 0

    def flush(self) -> None:
        """Wait until every queued block is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    # ---- start-up ------------------------------------------------------------------------------

    def _open(self, identity: dict) -> None:
        """Keep the files of a directory written with the same identity; empty any other."""
        os.makedirs(self.blocks_dir, exist_ok=True)
        header = os.path.join(self.path, "tier.json")
        try:
            with open(header) as f:
                found = json.load(f)
        except FileNotFoundError:
            found = None
        except (OSError, ValueError):
            found = "unreadable"
        if found != identity:
            if found is not None:
                self.reset_reason = "unreadable header" if found == "unreadable" else \
                    "written by " + ", ".join(f"{k}={found.get(k)!r}" for k in identity if found.get(k) != identity[k])
            for name in os.listdir(self.blocks_dir):
                os.unlink(os.path.join(self.blocks_dir, name))
            tmp = header + ".tmp"
            with open(tmp, "w") as f:
                json.dump(identity, f, indent=1, sort_keys=True)
            os.replace(tmp, header)
            return
        entries = []
        for name in os.listdir(self.blocks_dir):
            full = os.path.join(self.blocks_dir, name)
            try:
                block_hash = bytes.fromhex(name.removesuffix(SUFFIX)) if name.endswith(SUFFIX) else None
                st = os.stat(full)
            except (ValueError, OSError):
                block_hash = None
            if block_hash is None or len(block_hash) != 32:
                os.unlink(full)   # a temporary file a crash left, or a stranger
                continue
            entries.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(entries):
            self._files[block_hash] = size
            self.bytes_used += size
        self._shrink()

    # ---- the writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                block_hash, data = item
                if data is None:   # left to make room before or after it was written
                    self._unlink(block_hash)
                    continue
                written = self._write(block_hash, data)
                with self._lock:
                    self.pending_bytes -= len(data)
                    if self._pending.get(block_hash) is data:
                        del self._pending[block_hash]
                    if not written:
                        self._lost.append(block_hash)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, data: bytes) -> bool:
        final = self._file(block_hash)
        tmp = final + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, block_hash, len(data), checksum(data)))
                f.write(data)
            os.replace(tmp, final)
            return True
        except OSError as e:
            self.write_failures += 1
            self._unlink_path(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                with self._lock:
                    self._full = True
            return False

    def _shrink(self) -> list[BlockHash]:
        """Oldest files go until the store fits; the writer deletes them in turn (after any write of theirs)."""
        gone = []
        while self.bytes_used > self.max_bytes and self._files:
            block_hash, size = self._files.popitem(last=False)
            self.bytes_used -= size
            gone.append(block_hash)
            self._queue.put((block_hash, None))
        return gone

    def _forget(self, block_hash: BlockHash) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self.bytes_used -= size

    def _unlink(self, block_hash: BlockHash) -> None:
        self._unlink_path(self._file(block_hash))

    @staticmethod
    def _unlink_path(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _file(self, block_hash: BlockHash) -> str:
        return os.path.join(self.blocks_dir, block_hash.hex() + SUFFIX)


def _unpack(raw: bytes, block_hash: BlockHash) -> bytes | None:
    """The data of a block file, or None when it is not exactly this block's, whole and intact."""
    if len(raw) < _HEAD.size:
        return None
    magic, found_hash, length, digest = _HEAD.unpack_from(raw)
    data = raw[_HEAD.size:]
    if magic != MAGIC or found_hash != block_hash or length != len(data) or checksum(data) != digest:
        return None
    return data
