"""Kernels for the model code: each Triton (GPU) or C (CPU) kernel beside its pure-torch reference.

`get_ops(backend, device)` is the single dispatch point; `build_cos_sin_cache` builds the
rotary table (with rope scaling) that `rotary_embedding` reads.
"""

from kernels.ops import BACKENDS, Ops, get_ops
from kernels.rope import build_cos_sin_cache

__all__ = ["BACKENDS", "Ops", "build_cos_sin_cache", "get_ops"]
