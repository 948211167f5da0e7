"""What a model's values take in memory: a weight value by GGUF type as the CPU kernels hold it, and
K and V by the token and by the KV pool's block.

The engine sizes its KV pool with these, a model's shape (actors/model/shape.py) sizes a GGUF file's
packed weights with them, and the planner (actors/model/memory_plan.py) sizes a deployment with them, so
none can disagree. Plain arithmetic that imports nothing else of ours: everything above may use it.
"""
from __future__ import annotations

# A GGUF weight type as the CPU kernels hold it (--quantization auto), scales included: the 32-value blocks
# as the file stores them (Q4_1: 20 bytes, 5 bits a weight), the K-quants' 256-value super-blocks with a
# byte per sub-block scale (kernels/kquant.py: Q4_K 148 bytes, 4.625 bits, against the file's 144).
# The kernels' own tables (quant_linear.BLOCK_BYTES, kquant.ROW_BYTES) import torch, which planning
# does without: a test holds this copy to them.
GGUF_WEIGHT_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32,
                     "iq4_nl": 18 / 32, "q4_k": 148 / 256, "q5_k": 180 / 256, "q6_k": 210 / 256, "iq4_xs": 138 / 256}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: float) -> float:
    """K and V of one token over all layers: layers x KV heads x head dim x 2 x bytes."""
    return num_layers * num_kv_heads * head_dim * 2 * dtype_size


KV_SCALE_BYTES = 4   # an int8 or fp8 cache's float32 scale per (block, KV head), for K and for V


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype_size: float, block_size: int,
                       scaled: bool = False) -> int:
    """One pool block over all layers: block_size tokens' K and V, and with `scaled` (an int8 or fp8
    cache) the scales beside them (kernels/kv_quant.py)."""
    scales = num_layers * num_kv_heads * 2 * KV_SCALE_BYTES if scaled else 0
    return int(kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_size) * block_size) + scales
