"""`--dtype auto` on the CPU: bfloat16 where the CPU has bf16 units and a short probe finds it faster.

A decode step reads every weight, so bfloat16 halves its bytes; a prefill chunk is arithmetic, which
runs at the bf16 units' rate (AMX: several times float32's) or, without them, at float32's through
the packed kernel. Which wins depends on the machine: an AVX2-only CPU keeps float32, and so does one
whose bf16 path measures slower. The probe times the CPU backend's own matmuls in both dtypes on
weights larger than the last-level cache, once, and keeps the answer beside the built C kernels.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable, NamedTuple

import structlog
import torch

from kernels import cpu_gemm, cpu_native, packed_linear

BF16_UNITS = ("amx_bf16", "avx512_bf16")     # /proc/cpuinfo flags that make bfloat16 worth measuring
MARGIN = 1.1                                 # a ratio within 10% of 1 counts as a tie
N, K = 4096, 1024                            # one probe matrix, a typical projection's shape
DECODE_ROWS, PREFILL_ROWS = 1, 256


class DtypeChoice(NamedTuple):
    dtype: str
    reason: str


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def choose(flags: set[str], measure: Callable[[], dict[str, float]]) -> DtypeChoice:
    """The dtype for `flags`; `measure()` gives ms of float32 and bf16 matmuls at both row counts."""
    units = [f for f in BF16_UNITS if f in flags]
    if not units:
        return DtypeChoice("float32", "the CPU has no AMX or AVX-512 BF16 units")
    ms = measure()
    decode = ms[f"float32_{DECODE_ROWS}"] / ms[f"bfloat16_{DECODE_ROWS}"]
    prefill = ms[f"float32_{PREFILL_ROWS}"] / ms[f"bfloat16_{PREFILL_ROWS}"]
    speed = (f"bfloat16 ran at {decode:.2f}x float32's speed at {DECODE_ROWS} row, {prefill:.2f}x at "
             f"{PREFILL_ROWS} ({'+'.join(units)})")
    faster = (decode > MARGIN and prefill * MARGIN >= 1) or (prefill > MARGIN and decode * MARGIN >= 1)
    return DtypeChoice("bfloat16" if faster else "float32", speed)


@functools.cache
def cpu_dtype(kernels: str = "auto") -> DtypeChoice:
    """What `auto` means on this CPU for the `kernels` backend; measured once per machine."""
    if kernels not in ("auto", "cpu") or not cpu_native.available():
        choice = DtypeChoice("float32", "bfloat16 is fast only through the CPU C kernels, which are off")
    else:
        choice = choose(cpu_flags(), _cached_measure)
    structlog.get_logger().info("dtype auto", dtype=choice.dtype, reason=choice.reason)
    return choice


def _cached_measure() -> dict[str, float]:
    return cpu_native.kept_measurement(".dtype-probe.json", f"{torch.get_num_threads()} threads", measure)


def measure(repeats: int = 3) -> dict[str, float]:
    """Best-of ms for a pass over weights twice the last-level cache (float32 bytes; at most 1 GiB)
    at one row, and over four matrices at 256 rows, in float32 and in bf16 (packed)."""
    count = max(4, min(64, -(-2 * cpu_native.last_level_cache_bytes() // (N * K * 4))))
    f32 = [torch.empty(N, K).uniform_(-0.05, 0.05) for _ in range(count)]
    bf16 = [packed_linear.pack(w) for w in f32]
    runs = {"float32": (torch.float32, f32, cpu_gemm.linear), "bfloat16": (torch.bfloat16, bf16, packed_linear.matmul)}
    ms = {}
    for rows, weights in ((DECODE_ROWS, slice(None)), (PREFILL_ROWS, slice(0, 4))):
        best = dict.fromkeys(runs, float("inf"))
        for repeat in range(repeats + 1):
            for name, (dtype, ws, matmul) in runs.items():   # alternating: a neighbour slows both alike
                x = torch.randn(rows, K).to(dtype)
                start = time.perf_counter()
                for w in ws[weights]:
                    matmul(x, w)
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - start)
        ms |= {f"{name}_{rows}": round(t * 1e3, 3) for name, t in best.items()}
    return ms
