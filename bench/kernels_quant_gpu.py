"""GPU benchmark of the quantized Triton matmul: each weight format's achieved bandwidth on decode
shapes against the device's copy bandwidth, beside torch's bfloat16 F.linear on the same shape.

`python -m bench.kernels_quant_gpu [--json out.json]` on a CUDA machine (a minute or two);
`--dry-run` runs it at toy sizes on the CPU under Triton's interpreter, to check the script.
Without CUDA (and without --dry-run) it refuses in one line. Bytes counted per call: the whole
quantized weight (quants, scales, zero points), x and the output; the last line is the JSON summary.
Times are the device's own (Timer: a CUDA graph of many calls, each on one of enough copies of the weight
to miss the L2 cache). `error` is against the kernel's own math (kernel_math: the weight rounded to x's
dtype before the products), `vs fp32` against dequantize-then-matmul in float32, the difference being that
rounding: a Q8_0 weight of 8-bit integers times a float16 scale loses bits in bfloat16's 8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.kernels_gpu import Timer, _error, copy_bandwidth, gpu_run, print_summary

ROWS = [1, 4, 16]
# (N, K) of the projections of each model shape: SmolLM2-135M (and its LM head), a 7B Llama.
SHAPES = {
    "smollm2": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],
    "7b": [(4096, 4096), (11008, 4096), (4096, 11008)],
}
DRY_SHAPES = {"toy": [(80, 128), (48, 96)]}
FORMATS = ("int8", "int4", "q8_0", "q4_0", "q4_1")


def make_weight(fmt: str, n: int, k: int, device: torch.device):
    """A weight in `fmt`: int8 and int4 quantized from random floats; GGUF rows of random quants
    with small random block scales (the bytes' values do not change the bandwidth)."""
    from kernels.quantize import GGUF_BLOCK_BYTES, GGMLType, GGUFWeight, int4_group_size_for, quantize_int4, \
        quantize_int8

    if fmt in ("int8", "int4"):
        w = torch.randn(n, k, device=device) * k ** -0.5
        return quantize_int8(w) if fmt == "int8" else quantize_int4(w, int4_group_size_for(k))
    qtype = GGMLType[fmt.upper()]
    block_bytes = GGUF_BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (n, k // 32 * block_bytes), dtype=torch.uint8, device=device)
    halves = raw.view(n, k // 32, block_bytes).view(torch.float16)     # [n, blocks, block_bytes // 2]
    halves[:, :, 0] = (torch.rand(n, k // 32, device=device) * 0.01).half()          # d
    if qtype == GGMLType.Q4_1:
        halves[:, :, 1] = (-torch.rand(n, k // 32, device=device) * 0.08).half()     # m
    return GGUFWeight(raw, qtype)


def weight_bytes(weight) -> int:
    tensors = [getattr(weight, name) for name in weight.__dataclass_fields__]
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def kernel_math(x: torch.Tensor, weight) -> torch.Tensor:
    """What the kernel computes, in float32 on the device: each weight dequantized in float32 and rounded to
    x's dtype before the products (an int8 weight's integers are exact; its scale multiplies the sums)."""
    from kernels import quant_matmul
    from kernels.quantize import Int8Weight

    if isinstance(weight, Int8Weight):
        return ((x.float() @ weight.qweight.float().t()) * weight.scale.float()).to(x.dtype)
    return (x.float() @ quant_matmul.dequantize(weight).to(x.dtype).float().t()).to(x.dtype)


def _copies(weight, device) -> list:
    """The weight (a tensor or a quantized one) and enough copies of it to fill the L2 cache twice
    over: the timed calls go round them, so each reads its weight from memory, as a decode step's
    projections do."""
    if device.type != "cuda":
        return [weight]
    size = weight.numel() * weight.element_size() if torch.is_tensor(weight) else weight_bytes(weight)
    extra = 2 * torch.cuda.get_device_properties(device).L2_cache_size // size
    if torch.is_tensor(weight):
        return [weight] + [weight.clone() for _ in range(extra)]
    fields = {name: getattr(weight, name) for name in weight.__dataclass_fields__}
    return [weight] + [type(weight)(**{k: v.clone() if torch.is_tensor(v) else v for k, v in fields.items()})
                       for _ in range(extra)]


def measure(shapes, device, dtype, timer, ceiling):
    from kernels import quant_matmul, quant_matmul_triton

    rows = []
    for model, projections in shapes.items():
        for n, k in projections:
            denses = _copies(torch.randn(n, k, device=device).to(dtype), device)
            for fmt in FORMATS:
                weights = _copies(make_weight(fmt, n, k, device), device)
                for m in ROWS:
                    x = torch.randn(m, k, device=device).to(dtype)
                    out = quant_matmul_triton.linear(x, weights[0])
                    error = _error(out, kernel_math(x, weights[0]))
                    error_f32 = _error(out, quant_matmul.linear(x, weights[0]))
                    ms = timer(lambda: [quant_matmul_triton.linear(x, w) for w in weights]) / len(weights)
                    dense_ms = timer(lambda: [F.linear(x, w) for w in denses]) / len(denses)
                    io = weight_bytes(weights[0]) + (m * k + m * n) * x.element_size()
                    dense_io = n * k * x.element_size() + (m * k + m * n) * x.element_size()
                    rows.append(dict(model=model, n=n, k=k, format=fmt, m=m, ms=ms, error=error,
                                     error_vs_float32=error_f32, bw_frac=io / (ms / 1000) / ceiling,
                                     dense_ms=dense_ms, dense_bw_frac=dense_io / (dense_ms / 1000) / ceiling,
                                     speedup_vs_dense=dense_ms / ms))
                del weights
    return rows


def main(argv=None) -> None:
    args, device, dtype = gpu_run("kernels_quant_gpu", __doc__, argv)
    timer = Timer(device, args.dry_run)
    torch.manual_seed(0)

    ceiling = copy_bandwidth(device, timer, args.dry_run)
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter, dry run)",
               "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
               "copy_bandwidth_gb_s": ceiling / 1e9}
    print(f"device-to-device copy: {ceiling / 1e9:.0f} GB/s (read + write)")
    summary["matmuls"] = measure(DRY_SHAPES if args.dry_run else SHAPES, device, dtype, timer, ceiling)
    tolerance = 0.03 if dtype == torch.bfloat16 else 1e-4
    summary["correct"] = all(r["error"] <= tolerance for r in summary["matmuls"])
    print(f"{'model':>8} {'N x K':>13} {'format':>6} {'M':>3} {'ms':>8} {'bw frac':>8} "
          f"{'dense ms':>9} {'bw frac':>8} {'speedup':>8} {'error':>9} {'vs fp32':>9}")
    for r in summary["matmuls"]:
        print(f"{r['model']:>8} {r['n']:>6}x{r['k']:<6} {r['format']:>6} {r['m']:3d} {r['ms']:8.4f} "
              f"{r['bw_frac']:8.2f} {r['dense_ms']:9.4f} {r['dense_bw_frac']:8.2f} {r['speedup_vs_dense']:8.2f} "
              f"{r['error']:9.2e} {r['error_vs_float32']:9.2e}{'' if r['error'] <= tolerance else ' FAIL'}")
    print_summary(summary, args.json)


if __name__ == "__main__":
    main()
