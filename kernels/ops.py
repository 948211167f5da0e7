"""The set of ops the model code calls, and the one place that picks their backend.

"torch" is the pure-torch reference; "cpu" the C kernels of the CPU serving path (few-row
float32 matmuls, bf16 matmuls on weights packed at load, int8 products on GGUF-quantized weights,
short-query paged attention, one call per norm, rotary embedding, KV write and SiLU-and-multiply;
the reference for everything else);
"triton" the Triton kernels, which on a CPU run only under Triton's interpreter; "auto" picks by device.
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import activation, cpu_layer_ops, cpu_native, kv_write, packed_linear, paged_attention, \
    paged_attention_cpu, quant_linear, rms_norm, rope

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class Ops:
    backend: str
    prepare_weight: Callable    # a matmul weight at load -> what `linear` and `embedding` take
    prepare_quantized: Callable | None   # a GGUF-quantized one (QuantTensor, dtype) -> the same; None: dequantize it
    linear: Callable
    embedding: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_attention: Callable


TORCH_OPS = Ops(
    backend="torch",
    prepare_weight=lambda weight: weight,
    prepare_quantized=quant_linear.pack,
    linear=quant_linear.torch_linear,
    embedding=quant_linear.torch_embedding,
    rms_norm=rms_norm.rms_norm,
    fused_add_rms_norm=rms_norm.fused_add_rms_norm,
    rotary_embedding=rope.rotary_embedding,
    silu_and_mul=activation.silu_and_mul,
    write_kv=kv_write.write_kv,
    paged_attention=paged_attention.paged_attention,
)



def _cpu_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, quant_linear.QuantWeight):
        return quant_linear.matmul(x, weight, bias)
    return packed_linear.linear(x, weight, bias)


def _cpu_embedding(ids: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, quant_linear.QuantWeight):
        return quant_linear.embedding(ids, weight)
    return packed_linear.embedding(ids, weight)


CPU_OPS = replace(TORCH_OPS, backend="cpu", prepare_weight=packed_linear.prepare_weight, linear=_cpu_linear,
                  embedding=_cpu_embedding, paged_attention=paged_attention_cpu.paged_attention,
                  rms_norm=cpu_layer_ops.rms_norm, fused_add_rms_norm=cpu_layer_ops.fused_add_rms_norm,
                  rotary_embedding=cpu_layer_ops.rotary_embedding, write_kv=cpu_layer_ops.write_kv,
                  silu_and_mul=cpu_layer_ops.silu_and_mul)


def _triton_interpreter_on() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def _triton_ops() -> Ops:
    # Imported here, not at the top: the kernels are decorated at import, and the decorator
    # reads TRITON_INTERPRET then, so it must be set before the first Triton backend is built.
    from kernels import activation_triton, kv_write_triton, linear, paged_attention_triton, rms_norm_triton, rope_triton

    return replace(TORCH_OPS, backend="triton", prepare_quantized=None, linear=linear.linear, embedding=F.embedding,
                   rms_norm=rms_norm_triton.rms_norm,
                   fused_add_rms_norm=rms_norm_triton.fused_add_rms_norm,
                   rotary_embedding=rope_triton.rotary_embedding,
                   silu_and_mul=activation_triton.silu_and_mul,
                   write_kv=kv_write_triton.write_kv,
                   paged_attention=paged_attention_triton.paged_attention)


def get_ops(backend: str = "auto", device: torch.device | str = "cpu") -> Ops:
    """Return the ops for `backend` ("auto" | "torch" | "cpu" | "triton") on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu" if cpu_native.available() else "torch"
    if backend == "torch":
        return TORCH_OPS
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"kernels='cpu' runs on the CPU, not on {device.type}")
        if not cpu_native.available():
            raise ValueError("kernels='cpu' needs a C compiler (cc) and a CPU with AVX2 and FMA; "
                             "use kernels='torch' (or 'auto')")
        return CPU_OPS
    if device.type != "cuda" and not _triton_interpreter_on():
        raise ValueError(
            f"kernels='triton' on a {device.type} device needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before starting (or use kernels='torch' / 'auto')"
        )
    return _triton_ops()
