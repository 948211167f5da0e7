"""bfloat16 projections on the CPU: packed_gemm.c's launcher, its weight layout, and when to use it.

torch's bf16 F.linear (oneDNN) on the reference 2-core Xeon (AVX-512, no AMX) is no faster than
float32 at one row and 1.6x slower at 256. packed_gemm.c reads each weight as bf16, from a layout
packed once at load, and multiplies in float32, or, where the CPU has AVX512-BF16 and it measures
faster (Zen 4, whose vdpbf16ps does twice the float32 FMA's work a cycle), takes bf16 rows through
vdpbf16ps from the same layout. Which kernel, and whether either beats torch, is measured once per
weight shape (layout) and kept on disk beside the built library; a weight's kernel is the same for
every row count, so a row's result never depends on its batch. On a CPU with AMX, many bf16 rows go to
its tiles from a measured row count on (quant_amx.c reads the packed layout, pairing k with k + 1 for
each column as it goes: no second copy of the weight); where torch wins on many rows only (and, with AMX,
beats it from a measured row count on), both layouts are kept and the row count picks. A tied embedding
reads its rows out of the packed LM head, so the model keeps one copy.

Under float32 activations (`--dtype auto` on a CPU without bf16 units) a bf16 or float16 checkpoint's weights are
packed too, in their own 16 bits (prepare_for_float32), and every row count goes through the FMA path: the same
products as the weights widened to float32, from half the bytes.
"""

from __future__ import annotations


import structlog
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_native, quant_amx

NR = 32            # output columns per packed block (two zmm, four ymm of float32)
# Where column c of a bf16 block sits within its 32 values: 2c for the first 16, 2(c-16)+1 for the rest (a
# float16 block keeps its columns in order).
_POSITION = torch.tensor([2 * (c % 16) + c // 16 for c in range(NR)])
_COLUMN = torch.argsort(_POSITION)     # the column at each position
_IN_ORDER = torch.arange(NR)
DECODE_ROWS, PREFILL_ROWS = 1, 256     # the batch sizes layout() measures
SAMPLE_ROWS, REPEATS = 8192, 5
MARGIN = 1.1
TORCH_FROM_ROWS = 64   # with both layouts kept: few rows read the packed one, more go to torch
# The row counts at which AMX is weighed against the packed kernel: from 8 rows, and on some shapes 4, the tiles
# reading every row at once beat it (quant_amx.c's few-row path; a 1B's down projection at 8 rows 1.35 ms against
# 1.67 from memory on a Xeon).
AMX_ROWS = (4, 8, 16, 32, 64, 128, PREFILL_ROWS)


class PackedWeight:
    """A [N, K] bf16 (or float16) weight as packed_gemm.c reads it: `packed` is [ceil(N/NR), K, NR]."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int) -> None:
        self.packed, self.out_features, self.in_features = packed, out_features, in_features
        # Where torch (oneDNN on AMX-class bf16 units) measured faster on many rows: the plain weight
        # too, which linear() multiplies through torch from TORCH_FROM_ROWS rows on.
        self.plain: torch.Tensor | None = None
        # bf16 rows through the kernel's vdpbf16ps path, where it measured faster (float32 rows never)
        self.dot = False
        # bf16 rows from this many on through AMX (quant_amx.c), where it measured faster; None: never
        self.amx_from: int | None = None
        self.torch_from = TORCH_FROM_ROWS   # with `plain`: rows from this many on go to torch

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def half(self) -> bool:
        """float16 values (a float16 checkpoint's, for float32 rows): no vdpbf16ps, AMX or torch copy."""
        return self.packed.dtype == torch.float16

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def numel(self) -> int:
        return self.out_features * self.in_features


def pack(weight: torch.Tensor) -> PackedWeight:
    """weight [N, K] (a float16 one kept so, any other float dtype converted to bf16) -> the packed layout, N padded
    with zeros."""
    n, k = weight.shape
    blocks = -(-n // NR)
    dtype = torch.float16 if weight.dtype == torch.float16 else torch.bfloat16
    padded = torch.zeros(blocks * NR, k, dtype=dtype)
    padded[:n] = weight
    columns = _IN_ORDER if dtype == torch.float16 else _COLUMN
    return PackedWeight(padded.view(blocks, NR, k)[:, columns].transpose(1, 2).contiguous(), n, k)


def _positions(weight: PackedWeight) -> torch.Tensor:
    return _IN_ORDER if weight.half else _POSITION


def unpack(weight: PackedWeight) -> torch.Tensor:
    """The plain [N, K] weight back."""
    blocks, k, _ = weight.packed.shape
    return weight.packed[:, :, _positions(weight)].transpose(1, 2).reshape(blocks * NR, k)[:weight.out_features] \
        .contiguous()


def matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """x[M, K] (bf16 or float32) @ weight.T (+ bias) -> [M, N] in x's dtype; `lib` defaults to the
    loaded kernels (a test passes another build)."""
    def launch(lib, x, bias, out, bf16):
        return lib.matinee_packed_gemm(x.data_ptr(), bf16, weight.packed.data_ptr(), int(weight.half),
                                       None if bias is None else bias.data_ptr(), out.data_ptr(), bf16,
                                       x.shape[0], weight.out_features, weight.in_features, torch.get_num_threads(),
                                       int(weight.dot and bf16 and lib.matinee_packed_dot()))
    return cpu_native.projection(x, weight, bias, lib, "packed linear", "float32", launch)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU backend's projection: the packed kernel for a packed weight, else cpu_gemm's path."""
    if isinstance(weight, PackedWeight):
        rows = x.shape[0]
        if weight.plain is not None and rows >= weight.torch_from:
            return F.linear(x, weight.plain, bias)
        if weight.amx_from is not None and rows >= weight.amx_from and x.dtype == torch.bfloat16:
            return quant_amx.product(x, weight, quant_amx.BF16P, bias)
        return matmul(x, weight, bias)
    return cpu_gemm.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    """Rows `ids` of the weight, as F.embedding gives them; row v of a packed one is
    packed[v // NR, :, position of v % NR]."""
    if not isinstance(weight, PackedWeight):
        return F.embedding(ids, weight)
    if ids.numel():
        low, high = torch.aminmax(ids)
        if low < 0 or high >= weight.out_features:
            raise IndexError(f"token id out of range [0, {weight.out_features})")
    return weight.packed[ids // NR, :, _positions(weight)[ids % NR]]


def prepare_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """A bf16 CPU weight packed where the kernel is faster for its shape (with the plain one kept
    beside it where torch is faster on many rows only); anything else as it is."""
    if not _packable(weight):
        return weight
    chosen, dot = layout(*weight.shape)
    if chosen == "torch":
        return weight
    packed = pack(weight)
    packed.dot = dot
    packed.amx_from, torch_from = amx_rows(*weight.shape, dot)
    if chosen == "both" and (packed.amx_from is None or torch_from is not None):
        packed.plain = weight
        packed.torch_from = TORCH_FROM_ROWS if packed.amx_from is None else torch_from
    return packed


def prepare_for_float32(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """A bf16 or float16 CPU weight that float32 rows multiply: packed in its own 16 bits, read by the kernel's
    FMA path at every row count (neither torch nor the bf16 units take float32 rows by such a weight); anything
    else as it is."""
    return pack(weight) if _packable(weight, (torch.bfloat16, torch.float16)) else weight


def prepare_invariant(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """prepare_weight for the batch-invariant kernels: a bf16 CPU weight always packed, and multiplied by the
    packed kernel at every row count (no plain copy for torch, no AMX tiles); anything else as it is."""
    if not _packable(weight):
        return weight
    packed = pack(weight)
    packed.dot = layout(*weight.shape)[1]
    return packed


def _packable(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """A matrix of `dtypes` on the CPU, where the kernels build: what the packed layout takes."""
    return weight.dtype in dtypes and weight.device.type == "cpu" and weight.dim() == 2 and cpu_native.available()


_decisions: dict[tuple[int, int, int], tuple[str, bool]] = {}


def layout(n: int, k: int) -> tuple[str, bool]:
    """How to keep a bf16 [n, k] weight: "torch" (plain) where torch is faster both at decode and at
    prefill, "both" where it is faster at prefill only (AMX: its bf16 units), else "packed"; and
    whether the kernel takes bf16 rows through its vdpbf16ps path.

    Measured once per shape and thread count, and kept in a file beside the built library (whose
    name is its digest), so a restart does not measure again."""
    key = (torch.get_num_threads(), n, k)
    if key not in _decisions:
        ms = cpu_native.kept_measurement(".bf16-linear.json", f"{key[0]} threads {n}x{k}", lambda: _measure(n, k))
        dot = _dot_faster(ms)
        faster = _torch_faster(ms, "dot" if dot else "kernel")
        _log(n, k, ms, dot, faster)
        _decisions[key] = ("torch" if len(faster) == 2 else "both" if faster == [PREFILL_ROWS] else "packed", dot)
    return _decisions[key]


_amx_decisions: dict[tuple[int, int, int, bool], tuple[int | None, int | None]] = {}


def amx_rows(n: int, k: int, dot: bool) -> tuple[int | None, int | None]:
    """From which row count AMX beats the packed kernel (its vdpbf16ps path with `dot`) at it and every
    larger count of AMX_ROWS, or None; and from which count torch beats AMX in turn (None: never, so no
    plain copy need be kept for torch). (None, None) without AMX, for bf16 rows, here. Measured once,
    kept as layout() is."""
    if k % 32 or not quant_amx.available():
        return None, None
    key = (torch.get_num_threads(), n, k, dot)
    if key not in _amx_decisions:
        rows = ",".join(map(str, AMX_ROWS))
        ms = cpu_native.kept_measurement(".bf16-amx.json", f"{key[0]} threads {n}x{k} dot {int(dot)} rows {rows} torch",
                                         lambda: _measure_amx(n, k, dot))
        start = quant_amx.threshold(ms, "kernel", AMX_ROWS)
        # torch only where AMX is taken (so where it beats AMX it beats the packed kernel too)
        torch_from = None if start is None else quant_amx.threshold(
            ms, "amx", tuple(r for r in AMX_ROWS if r >= start), winner="torch", ties=False)
        _amx_decisions[key] = (start, torch_from)
        structlog.get_logger().info("bf16 linear on AMX", shape=f"{n}x{k}", amx_from_rows=start,
                                    torch_from_rows=torch_from, ms=ms)
    return _amx_decisions[key]


def _measure_amx(n: int, k: int, dot: bool) -> dict[str, float]:
    """Best-of milliseconds of AMX, the packed kernel and torch at each of AMX_ROWS."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(min(n, SAMPLE_ROWS), k, generator=gen).to(torch.bfloat16)
    packed = pack(weight)
    packed.dot = dot

    def runs_at(rows):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        return {"kernel": lambda: matmul(x, packed), "amx": lambda: quant_amx.product(x, packed, quant_amx.BF16P),
                "torch": lambda: cpu_gemm.linear(x, weight)}
    return cpu_native.best_ms_at_rows(AMX_ROWS, runs_at, REPEATS)


def _dot_faster(ms: dict[str, float]) -> bool:
    """Whether the vdpbf16ps path (where the CPU has it) was clearly faster at prefill and no slower at
    decode than the float32 FMA path, by the margin either way."""
    return "dot_1" in ms and ms[f"dot_{PREFILL_ROWS}"] * MARGIN < ms[f"kernel_{PREFILL_ROWS}"] \
        and ms[f"dot_{DECODE_ROWS}"] <= ms[f"kernel_{DECODE_ROWS}"] * MARGIN


def _torch_faster(ms: dict[str, float], kernel: str) -> list[int]:
    """The sizes at which torch was clearly faster than `kernel`: by a margin, so that noise in a
    measurement shared with a neighbour on the cores does not flip the choice."""
    return [m for m in (DECODE_ROWS, PREFILL_ROWS) if ms[f"torch_{m}"] * MARGIN < ms[f"{kernel}_{m}"]]


def _measure(n: int, k: int) -> dict[str, float]:
    """Best-of milliseconds of each path at both sizes, on at most SAMPLE_ROWS of the weight (the LM
    head's full 256-row product alone takes 0.2 s)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(min(n, SAMPLE_ROWS), k, generator=gen).to(torch.bfloat16)
    packed = pack(weight)
    dotted = PackedWeight(packed.packed, packed.out_features, packed.in_features)   # the same bytes, the dot path
    dotted.dot = True
    has_dot = bool(cpu_native.library().matinee_packed_dot())

    def runs_at(rows):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        runs = {"kernel": lambda: matmul(x, packed), "torch": lambda: cpu_gemm.linear(x, weight)}
        if has_dot:
            runs["dot"] = lambda: matmul(x, dotted)
        return runs
    return cpu_native.best_ms_at_rows((DECODE_ROWS, PREFILL_ROWS), runs_at, REPEATS)


def _log(n: int, k: int, ms: dict[str, float], dot: bool, faster: list[int]) -> None:
    kernel = "packed kernel (vdpbf16ps)" if dot else "packed kernel"
    choice = ("torch" if len(faster) == 2 else f"{kernel} below {TORCH_FROM_ROWS} rows, torch above"
              if faster == [PREFILL_ROWS] else kernel)
    structlog.get_logger().info("bf16 linear", shape=f"{n}x{k}", choice=choice, ms=ms,
                                torch_faster_at_rows=faster or None)
