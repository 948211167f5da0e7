"""The set of ops the model code calls, and the one place that picks their backend.

"torch" is the pure-torch reference (the CPU serving path); "triton" the Triton kernels,
which on a CPU run only under Triton's interpreter; "auto" picks by device.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import activation, kv_write, paged_attention, rms_norm, rope

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Ops:
    backend: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_attention: Callable


TORCH_OPS = Ops(
    backend="torch",
    rms_norm=rms_norm.rms_norm,
    fused_add_rms_norm=rms_norm.fused_add_rms_norm,
    rotary_embedding=rope.rotary_embedding,
    silu_and_mul=activation.silu_and_mul,
    write_kv=kv_write.write_kv,
    paged_attention=paged_attention.paged_attention,
)


def _triton_interpreter_on() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def _triton_ops() -> Ops:
    # Imported here, not at the top: the kernels are decorated at import, and the decorator
    # reads TRITON_INTERPRET then, so it must be set before the first Triton backend is built.
    from kernels import activation_triton, kv_write_triton, paged_attention_triton, rms_norm_triton, rope_triton

    return Ops(
        backend="triton",
        rms_norm=rms_norm_triton.rms_norm,
        fused_add_rms_norm=rms_norm_triton.fused_add_rms_norm,
        rotary_embedding=rope_triton.rotary_embedding,
        silu_and_mul=activation_triton.silu_and_mul,
        write_kv=kv_write_triton.write_kv,
        paged_attention=paged_attention_triton.paged_attention,
    )


def get_ops(backend: str = "auto", device: torch.device | str = "cpu") -> Ops:
    """Return the ops for `backend` ("auto" | "torch" | "triton") on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TORCH_OPS
    if device.type != "cuda" and not _triton_interpreter_on():
        raise ValueError(
            f"kernels='triton' on a {device.type} device needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before starting (or use kernels='torch' / 'auto')"
        )
    return _triton_ops()
