"""The CPU serving path's C kernels (cpu_gemm.c, paged_attention_cpu.c): built once, loaded once.

The sources are compiled together with the system's C compiler on first use, into a shared
library cached under ~/.cache/matinee (named by the sources' hash, so an edit rebuilds it).
Without a compiler, or on a CPU without AVX2 and FMA, `library()` is None and every caller
keeps its pure-torch path: the kernels only make the CPU faster, never change what it computes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemm.c", "paged_attention_cpu.c")]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "matinee" / "kernels"


def build(directory: Path | None = None) -> Path:
    """Compiles the kernels (unless already cached) and returns the shared library's path.

    Raises RuntimeError when there is no C compiler or it fails."""
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(_FLAGS).encode()).hexdigest()
    directory = directory or cache_dir()
    target = directory / f"matinee-cpu-{digest[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: a process building at the same time never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                                  capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C compiler {compiler}: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.matinee_sgemm_nt.restype = None
    lib.matinee_sgemm_nt.argtypes = [ptr] * 3 + [long_] * 3 + [int_]
    lib.matinee_paged_attention.restype = int_
    lib.matinee_paged_attention.argtypes = [ptr] * 7 + [long_] * 8 + [ctypes.c_float, int_]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (logged once)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            structlog.get_logger().info("CPU C kernels off: no AVX2", cpu_capability=capability)
            return None
        try:
            # torch has loaded its OpenMP runtime already; the library's libgomp.so.1 resolves to
            # it, so both share one thread pool. ctypes releases the GIL during each call.
            _library = _declare(ctypes.CDLL(str(build())))
        except (OSError, RuntimeError) as e:
            structlog.get_logger().warning("CPU C kernels unavailable; using torch's ops", error=str(e))
        return _library


def available() -> bool:
    return library() is not None


if __name__ == "__main__":   # `python -m kernels.cpu_native`: build ahead of time (the Docker image does)
    print(build())
