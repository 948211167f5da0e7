"""An int8 or fp8 (e4m3) KV cache, scaled per block and KV head: the pure-torch reference.

Layout. The cache tensors keep their shape, [num_blocks, block_size, Hk, D], in torch.int8 or
torch.float8_e4m3fn; beside each one, a float32 scale per (block, KV head), [num_blocks, Hk]. A
cached value q stands for q * scale. Scales follow block ids, so prefix sharing (whole blocks shared
by refcount, never written again) and forks carry them along with no copy, and preemption
recomputes into fresh blocks.

Why per block and head, not per token: a float32 scale per token and head costs 4 bytes beside
every head's D values (SmolLM2's D = 64: 1.88x bfloat16's tokens at the same memory); per block of
16 tokens it costs a quarter of a byte, and the pool holds 1.99x. The price is that a block is
written a token at a time while its scale must cover all of its tokens. The rule, the same in every
kernel (kv_write.py's reference here, cpu_layer_ops.c, kv_write_triton.py):

- Tokens are written in the order of the slot mapping. Writing offset 0 of a block starts it afresh
  (its scale is reset: a block is filled from its start, and a freed block's old scale means nothing).
- A head's scale only grows: when a token's largest |value| exceeds what the scale reaches
  (scale x QMAX), the scale becomes amax / QMAX and the block's tokens before it (offsets below its
  own) are requantized to it for that head (q' = quantize(q x old / new)); then the token is
  quantized with the scale.
- Quantizing is x / scale rounded to nearest even: int8 clamped to [-127, 127]; fp8 clamped to
  [-448, 448] (e4m3's largest finite value; its NaN codes are never written). A scale of 0 (a head
  with only zeros so far) stores zeros.

So a block's contents depend only on the values written into it and their order, never on how the
writes were split into calls or batched with other sequences. Each requantization rounds again, by
at most half a step of the new scale: at most block_size - 1 times per block, in practice a few in
its first tokens, where the scale settles.

Speculative decoding: a verification writes every drafted token, and the rollback of rejected ones
moves no bytes; a rejected token may have grown its block's scale (and requantized its earlier
tokens), so with a quantized cache speculative decoding gives plain decoding's tokens only up to
that rounding, where a float cache gives them exactly. Preemption recomputes into fresh blocks,
whose first write resets their scales.
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED_DTYPES


def check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None) -> None:
    """A quantized cache pair needs float32 scales [num_blocks, Hk] each; a plain one, none."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K and V caches of different dtypes ({k_cache.dtype}, {v_cache.dtype})")
    if not is_quantized(k_cache):
        return
    want = (k_cache.shape[0], k_cache.shape[2])
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != want or not s.is_contiguous():
            raise ValueError(f"a {k_cache.dtype} KV cache needs {name}: contiguous float32 {list(want)}")


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values already divided by their scale -> the cache dtype, rounded to nearest even."""
    qmax = QMAX[dtype]
    if dtype == torch.int8:
        return x.round().clamp(-qmax, qmax).to(torch.int8)
    return x.clamp(-qmax, qmax).to(dtype)


def dequantize(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hk, D] with scales [num_blocks, Hk] -> float32 values."""
    return cache.to(torch.float32) * scales[:, None, :, None]


def _write_one(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """The rule above for one cache: x [n, Hk, D] into slots [n] of distinct blocks."""
    block_size = cache.shape[1]
    qmax = QMAX[cache.dtype]
    blocks, offsets = slots // block_size, slots % block_size
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=2)                                          # [n, Hk]
    old = torch.where((offsets == 0)[:, None], 0.0, scales[blocks])
    grows = amax > old * qmax
    new = torch.where(grows, amax / qmax, old)
    requant = grows & (old > 0)
    if bool(requant.any()):
        # The block's tokens before this one, of the heads whose scale grows.
        earlier = torch.arange(block_size, device=slots.device)[None, :] < offsets[:, None]
        moved = earlier[:, :, None] & requant[:, None, :]                  # [n, block_size, Hk]
        factor = torch.where(requant, old / torch.where(new > 0, new, 1.0), 1.0)
        held = cache[blocks]
        requantized = quantize(held.to(torch.float32) * factor[:, None, :, None], cache.dtype)
        codes = torch.where(moved[..., None], requantized.view(torch.uint8), held.view(torch.uint8))
        cache[blocks] = codes.view(cache.dtype)
    scales[blocks] = new
    safe = torch.where(new > 0, new, 1.0)
    cache.view(-1, *cache.shape[2:])[slots] = quantize(x / safe[:, :, None], cache.dtype)


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """The rule above, in waves: wave j writes each block's j-th token of this call, so a wave's
    blocks are distinct and it runs as a few vector ops (at most block_size waves for a prefill)."""
    check_scales(k_cache, v_cache, k_scales, v_scales)
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.numel() == 0:
        return
    if int(slots.max()) >= k_cache.shape[0] * k_cache.shape[1]:
        raise IndexError("write_kv: a slot outside the KV cache")
    blocks = slots // k_cache.shape[1]
    # Each token's rank among the tokens of its block, in call order.
    order = torch.sort(blocks, stable=True).indices
    sorted_blocks = blocks[order]
    first = torch.ones_like(sorted_blocks, dtype=torch.bool)
    first[1:] = sorted_blocks[1:] != sorted_blocks[:-1]
    index = torch.arange(len(order), device=slots.device)
    group_start = torch.cummax(torch.where(first, index, 0), 0).values
    rank = torch.empty_like(order)
    rank[order] = index - group_start
    for j in range(int(rank.max()) + 1):
        wave = (rank == j).nonzero().squeeze(1)
        _write_one(k[wave], k_cache, k_scales, slots[wave])
        _write_one(v[wave], v_cache, v_scales, slots[wave])
