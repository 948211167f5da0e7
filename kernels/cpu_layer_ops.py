"""A layer's small ops on the CPU, one C call each: cpu_layer_ops.c's launchers.

RMSNorm (with the residual add), the rotary embedding, the KV cache write (into a cache of the activations'
dtype, or an int8 or fp8 one: kv_quant.py) and SiLU-and-multiply, for float32 and bfloat16 tensors; anything else (another dtype, a layout the kernels do not take) goes to the
pure-torch reference, which computes the same thing in 8-20 small ops.
"""

from __future__ import annotations

import torch

from kernels import activation, cpu_native, kv_write, rms_norm as rms_norm_ref, rope
from kernels.kv_quant import check_scales, is_quantized

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(name: str, *tensors: torch.Tensor):
    """The C function for the tensors' common dtype, or None where the reference must run."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors):
        return None
    lib = cpu_native.library()
    return None if lib is None else getattr(lib, f"matinee_{name}_{_SUFFIX[dtype]}")


def _norm_weight(weight: torch.Tensor, *xs: torch.Tensor) -> bool:
    return weight.dim() == 1 and weight.is_contiguous() and all(x.shape[-1] == weight.shape[0] for x in xs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fn = _kernel("rms_norm", x, weight)
    if fn is None or not _norm_weight(weight, x):
        return rms_norm_ref.rms_norm(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    fn(x.data_ptr(), None, None, weight.data_ptr(), out.data_ptr(), x.numel() // weight.shape[0],
       weight.shape[0], eps, torch.get_num_threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    fn = _kernel("rms_norm", x, residual, weight)
    if fn is None or not _norm_weight(weight, x) or x.shape != residual.shape:
        return rms_norm_ref.fused_add_rms_norm(x, residual, weight, eps)
    width = weight.shape[0]
    x, residual = x.contiguous(), residual.contiguous()
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    fn(x.data_ptr(), residual.data_ptr(), new_residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
       x.numel() // width, width, eps, torch.get_num_threads())
    return out, new_residual


def _heads_view(x: torch.Tensor) -> bool:
    """[T, H, D] with each head's D values contiguous and a token's heads side by side (a slice of
    the fused qkv output is one)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they are the step's own fresh tensors) and returns them."""
    fn = _kernel("rope", q, k)
    if (fn is None or not (_heads_view(q) and _heads_view(k)) or q.shape[2] != k.shape[2]
            or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[1] != q.shape[2]
            or positions.shape[0] != q.shape[0] or q.shape[0] != k.shape[0]):
        return rope.rotary_embedding(positions, q, k, cos_sin_cache)
    positions = positions.to(torch.int64).contiguous()
    cache = cos_sin_cache.contiguous()
    status = fn(positions.data_ptr(), q.data_ptr(), k.data_ptr(), cache.data_ptr(), q.shape[0], q.shape[1],
                k.shape[1], q.shape[2], q.stride(0), k.stride(0), cache.shape[0], torch.get_num_threads())
    if status:
        raise IndexError(f"rotary_embedding: a position outside the table of {cache.shape[0]}")
    return q, k


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    if is_quantized(k_cache) or is_quantized(v_cache):
        return _write_kv_quantized(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    fn = _kernel("write_kv", k, v, k_cache, v_cache)
    if (fn is None or not (_heads_view(k) and _heads_view(v)) or k.shape != v.shape
            or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]
            or slot_mapping.shape[0] != k.shape[0]):
        return kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V caches")
    slots = slot_mapping.to(torch.int64).contiguous()
    status = fn(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k.shape[0],
                k.shape[1] * k.shape[2], k.stride(0), v.stride(0), k_cache.shape[0] * k_cache.shape[1],
                torch.get_num_threads())
    if status:
        raise IndexError("write_kv: a slot outside the KV cache")


def _write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    check_scales(k_cache, v_cache, k_scales, v_scales)
    fn = _kernel("write_kv_quant", k, v)
    if (fn is None or k_cache.device.type != "cpu" or not (_heads_view(k) and _heads_view(v)) or k.shape != v.shape
            or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]
            or slot_mapping.shape[0] != k.shape[0]):
        return kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V caches")
    slots = slot_mapping.to(torch.int64).contiguous()
    status = fn(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr(),
                v_scales.data_ptr(), slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k.stride(0), v.stride(0),
                k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1], int(k_cache.dtype == torch.float8_e4m3fn))
    if status:
        raise IndexError("write_kv: a slot outside the KV cache")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    fn = _kernel("silu_and_mul", x)
    if fn is None or x.shape[-1] % 2:
        return activation.silu_and_mul(x)
    x = x.contiguous()
    half = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], half)
    fn(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], half, torch.get_num_threads())
    return out
