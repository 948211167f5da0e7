"""Compiles every Triton kernel for an NVIDIA GPU (sm_90) without one, down to a cubin.

The interpreter runs kernels as NumPy code, so it misses what only the compiler sees:
loop-carried values changing type, dot shapes the hardware cannot do, unsupported casts.
Run with TRITON_INTERPRET unset: `python -m tests.kernels.compile_for_gpu [--quick]`.
"""

import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget

from kernels import activation_triton, kv_write_triton, lora_triton, paged_attention_triton, rms_norm_triton, \
    rope_triton
from kernels.kv_quant import QMAX

INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "pos_ptr": "*i64", "slot_ptr": "*i64", "order_ptr": "*i64", "group_start_ptr": "*i64",
                  "seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32"}
# An int8 cache's codes, and an fp8 one's, which the kernels read as bytes.
INT8_CACHE = {"k_cache_ptr": "*i8", "v_cache_ptr": "*i8", "cache_ptr": "*i8"}
FP8_CACHE = {"k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "cache_ptr": "*u8"}
FLOAT32_POINTERS = ("t_ptr", "part_acc_ptr", "part_max_ptr", "part_sum_ptr", "cache_ptr", "k_scales_ptr", "v_scales_ptr",
                    "scale_ptr")
FLOAT_SCALARS = ("eps", "scale_log2")


def _signature(fn, constexprs: dict, dtype: str, pointers: dict) -> dict:
    """`pointers`: a variant's own pointer types (a quantized cache's codes), before the names' defaults."""
    sig = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = INDEX_POINTERS[name]
        elif name in FLOAT32_POINTERS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _divisibility(fn) -> dict:
    """What the JIT assumes at run time for 16-aligned pointers and strides divisible by 16:
    without it the compiler cannot prove alignment and falls back to scalar loads."""
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name.endswith("_ptr") or name.startswith("stride") or name in ("head_dim", "width", "inner", "half")]
    return {(i,): [["tt.divisibility", 16]] for i in aligned}


def _ptx_notes(ptx: str) -> str:
    loads = [line for line in ptx.splitlines() if "ld.global" in line or "cp.async." in line and "[" in line]
    # cp.async.cg copies 16 bytes; .v2/.v4 loads are vectors; anything else is a scalar load.
    wide = sum(1 for line in loads if "cp.async.cg" in line or ".v2." in line or ".v4." in line)
    # `/` on float32 compiles to these (up to 2 ulp off); tl.math.div_rn to div.rn.f32.
    approximate = sum(ptx.count(op) for op in ("div.full.f32", "div.approx.f32"))
    return f"{wide} vector / {len(loads) - wide} scalar global loads, {approximate} approximate divisions"


def quantized_cache_variants():
    """The attention over an int8 and an fp8 cache, and the writer of each: a byte a value, a scale a block."""
    pa = paged_attention_triton
    for fp8, pointers in ((False, INT8_CACHE), (True, FP8_CACHE)):
        yield pa._paged_attention_kernel, "bf16", dict(
            QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4, TILE_N=64, HEAD_PAD=128, NUM_SPLITS=1, DOT_PRECISION="tf32",
            QUANTIZED=True, FP8=fp8, pointers=pointers)
        yield kv_write_triton._write_kv_quantized_kernel, "bf16", dict(
            QMAX=QMAX[torch.float8_e4m3fn if fp8 else torch.int8], FP8=fp8, BLOCK_S=16, HEAD_PAD=64,
            pointers=pointers)


def variants(quick: bool = False):
    pa = paged_attention_triton
    if quick:  # one of each kernel: what the test suite affords
        yield pa._paged_attention_kernel, "bf16", dict(
            QUERIES_PER_KV=4, BLOCK_M=16, BLOCK_Q=4, TILE_N=64, HEAD_PAD=128, NUM_SPLITS=8, DOT_PRECISION="tf32",
            QUANTIZED=False, FP8=False)
        yield pa._merge_splits_kernel, "bf16", dict(NUM_SPLITS=8, SPLITS_PAD=8, HEAD_PAD=128)
        yield rms_norm_triton._rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK=4096)
        yield rope_triton._rope_kernel, "bf16", dict(BLOCK_ROWS=64, BLOCK_HALF=64)
        yield activation_triton._silu_and_mul_kernel, "bf16", dict(BLOCK_ROWS=4, BLOCK_COLS=1024)
        yield kv_write_triton._write_kv_kernel, "bf16", dict(BLOCK_T=4, BLOCK_W=1024)
        yield from quantized_cache_variants()
        yield from lora_variants()
        return
    shapes = ((4, 16, 1), (4, 16, 8), (7, 64, 1), (32, 32, 1))  # (queries per KV head, BLOCK_M, splits)
    for dtype, precision, variants in (("bf16", "tf32", shapes), ("fp16", "tf32", shapes[:1]),
                                       ("fp32", "ieee", shapes[:1])):
        for qpk, block_m, splits in variants:
            yield pa._paged_attention_kernel, dtype, dict(
                QUERIES_PER_KV=qpk, BLOCK_M=block_m, BLOCK_Q=block_m // qpk, TILE_N=64, HEAD_PAD=128,
                NUM_SPLITS=splits, DOT_PRECISION=precision, QUANTIZED=False, FP8=False)
    yield pa._merge_splits_kernel, "bf16", dict(NUM_SPLITS=8, SPLITS_PAD=8, HEAD_PAD=128)
    yield pa._merge_splits_kernel, "fp16", dict(NUM_SPLITS=3, SPLITS_PAD=4, HEAD_PAD=64)
    yield rms_norm_triton._rms_norm_kernel, "bf16", dict(HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK=4096)
    yield rms_norm_triton._rms_norm_kernel, "fp32", dict(HAS_RESIDUAL=False, BLOCK_ROWS=32, BLOCK=128)
    yield rope_triton._rope_kernel, "bf16", dict(BLOCK_ROWS=64, BLOCK_HALF=64)
    yield activation_triton._silu_and_mul_kernel, "bf16", dict(BLOCK_ROWS=4, BLOCK_COLS=1024)
    yield kv_write_triton._write_kv_kernel, "bf16", dict(BLOCK_T=4, BLOCK_W=1024)
    yield from quantized_cache_variants()
    yield from lora_variants()


def lora_variants():
    """The batched LoRA's shrink and expand (kernels/lora_triton.py), at rank 16."""
    m, k, n = lora_triton.BLOCK_M, lora_triton.BLOCK_K, lora_triton.BLOCK_N
    yield lora_triton._shrink_kernel, "bf16", dict(BLOCK_M=m, BLOCK_K=k, BLOCK_R=16)
    yield lora_triton._expand_kernel, "bf16", dict(BLOCK_M=m, BLOCK_N=n, BLOCK_R=16)


def main() -> int:
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    for fn, dtype, constexprs in variants(quick="--quick" in sys.argv):
        t0 = time.perf_counter()
        label = f"{fn.__name__} {dtype} {constexprs}"
        try:
            pointers = constexprs.pop("pointers", {})
            src = triton.compiler.ASTSource(fn=fn, signature=_signature(fn, constexprs, dtype, pointers),
                                            constexprs=constexprs, attrs=_divisibility(fn))
            compiled = triton.compile(src, target=target)
            print(f"ok   {label}: {time.perf_counter() - t0:.1f}s, shared {compiled.metadata.shared} B, "
                  f"{_ptx_notes(compiled.asm['ptx'])}")
        except Exception as exc:  # report every kernel, not just the first failure
            failures += 1
            print(f"FAIL {label}: {type(exc).__name__}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
