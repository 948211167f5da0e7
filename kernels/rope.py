"""Rotary position embedding (neox layout): the cos/sin cache and the pure-torch reference.

Scaled RoPE variants (linear, Llama-3) only change the inverse frequencies, so they live in
build_cos_sin_cache; the kernels (here and in rope_triton.py) never see the scaling.
"""

import math

import torch


def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    # Same expression as transformers' default rope init, for bit-exact float32 parity.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    if high_freq_factor <= low_freq_factor:
        raise ValueError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by the factor, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    head_dim: int, max_pos: int, theta: float, rope_scaling: dict | None = None
) -> torch.Tensor:
    """float32 [max_pos, head_dim]: row p = cat(cos(p * inv_freq), sin(p * inv_freq)).

    rope_scaling follows the Hugging Face config: None, {"rope_type"|"type": "default"},
    {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}.
    """
    if head_dim % 2 != 0 or head_dim <= 0:
        raise ValueError(f"rotary head_dim must be a positive even number, got {head_dim}")
    if max_pos <= 0:
        raise ValueError(f"max_pos must be positive, got {max_pos}")
    inv_freq = _inverse_frequencies(head_dim, theta)
    rope_type = None
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    else:
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")
    positions = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q[T, Hq, D] and k[T, Hk, D] by their token positions[T]; returns new tensors."""
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    # [T, 1, D/2] so one row broadcasts over every head of its token.
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
