"""The all-reduce (and all-gather) of processes on one host through a shared-memory segment
(shm_all_reduce.c): what tensor-parallel ranks on the CPU use instead of gloo where the C kernels build.

A segment is a file (under /dev/shm) that one process creates (`create`) and every rank maps
(`ShmGroup`); once all have, the creator may unlink it. Nothing here agrees on the file's name or
decides between this and gloo: actors/worker/cpu_collectives.py does, through the ranks' gloo group. A
call never hangs: it raises ShmFailure at the deadline or as soon as a rank it waits for has died.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from kernels import cpu_native

SLOT_BYTES = 4 << 20   # a rank's piece of one round; a larger tensor goes in pieces (two sets: 8 MiB a rank)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # summed in float32, rounded once
_TIMEOUT, _RANK_LOST, _OUT_OF_STEP = 1, 2, 3
_ptr, _long, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _Group(ctypes.Structure):   # struct matinee_shm_group
    _fields_ = [("base", _ptr), ("slot_bytes", _long), ("rounds", _long), ("timeout_s", ctypes.c_double),
                ("rank", _int), ("size", _int), ("fd", _int), ("lost", _int)]


def declare(lib: ctypes.CDLL) -> None:
    lib.matinee_shm_bytes.restype = _long
    lib.matinee_shm_bytes.argtypes = [_int, _long]
    lib.matinee_shm_hold.restype = _int
    lib.matinee_shm_hold.argtypes = [ctypes.POINTER(_Group)]
    lib.matinee_shm_all_reduce.restype = _int
    lib.matinee_shm_all_reduce.argtypes = [ctypes.POINTER(_Group), _ptr, _long, _int]
    lib.matinee_shm_all_gather.restype = _int
    lib.matinee_shm_all_gather.argtypes = [ctypes.POINTER(_Group), _ptr, _ptr, _long]


class ShmFailure(RuntimeError):
    """A rank died, or did not arrive before the deadline, or called with another tensor: the group is done."""


def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return _library().matinee_shm_bytes(size, slot_bytes)


def create(path: str, size: int, slot_bytes: int = SLOT_BYTES) -> None:
    """A new zeroed segment file for `size` ranks, its memory reserved now (posix_fallocate: a full /dev/shm
    is an OSError here, never a SIGBUS at the first write). Only this user may open it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(size, slot_bytes))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


class ShmGroup:
    """One rank's end of a segment: all_reduce() sums a tensor over the ranks, in place; all_gather() stacks
    theirs. Every rank makes the same calls, with tensors of the same shape and dtype, in the same order."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, slot_bytes: int = SLOT_BYTES) -> None:
        """Maps the segment at `path` and takes this rank's lock; OSError where it cannot."""
        if slot_bytes % 64 or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        lib = _library()
        self._lib = lib
        self._fd = os.open(path, os.O_RDWR)
        try:
            nbytes = lib.matinee_shm_bytes(size, slot_bytes)
            if os.fstat(self._fd).st_size != nbytes:
                raise OSError(f"{path} holds {os.fstat(self._fd).st_size} bytes, not a segment of {size} ranks")
            self._map = mmap.mmap(self._fd, nbytes)
        except BaseException:
            os.close(self._fd)
            raise
        self._view = (ctypes.c_char * nbytes).from_buffer(self._map)
        self._group = _Group(ctypes.addressof(self._view), slot_bytes, 0, timeout_s, rank, size, self._fd, -1)
        error = lib.matinee_shm_hold(ctypes.byref(self._group))
        if error:
            self.close()
            raise OSError(error, f"cannot lock rank {rank}'s byte of {path}: {os.strerror(error)}")

    @staticmethod
    def takes(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in DTYPES

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks (in rank order, in float32), in place."""
        if not self.takes(t):
            raise ValueError(f"the shared-memory all-reduce takes {list(DTYPES)} CPU tensors, not {t.dtype} on {t.device}")
        flat = t if t.is_contiguous() else t.contiguous()
        status = self._lib.matinee_shm_all_reduce(ctypes.byref(self._group), flat.data_ptr(), flat.numel(),
                                                  DTYPES[t.dtype])
        self._check(status, "all-reduce", t)
        if flat is not t:
            t.copy_(flat)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's t, in rank order (any dtype: bytes are copied)."""
        if t.device.type != "cpu":
            raise ValueError(f"the shared-memory all-gather takes CPU tensors, not one on {t.device}")
        t = t.contiguous()
        out = torch.empty((self._group.size, *t.shape), dtype=t.dtype)
        status = self._lib.matinee_shm_all_gather(ctypes.byref(self._group), t.data_ptr(), out.data_ptr(),
                                                  t.numel() * t.element_size())
        self._check(status, "all-gather", t)
        return out

    def _check(self, status: int, what: str, t: torch.Tensor) -> None:
        if status == 0:
            return
        lost = self._group.lost
        why = {_TIMEOUT: f"rank {lost} did not arrive within {self._group.timeout_s:g} s",
               _RANK_LOST: f"rank {lost} is gone (its lock on the segment was released)",
               _OUT_OF_STEP: f"rank {lost} called with another tensor than {tuple(t.shape)} {t.dtype}"}
        raise ShmFailure(f"shared-memory {what}, rank {self._group.rank}: "
                         + why.get(status, f"refused its arguments (status {status})"))

    def close(self) -> None:
        """Unmaps the segment and closes the file (which drops this rank's lock)."""
        if self._fd < 0:
            return
        del self._view
        self._map.close()
        os.close(self._fd)
        self._fd = -1


def _library():
    lib = cpu_native.library()
    if lib is None:
        raise OSError("the CPU C kernels are not available here (no C compiler, or no AVX2)")
    return lib
