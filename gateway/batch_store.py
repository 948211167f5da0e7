"""Where the Files and Batches API keeps its files, batch objects and finished lines: a directory,
for `matinee serve` (a cluster's gateways share gateway/redis_batch_store.py, same interface).

    DIR/lock                 held (flock) by the one gateway process that serves from DIR
    DIR/files/ID.json        a file object (OpenAI's fields, and its owner)
    DIR/files/ID.data        its bytes
    DIR/batches/ID.json      a batch object as last saved (counts are rebuilt from its results)
    DIR/batches/ID.results   its finished lines, one JSON record a line, appended and synced before
                             a line counts as done: after a restart they are skipped, never rerun

Objects are replaced atomically (write, then rename); a results log cut mid-record (the process
died while writing it) loses only that record, whose line then runs again. One process holds the
directory, so its leases are always granted and a cancel is always local. Blocking file work on
bytes and logs runs in a thread, never on the event loop.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode
LOCAL_LEASE = "local"


class StoreBusy(Exception):
    """Another process serves from this directory."""


class LeaseLost(Exception):
    """Another gateway runs this batch now: this one must stop it, recording nothing more."""


class BatchStore:
    lease_s = 10.0   # how often the runner looks after its batches; a directory's lease never lapses

    def __init__(self, root: str, temporary: bool = False) -> None:
        self.root, self.temporary = root, temporary
        self.files_dir = os.path.join(root, "files")
        self.batches_dir = os.path.join(root, "batches")
        for d in (self.files_dir, self.batches_dir):
            os.makedirs(d, exist_ok=True)
        self._lock_fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreBusy(f"the batch directory {root} is in use by another server process") from None

    async def close(self) -> None:
        os.close(self._lock_fd)   # releases the lock
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    # --- files --------------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.data")

    async def save_file(self, obj: dict) -> None:
        _replace(os.path.join(self.files_dir, f"{obj['id']}.json"), _encode(obj))

    async def load_file(self, file_id: str) -> dict | None:
        return _load(os.path.join(self.files_dir, f"{file_id}.json"))

    async def delete_file(self, file_id: str) -> None:
        for suffix in (".json", ".data"):
            _unlink(os.path.join(self.files_dir, file_id + suffix))

    async def file_ids(self) -> list[str]:
        return _ids(self.files_dir)

    async def write_data(self, file_id: str, data: bytes) -> None:
        await asyncio.to_thread(_replace, self.file_path(file_id), data)

    async def read_data(self, file_id: str) -> bytes:
        return await asyncio.to_thread(_read, self.file_path(file_id))

    # --- batches ------------------------------------------------------------------------------------

    async def save_batch(self, record: dict, lease: str | None = None) -> None:
        _replace(os.path.join(self.batches_dir, f"{record['batch']['id']}.json"), _encode(record))

    async def load_batch(self, batch_id: str) -> dict | None:
        return _load(os.path.join(self.batches_dir, f"{batch_id}.json"))

    async def delete_batch(self, batch_id: str) -> None:
        for suffix in (".json", ".results"):
            _unlink(os.path.join(self.batches_dir, batch_id + suffix))

    async def batch_ids(self) -> list[str]:
        return _ids(self.batches_dir)

    def results(self, batch_id: str) -> "ResultLog":
        return ResultLog(os.path.join(self.batches_dir, f"{batch_id}.results"))

    # --- who runs a batch -----------------------------------------------------------------------------

    async def claim(self, batch_id: str) -> str | None:
        return LOCAL_LEASE

    async def renew(self, batch_id: str, lease: str) -> bool:
        return True

    async def release(self, batch_id: str, lease: str) -> None:
        pass

    async def request_cancel(self, batch_id: str) -> None:
        pass   # every batch runs in this process: the runner cancels it itself

    async def cancel_requested(self, batch_id: str) -> int | None:
        return None


class ResultLog:
    """A batch's finished lines, in the order they finished: {"index", "ok", "line"} records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = asyncio.Lock()

    async def records(self) -> list[dict]:
        """Every whole record; a last one cut short by a crash is left out."""
        try:
            data = await asyncio.to_thread(_read, self.path)
        except FileNotFoundError:
            return []
        out = []
        for raw in data.split(b"\n"):
            if raw:
                try:
                    out.append(_decode(raw))
                except msgspec.DecodeError:
                    continue
        return out

    async def counts(self) -> tuple[int, int]:
        """(completed, failed) lines."""
        records = await self.records()
        ok = sum(1 for r in records if r["ok"])
        return ok, len(records) - ok

    async def append(self, record: dict, lease: str | None = None) -> bool:
        """On disk (synced) when this returns: only then may the line count as done."""
        data = _encode(record) + b"\n"
        async with self._lock:
            await asyncio.to_thread(_append_synced, self.path, data)
        return True


def new_id(prefix: str) -> str:
    return f"{prefix}{os.urandom(12).hex()}"


def now() -> int:
    return int(time.time())


def _ids(folder: str) -> list[str]:
    return [name[:-5] for name in os.listdir(folder) if name.endswith(".json")]


def _replace(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _append_synced(path: str, data: bytes) -> None:
    with open(path, "ab") as f:
        if f.tell() and not _ends_with_newline(path):
            f.write(b"\n")   # a record cut short by a crash stays alone on its line
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _load(path: str) -> dict | None:
    try:
        return _decode(_read(path))
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
