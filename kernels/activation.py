"""SiLU-and-multiply for the gated MLP: the pure-torch reference.

The CPU serving path and the oracle for activation_triton.py.
"""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] -> silu(x[:, :I]) * x[:, I:], shape [T, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
