"""Writing new K/V rows into the paged cache by slot mapping: the pure-torch reference.

Caches are [num_blocks, block_size, Hk, D]; slot = block_id * block_size + offset, and a
negative slot (a padding token) writes nothing. An int8 or fp8 cache also takes its scales
(kv_quant.py).
"""

import torch

from kernels.kv_quant import is_quantized, write_kv_quantized


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    if is_quantized(k_cache) or is_quantized(v_cache):
        return write_kv_quantized(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V caches")
    # flatten(0, 1) is a view of a contiguous cache, so index_copy_ writes in place.
    k_flat = k_cache.flatten(0, 1)
    v_flat = v_cache.flatten(0, 1)
    k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v.to(v_cache.dtype))
