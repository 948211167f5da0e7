"""`--quantization int8` (W8A8) on AMX's int8 tiles: int8_amx.c's launcher, and from which row count to use it.

Without it int8_gemm.c (VNNI) serves a few rows and torch._int_mm (oneDNN, which reorders the weight each call)
the rest; int8_amx.c multiplies 16 x 16 x 64 bytes a tdpbssd from the weight as it lies, transposing it into
the tiles' layout per call (a decode step's batch one 16-row group at a time, many rows a pair ahead). On the
Xeon it wins from 4 rows (16384 x 2048 from memory: 1.64 ms at 4 rows against int8_gemm.c's 1.82; at one
row int8_gemm.c's 1.40 against 1.52). All three give the same bits (exact int32 sums, then int8_linear's float32
order), so the row count choosing one never changes a row. From which count AMX wins is measured once per
shape and thread count on this machine, kept beside the built library (quant_amx.py does the same for GGUF
weights), and stored on the weight as `amx_from` by quant_linear_cpu.prepare_int8.
"""

from __future__ import annotations

from dataclasses import replace

import structlog
import torch

from kernels import cpu_native, quant_amx
from kernels.quantize import Int8Weight

ROWS = (4, 8, 16, 24, 32, 64, 128, 256, 512)   # the row counts measured: to 16 against int8_gemm.c, the rest _int_mm
OTHER = "other"                          # the timings' name for what serves the rows without AMX
SAMPLE_ROWS, REPEATS = 4096, 4
UNAVAILABLE = -4                         # int8_amx.c's answer on a CPU (or build) without AMX-INT8


def launch(lib, xq: torch.Tensor, x_scale: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None,
           out: torch.Tensor) -> int:
    """int8_amx.c on quantized rows (int8 [M, K] and their float32 scales) into `out` ([M, N], bf16 or
    float32); bias float32 or None. Returns the kernel's status (0, or UNAVAILABLE without AMX-INT8)."""
    return lib.matinee_int8_amx(xq.data_ptr(), x_scale.data_ptr(), weight.qweight.data_ptr(), weight.scale.data_ptr(),
                                None if bias is None else bias.data_ptr(), out.data_ptr(),
                                int(out.dtype == torch.bfloat16), xq.shape[0], weight.out_features,
                                weight.in_features, torch.get_num_threads())


_available: dict[str, bool] = {}


def available(lib=None) -> bool:
    """Whether `lib` (by default the loaded kernels) multiplies on AMX-INT8 here: the CPU has it, the build
    used it, Linux grants the tiles."""
    lib = lib or cpu_native.library()
    if lib is None:
        return False
    key = str(getattr(lib, "path", id(lib)))
    if key not in _available:
        weight = Int8Weight(torch.ones(16, 64, dtype=torch.int8), torch.ones(16))
        xq, scale = torch.ones(1, 64, dtype=torch.int8), torch.ones(1)
        out = torch.empty(1, 16)
        _available[key] = launch(lib, xq, scale, weight, None, out) == 0 and bool((out == 64).all())
    return _available[key]


_decisions: dict[tuple[int, int, int], int | None] = {}


def from_rows(n: int, k: int, linear) -> int | None:
    """The smallest measured row count from which AMX serves by quant_amx.threshold's rule against
    int8_gemm.c / torch._int_mm, or None. Measured once per shape and thread count, kept on disk;
    `linear` is quant_linear_cpu.int8_linear, the dispatch measured (passed in: that module imports this one)."""
    key = (torch.get_num_threads(), n, k)
    if key not in _decisions:
        rows = ",".join(map(str, ROWS))   # part of the name: timings kept before a count was added are redone
        ms = cpu_native.kept_measurement(".int8-amx.json", f"{key[0]} threads int8 {n}x{k} rows {rows}",
                                         lambda: _measure(n, k, linear))
        _decisions[key] = quant_amx.threshold(ms, OTHER, ROWS)
        structlog.get_logger().info("int8 linear", shape=f"{n}x{k}", amx_from_rows=_decisions[key], ms=ms)
    return _decisions[key]


def _measure(n: int, k: int, linear) -> dict[str, float]:
    """Best-of milliseconds of int8_linear with and without AMX at each of ROWS (bf16 rows: the paths differ
    only in the output's rounding), on at most SAMPLE_ROWS rows of a random weight."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (min(n, SAMPLE_ROWS), k), generator=gen, dtype=torch.int8)
    other = Int8Weight(q, torch.rand(q.shape[0], generator=gen) / 127, q.sum(dim=1, dtype=torch.int32).contiguous())
    amx = replace(other, amx_from=1)

    def runs_at(rows):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        return {OTHER: lambda: linear(x, other), "amx": lambda: linear(x, amx)}
    return cpu_native.best_ms_at_rows(ROWS, runs_at, REPEATS)
