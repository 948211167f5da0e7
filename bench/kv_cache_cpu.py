"""One layer's KV write and paged attention on the CPU, per KV cache dtype: the model dtype's cache
against int8 and fp8 (kernels/kv_quant.py), timed.

SmolLM2-135M's geometry (9 query heads, 3 KV heads, head_dim 64, block size 16): a 1,024-token
prefill's write, prefill attention of 4 x 256 new tokens, and a decode of 32 sequences of 30 tokens.
Prints ms per call (mean of a few, after a warm-up); asserts nothing about speed.

    python -m bench.kv_cache_cpu [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu_layer_ops, paged_attention_cpu
from kernels.kv_quant import QUANTIZED_DTYPES

T, HQ, HK, D, BLOCK = 1024, 9, 3, 64, 16


def mean_ms(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(ap.parse_args().threads)
    num_blocks = T // BLOCK + 8
    tables = torch.arange(T // BLOCK, dtype=torch.int32).view(4, -1)
    lens, starts = torch.full((4,), 256, dtype=torch.int32), torch.arange(0, T + 1, 256, dtype=torch.int32)
    decode_tables = (torch.arange(64, dtype=torch.int32) % num_blocks).view(32, 2)
    decode_lens, decode_starts = torch.full((32,), 30, dtype=torch.int32), torch.arange(33, dtype=torch.int32)
    for act in (torch.float32, torch.bfloat16):
        k, v = torch.randn(T, HK, D).to(act), torch.randn(T, HK, D).to(act)
        q, q_decode = torch.randn(T, HQ, D).to(act), torch.randn(32, HQ, D).to(act)
        for cache_dtype in (act, *QUANTIZED_DTYPES):
            k_cache = torch.zeros(num_blocks, BLOCK, HK, D, dtype=cache_dtype)
            v_cache = torch.zeros_like(k_cache)
            scales = {}
            if cache_dtype in QUANTIZED_DTYPES:
                scales = {"k_scales": torch.zeros(num_blocks, HK), "v_scales": torch.zeros(num_blocks, HK)}
            write = mean_ms(lambda: cpu_layer_ops.write_kv(k, v, k_cache, v_cache, torch.arange(T),
                                                           *scales.values()), 20)
            prefill = mean_ms(lambda: paged_attention_cpu.paged_attention(
                q, k_cache, v_cache, tables, lens, starts, 256, 256, D ** -0.5, **scales), 5)
            decode = mean_ms(lambda: paged_attention_cpu.paged_attention(
                q_decode, k_cache, v_cache, decode_tables, decode_lens, decode_starts, 1, 30, D ** -0.5,
                **scales), 50)
            print(f"{str(act):15} cache {str(cache_dtype):20} write {write:7.3f} ms  "
                  f"prefill attention {prefill:6.2f} ms  decode attention {decode:6.3f} ms")


if __name__ == "__main__":
    main()
