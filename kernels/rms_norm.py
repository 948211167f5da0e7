"""RMSNorm and RMSNorm fused with the residual add: the pure-torch reference.

This is the CPU serving path and the oracle for the Triton kernels in rms_norm_triton.py.
It follows Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    # Cast before the weight multiply, as transformers does, so float32 parity is exact
    # and half-precision results round where the reference model rounds.
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in the model dtype); y = rms_norm(new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
