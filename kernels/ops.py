"""The set of ops the model code calls, and the one place that picks their backend.

"torch" is the pure-torch reference; "cpu" the C kernels of the CPU serving path (few-row
float32 matmuls, bf16 matmuls on weights packed at load, int8 products on GGUF-quantized weights
(bf16 products on AMX from the rows where they measure faster),
torch's int8 and int4 matmuls on weights quantized at load,
short-query paged attention, one call per norm, rotary embedding, KV write and SiLU-and-multiply,
every segment of a step's LoRA adapters in one call;
the reference for everything else);
"triton" the Triton kernels, which on a CPU run only under Triton's interpreter; "auto" picks by device.

The "cpu" backend's batch-invariant table (`get_ops(..., batch_invariant=True)`, `--batch-invariant`) gives
up every choice of kernel by the step's row count, the only thing that makes a row's numbers depend on its
batch: projections never switch to AMX tiles or torch from some row count on (quant_gemm.c, packed_gemm.c
and cpu_gemm.c at every size, each of which sums a row in one order whatever the rows beside it), and every
query run, prefill chunks too, goes through the decode attention kernel, which computes each row alone
from its own keys (parts of its context from key 0). int8 products are exact integers on every path.
"""

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from kernels import activation, cpu_gemm, cpu_layer_ops, cpu_native, decode_layers, kv_write, packed_linear, \
    paged_attention, lora, lora_cpu, paged_attention_cpu, quant_amx, quant_linear, quant_linear_cpu, quant_matmul, rms_norm, rope
from kernels.quantize import Int4Weight, Int8Weight

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class Ops:
    backend: str
    prepare_weight: Callable    # a matmul weight at load -> what `linear` and `embedding` take
    # A bf16 or float16 checkpoint's matmul weight under float32 activations -> what `linear` multiplies float32
    # rows by, the weight still in its 16 bits (each such value is a float32 one: the same products from half the
    # bytes); None: the weight is widened to float32 at load.
    prepare_16bit_for_float32: Callable | None
    prepare_quantized: Callable | None   # a GGUF-quantized one (QuantTensor, dtype) -> the same; None: dequantize it
    prepare_int: Callable   # an Int8Weight / Int4Weight (quantize.py's layouts) and the activation dtype -> the same
    linear: Callable
    embedding: Callable
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_attention: Callable
    # (model, embeddings, positions, meta, kv_caches) -> (hidden, residual) after the layers, the whole
    # loop in one call; None where the backend has none, or it returns None for the step: model.py loops
    decode_layers: Callable | None = None
    # (out, x, A stack, B stack, segments, layout): each segment's rows add x @ A[slot] @ B[slot] (kernels/lora.py)
    add_lora: Callable = lora.add_lora
    batch_invariant: bool = False   # no kernel chosen by the step's rows (the module's docstring)


def _torch_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # int8 as the CPU path multiplies it (activations quantized per token); int4 weight-only.
    if isinstance(weight, Int8Weight):
        return quant_matmul.int8_dynamic_linear(x, weight, bias)
    if isinstance(weight, Int4Weight):
        return quant_matmul.linear(x, weight, bias)
    return quant_linear.torch_linear(x, weight, bias)


def _int_rows_or(embedding: Callable) -> Callable:
    """An embedding that reads an Int8Weight's or Int4Weight's rows (a tied LM head) itself, in float32."""
    def rows(ids: torch.Tensor, weight) -> torch.Tensor:
        if isinstance(weight, (Int8Weight, Int4Weight)):
            return quant_matmul.embedding(ids, weight)
        return embedding(ids, weight)
    return rows


TORCH_OPS = Ops(
    backend="torch",
    prepare_weight=lambda weight: weight,
    prepare_16bit_for_float32=None,
    prepare_quantized=quant_linear.pack,
    prepare_int=lambda weight, dtype: weight,
    linear=_torch_linear,
    embedding=_int_rows_or(quant_linear.torch_embedding),
    rms_norm=rms_norm.rms_norm,
    fused_add_rms_norm=rms_norm.fused_add_rms_norm,
    rotary_embedding=rope.rotary_embedding,
    silu_and_mul=activation.silu_and_mul,
    write_kv=kv_write.write_kv,
    paged_attention=paged_attention.paged_attention,
)



def _cpu_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, quant_linear.QUANTIZED):
        return quant_amx.linear(x, weight, bias)
    if isinstance(weight, (Int8Weight, quant_linear_cpu.Int4CpuWeight)):
        return quant_linear_cpu.linear(x, weight, bias)
    return packed_linear.linear(x, weight, bias)


def _cpu_prepare_int(weight: Int8Weight | Int4Weight, dtype: torch.dtype):
    # int8_gemm.c reads the Int8Weight as it is, with its row sums; torch's CPU int4 matmul wants its own layout.
    if isinstance(weight, Int4Weight):
        return quant_linear_cpu.prepare_int4(weight, dtype)
    return quant_linear_cpu.prepare_int8(weight)


def _cpu_embedding(ids: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, quant_linear.QuantWeight):
        return quant_linear.embedding(ids, weight)
    return packed_linear.embedding(ids, weight)


def _cpu_decode_layers(model, *args, **kwargs):
    """decode_layers.c runs the CPU table's own kernels: a table with any of them replaced (a test's
    reference) runs the layer loop, which calls what it holds."""
    table = CPU_INVARIANT_OPS if model.ops.batch_invariant else CPU_OPS
    if any(getattr(model.ops, name) is not getattr(table, name) for name in _LAYER_OPS):
        return None
    return decode_layers.run(model, *args, **kwargs)


def _invariant_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):   # float32 (bf16 ones are packed): cpu_gemm.c at every row count
        return cpu_gemm.linear(x, weight, bias, max_rows=None)
    return _cpu_linear(x, weight, bias)


_LAYER_OPS = ("linear", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "write_kv", "paged_attention",
              "silu_and_mul", "add_lora")
CPU_OPS = replace(TORCH_OPS, backend="cpu", prepare_weight=packed_linear.prepare_weight,
                  prepare_16bit_for_float32=packed_linear.prepare_for_float32,
                  prepare_quantized=quant_amx.prepare, linear=_cpu_linear,
                  prepare_int=_cpu_prepare_int, embedding=_int_rows_or(_cpu_embedding), paged_attention=paged_attention_cpu.paged_attention,
                  rms_norm=cpu_layer_ops.rms_norm, fused_add_rms_norm=cpu_layer_ops.fused_add_rms_norm,
                  rotary_embedding=cpu_layer_ops.rotary_embedding, write_kv=cpu_layer_ops.write_kv,
                  silu_and_mul=cpu_layer_ops.silu_and_mul, decode_layers=_cpu_decode_layers,
                  add_lora=lora_cpu.add_lora)
CPU_INVARIANT_OPS = replace(CPU_OPS, prepare_weight=packed_linear.prepare_invariant,
                            prepare_quantized=quant_linear.pack, linear=_invariant_linear,
                            paged_attention=paged_attention_cpu.invariant_paged_attention, batch_invariant=True)


def _triton_interpreter_on() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def _triton_ops() -> Ops:
    # Imported here, not at the top: the kernels are decorated at import, and the decorator
    # reads TRITON_INTERPRET then, so it must be set before the first Triton backend is built.
    from kernels import activation_triton, kv_write_triton, linear, lora_triton, paged_attention_triton, \
        quant_matmul_triton, rms_norm_triton, rope_triton

    def triton_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, (Int8Weight, Int4Weight)):
            return quant_matmul_triton.linear(x, weight, bias)
        return linear.linear(x, weight, bias)

    return replace(TORCH_OPS, backend="triton", prepare_quantized=None, linear=triton_linear,
                   embedding=_int_rows_or(F.embedding),
                   rms_norm=rms_norm_triton.rms_norm,
                   fused_add_rms_norm=rms_norm_triton.fused_add_rms_norm,
                   rotary_embedding=rope_triton.rotary_embedding,
                   silu_and_mul=activation_triton.silu_and_mul,
                   write_kv=kv_write_triton.write_kv,
                   paged_attention=paged_attention_triton.paged_attention,
                   add_lora=lora_triton.add_lora)


def get_ops(backend: str = "auto", device: torch.device | str = "cpu", batch_invariant: bool = False) -> Ops:
    """Return the ops for `backend` ("auto" | "torch" | "cpu" | "triton") on `device`; `batch_invariant`: the
    "cpu" backend's batch-invariant table (the module's docstring), which no other backend has."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "cpu" if cpu_native.available() else "torch"
    if batch_invariant:
        if backend != "cpu" or device.type != "cpu":
            raise ValueError(f"batch_invariant needs the CPU C kernels (kernels='cpu' on the CPU), not {backend!r} "
                             f"on {device.type}")
        if not cpu_native.available():
            raise ValueError("batch_invariant needs the CPU C kernels: a C compiler (cc) and a CPU with AVX2 and FMA")
        return CPU_INVARIANT_OPS
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
