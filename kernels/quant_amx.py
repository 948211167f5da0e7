"""Many rows of bf16 x times a GGUF-quantized weight on AMX: quant_amx.c's launcher, and when to use it.

quant_gemm.c multiplies int8 blocks through VNNI: right for a few rows, where a step reads each weight
byte once. From a few dozen rows on the arithmetic dominates, and AMX's bf16 tiles do it 2-4x faster,
widening the weight into bf16 a 16-row group at a time (quant_amx.c); the model keeps only the packed
bytes. From which row count AMX wins is measured once per weight type and shape on this machine (kept
beside the built library) and stored on the weight as `amx_from`; `linear` (and decode_layers.c) then
pick by the rows of each call. AMX rounds the weight to bf16 where the int8 kernel rounds x to int8: two
approximations of the same float32 product, each tested against it.
"""

from __future__ import annotations

import structlog
import torch

from kernels import cpu_native, kquant, quant_linear
from kernels.quant_linear import QuantStack, QuantTensor, QuantWeight

# The types quant_amx.c widens (IQ4's nibbles through a permute of their 16 levels).
TYPES = (quant_linear.Q8_0, quant_linear.Q4_0, quant_linear.Q4_1, quant_linear.Q5_0, quant_linear.Q5_1,
         quant_linear.IQ4_NL, kquant.Q4_K, kquant.Q5_K, kquant.Q6_K, kquant.IQ4_XS)
ROWS = (8, 16, 24, 32, 64, 128, 256, 512)   # the row counts measured (24: the int8 kernel's time grows with the rows
# and AMX's does not below 32; on a Xeon, SmolLM2's gate_up at 24 rows took 0.115 ms on int8 against 0.092 on AMX)
MARGIN = 1.1                         # AMX must win by 10%: noise never flips the choice
SAMPLE_ROWS, REPEATS = 4096, 4
UNAVAILABLE = -4                     # quant_amx.c's answer on a CPU (or kernel) without AMX
BF16P = 30                           # quant_layout.h: a bf16 weight in packed_linear.py's layout


def matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """x[M, K] bf16 @ dequantize(weight).bfloat16().T (+ bias), summed in float32 -> [M, N] bf16.
    Raises RuntimeError where this CPU or build has no AMX."""
    if weight.qtype not in TYPES:
        raise ValueError(f"quant_amx.c does not read GGML type {weight.qtype}")
    return product(x, weight, weight.qtype, bias, lib)


def product(x: torch.Tensor, weight, qtype: int, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """quant_amx.c's product of bf16 rows and a weight of `qtype` (a GGUF type, or BF16P for a
    packed_linear.PackedWeight): the launcher both share."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the AMX product takes bf16 rows, not {x.dtype}")
    if weight.in_features % 32:
        raise ValueError(f"AMX takes whole blocks of 32 inputs, not {weight.in_features}")
    if qtype == BF16P and weight.packed.dtype != torch.bfloat16:
        raise ValueError(f"AMX reads a packed bf16 weight, not {weight.packed.dtype}")

    def launch(lib, x, bias, out, bf16):
        status = lib.matinee_quant_amx(x.data_ptr(), qtype, weight.packed.data_ptr(),
                                       None if bias is None else bias.data_ptr(), out.data_ptr(),
                                       x.shape[0], weight.out_features, weight.in_features, torch.get_num_threads())
        if status == UNAVAILABLE:
            raise RuntimeError("this CPU or kernel build has no AMX tiles")
        return status
    return cpu_native.projection(x, weight, bias, lib, "AMX linear", "bf16", launch)


def linear(x: torch.Tensor, weight: QuantWeight | QuantStack, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU backend's quantized projection: AMX where this call's rows reach the weight's measured
    threshold, else quant_gemm.c."""
    if isinstance(weight, QuantStack):
        return quant_linear.stacked(x, weight, bias, linear)
    if weight.amx_from is not None and x.shape[0] >= weight.amx_from and x.dtype == torch.bfloat16:
        return matmul(x, weight, bias)
    return quant_linear.matmul(x, weight, bias)


def prepare(tensor: QuantTensor, dtype: torch.dtype = torch.float32) -> QuantWeight:
    """quant_linear.pack, and for bf16 activations the row count from which AMX is faster."""
    weight = quant_linear.pack(tensor, dtype)
    path, reason = matmul_path(dtype)
    _say_once(path, reason)
    if path == "amx" and weight.qtype in TYPES:
        weight.amx_from = from_rows(weight.qtype, weight.out_features, weight.in_features)
    return weight


def matmul_path(dtype: torch.dtype) -> tuple[str, str]:
    """Which kernel multiplies quantized weights by activations of `dtype`, and why: "amx" (from a
    measured row count on; quant_gemm.c below it) or "int8" (quant_gemm.c only)."""
    if dtype != torch.bfloat16:
        return "int8", f"the activations are {str(dtype).removeprefix('torch.')}; AMX takes bfloat16 (--dtype bfloat16)"
    if cpu_native.library() is None:
        return "int8", "the CPU C kernels are off (see the log line above)"
    if not available():
        return "int8", _why_no_amx()
    return "amx", "AMX tiles available; each weight shape measures from which row count they beat quant_gemm.c"


def _why_no_amx() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            has_tiles = any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        has_tiles = False
    if not has_tiles:
        return "this CPU has no AMX tiles"
    return "the CPU has AMX tiles but Linux refused them to this process (arch_prctl) or the build lacks them"


_said: set[tuple[str, str]] = set()


def _say_once(path: str, reason: str) -> None:
    if (path, reason) not in _said:
        _said.add((path, reason))
        structlog.get_logger().info("quantized matmul path", path=path, reason=reason)


_available: bool | None = None


def available() -> bool:
    """Whether the loaded kernels can use AMX here (the CPU has it, the build used it, Linux grants it)."""
    global _available
    if _available is None:
        lib = cpu_native.library()
        if lib is None:
            _available = False
        else:
            x, weight = torch.zeros(1, 32, dtype=torch.bfloat16), _random_weight(quant_linear.Q8_0, 16, 32)
            try:
                matmul(x, weight, lib=lib)
                _available = True
            except RuntimeError:
                _available = False
    return _available


_decisions: dict[tuple[int, int, int, int], int | None] = {}


def from_rows(qtype: int, n: int, k: int) -> int | None:
    """The smallest measured row count from which AMX serves by threshold's rule (it beat the int8 kernel there,
    and at every larger count it beat it or tied and was not the slower), or None. Measured once per shape and
    thread count, kept on disk beside the library."""
    key = (torch.get_num_threads(), qtype, n, k)
    if key not in _decisions:
        # The row counts are part of the name: timings kept before a count was added are measured again.
        rows = ",".join(map(str, ROWS))
        ms = cpu_native.kept_measurement(".quant-amx.json",
                                         f"{key[0]} threads {quant_linear.NAMES[qtype]} {n}x{k} rows {rows}",
                                         lambda: _measure(qtype, n, k))
        _decisions[key] = threshold(ms)
        structlog.get_logger().info("quantized linear", shape=f"{n}x{k}", type=quant_linear.NAMES[qtype],
                                    amx_from_rows=_decisions[key], ms=ms)
    return _decisions[key]


def threshold(ms: dict[str, float], other: str = "int8", rows_measured: tuple[int, ...] = ROWS,
              winner: str = "amx", ties: bool = True) -> int | None:
    """From `_measure`'s timings: the row count from which `winner` (AMX) wins by MARGIN over `other`, and at every
    larger count either wins so or, with `ties`, is within the margin and still not the slower (a count where it
    is slower never goes to it). Without `ties`, a tie ends the range: for a winner that costs memory to take
    (torch's plain copy of a weight). A tie at the largest counts ended it for every kernel before: the int8
    down projection of a 1B Llama went to torch._int_mm at 16-256 rows, where AMX took 0.73 ms against 1.10,
    because at 512 rows it took 7.60 against 7.97."""
    start = None
    for rows in reversed(rows_measured):
        mine, theirs = ms[f"{winner}_{rows}"], ms[f"{other}_{rows}"]
        if mine * MARGIN < theirs:
            start = rows
        elif not (ties and mine <= theirs):
            break
    return start


def _random_weight(qtype: int, n: int, k: int) -> QuantWeight:
    return quant_linear.pack(QuantTensor(int(qtype), quant_linear.random_blocks(qtype, n, k), k), torch.bfloat16)


def _measure(qtype: int, n: int, k: int) -> dict[str, float]:
    """Best-of milliseconds of both kernels at each of ROWS, on at most SAMPLE_ROWS of a random weight of
    this type."""
    weight = _random_weight(qtype, min(n, SAMPLE_ROWS), k)
    gen = torch.Generator().manual_seed(1)

    def runs_at(rows):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        return {"int8": lambda: quant_linear.matmul(x, weight), "amx": lambda: matmul(x, weight)}
    return cpu_native.best_ms_at_rows(ROWS, runs_at, REPEATS)
