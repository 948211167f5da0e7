"""Few-row float32 matmuls on the CPU (decode steps, speculative verification): the C kernel's launcher.

MKL's sgemm multiplies 2-24 rows by a weight matrix at well under the memory bandwidth: on the
reference 2-core AMD EPYC (AVX2), SmolLM2's 30 layers and LM head take 170 ms for 8 rows where
cpu_gemm.c takes about 100, and 1 row 70 ms against 55. The C source is compiled with the
system's C compiler on first use and cached by its hash; without a compiler, or on a CPU without
AVX2 and FMA, `available()` is False and callers keep torch's matmul (the reference).
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

SOURCE = Path(__file__).with_name("cpu_gemm.c")
MAX_ROWS = 24     # above this MKL's blocked sgemm is as fast or faster
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_fn = None
_tried = False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "matinee" / "kernels"


def build(directory: Path | None = None) -> Path:
    """Compiles the kernel (if not already cached) and returns the shared library's path.

    Raises RuntimeError when there is no C compiler or it fails."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_gemm-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: another process building at the same time never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *_FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C compiler {compiler}: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load():
    global _fn, _tried
    with _lock:
        if _tried:
            return _fn
        _tried = True
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            structlog.get_logger().info("few-row CPU matmul kernel off: no AVX2", cpu_capability=capability)
            return None
        try:
            # torch has loaded its OpenMP runtime already; the kernel's libgomp.so.1 resolves to it,
            # so both share one thread pool. ctypes releases the GIL for the call.
            fn = ctypes.CDLL(str(build())).matinee_sgemm_nt
        except (OSError, RuntimeError) as e:
            structlog.get_logger().warning("few-row CPU matmul kernel unavailable; using torch's matmul",
                                           error=str(e))
            return None
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
        _fn = fn
        return fn


def available() -> bool:
    return _load() is not None


def matmul_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[M, K] @ weight[N, K].T for float32 CPU tensors; `available()` must be True."""
    fn = _load()
    if fn is None:
        raise RuntimeError("the few-row CPU matmul kernel is not available")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
            or weight.device.type != "cpu":
        raise ValueError("matmul_nt takes float32 CPU tensors")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"matmul_nt shapes do not match: {tuple(x.shape)} @ {tuple(weight.shape)}.T")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if out.numel():
        fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1],
           torch.get_num_threads())
    return out
