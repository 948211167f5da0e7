"""Where a deployment's GPU memory goes: weights, KV cache, activation headroom; how many GPUs.

Pure arithmetic on a model's shape (actors/model/shape.py), for `matinee plan` to answer "does it
fit". The KV bytes a token and a block come from actors/model/value_bytes.py, which the engine sizes its KV
pool with, so the two cannot disagree.

Units: GB is 10^9 bytes, as in the serving chapter's figure (a 70B-class GQA model, 80 layers,
8 KV heads, head dim 128, at 128K context, 8 requests, 16-bit: weights 140 GB, KV 343.6 GB,
total about 484 GB, seven 80 GB GPUs). In 2^30 units its KV cache would read 320.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.model.value_bytes import GGUF_WEIGHT_BYTES, kv_bytes_per_block

if TYPE_CHECKING:
    from actors.model.shape import ModelShape

GB = 10 ** 9
GIB = 1 << 30

# Bytes per value, nominal: int4 ignores its per-group scales (the chapter's "70B at 4 bits is ~35 GB").
# A shape whose tensors are known sizes int8 / int4 weights as the engine holds them instead (held_int_bytes).
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "int8": 1, "fp8": 1, "int4": 0.5}
# GGUF types by the bytes a value as the CPU kernels hold them: model_bytes.GGUF_WEIGHT_BYTES.
WEIGHT_BYTES = DTYPE_BYTES | GGUF_WEIGHT_BYTES
AUTO = "auto"   # a GGUF file's own types: its packed matmul weights as held, the rest at the activation size
KV_SCALED = ("int8", "fp8")   # caches with a float32 scale per block and KV head
INT_WEIGHTS = ("int8", "int4")  # --quantization int8 / int4: projections quantized at load
BACKENDS = ("gpu", "cpu")     # whose int4 layout: quantize.py's (torch, Triton) or torch's CPU int4 matmul's

LOGIT_BYTES = 4    # the engine samples from float32 logits
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb|kib|mib|gib|tib)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": GB, "tb": 10 ** 12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": GIB, "tib": 1 << 40}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown precision {name!r} (fp32, bf16, fp16, int8, fp8, int4)") from None


def weight_bytes_per_value(name: str) -> float:
    try:
        return WEIGHT_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown precision {name!r} for weights ({', '.join(WEIGHT_BYTES)} or auto)") from None


def matmul_shapes(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """(outputs, inputs, is_lm_head) of every matmul weight the engine holds, fused as it loads them:
    q, k and v in one, gate and up in one; the LM head once (a tied embedding reads its rows)."""
    s = shape
    q, kv, h, i = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size, s.intermediate_size
    layer = [(q + 2 * kv, h, False), (h, q, False), (2 * i, h, False), (h, i, False)]
    return layer * s.num_layers + [(s.vocab_size, h, True)]


def float_params(shape: ModelShape) -> int:
    """Values the engine keeps in the activation dtype beside its matmuls: the norms, the biases, and an
    untied embedding (its rows are read, not multiplied)."""
    s = shape
    q, kv, h = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size
    layer = 2 * h + (q + 2 * kv if s.qkv_bias else 0) + (h if s.o_bias else 0) + (2 * s.head_dim if s.qk_norm else 0)
    return s.num_layers * layer + h + (0 if s.tied_embeddings else s.vocab_size * h)


def held_int_bytes(n: int, k: int, scheme: str, head: bool, backend: str, activation_size: float) -> int:
    """Bytes of one [n, k] matmul weight under --quantization int8 / int4 (kernels/quantize.py), scales
    included. int8: int8 values and a float32 scale per output channel (on the "cpu" backend also an int32
    sum per row, kernels/quant_linear_cpu.prepare_int8); the LM head is int8 under int4
    too. int4 asymmetric, in groups of quantize.int4_group_size_for(k): on the "gpu" backend (the torch
    and Triton ops) two values a byte, a float16 scale and a uint8 zero per group; on the "cpu" backend
    torch's CPU int4 layout (kernels/quant_linear_cpu.prepare_int4): rows padded to a multiple of 16,
    two values a byte, a scale and an offset per group in the activation dtype."""
    from kernels.quant_linear_cpu import INT4_N_MULTIPLE
    from kernels.quantize import int4_group_size_for

    if scheme == "int8" or head:   # the "cpu" backend keeps int8_gemm.c's int32 row sum beside each scale
        return n * k + (8 if backend == "cpu" else 4) * n
    groups = k // int4_group_size_for(k)
    if backend == "gpu":
        return n * k // 2 + n * groups * (2 + 1)
    rows = -(-n // INT4_N_MULTIPLE) * INT4_N_MULTIPLE
    return int(rows * k // 2 + rows * groups * 2 * activation_size)


def parse_size(text: str) -> int:
    """'80GB' -> 80 * 10^9, '80GiB' -> 80 * 2^30, '1000' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 80GB or 80GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


@dataclass(frozen=True)
class MemoryPlan:
    """One deployment: `concurrency` sequences of `context_len` tokens each, all resident at once.

    Activation headroom is a stated simple rule (the chapter gives none; its total is weights +
    KV): one step's working set, `step_tokens` tokens (the engine's max_num_batched_tokens) each
    holding its residual and normed hidden states, q, k, v and the MLP's gate and up at the
    activation precision (fp32 for fp32 weights, else 16-bit), plus float32 logits for one token
    per sequence.

    `weight_dtype` is a precision, a GGUF type (GGUF_WEIGHT_BYTES: every weight in it), or "auto": a GGUF
    file's own mix as the CPU engine holds it under --quantization auto (its packed matmul weights, the
    rest at the activation precision; the kernels' padding of a tensor to 16 rows is not counted, at most
    15 rows). `activation_dtype` unset: fp32 for fp32 weights, else 16-bit. An int8 or fp8 cache counts
    its scales, one per block of `block_size` tokens and KV head, as the engine's pool does.

    int8 and int4 on a shape whose tensors are known (`shape.has_layout`: a config.json, a GGUF file, a
    preset copied from one) are sized as the engine holds them under --quantization int8 / int4: every
    projection and the LM head quantized with their scales (held_int_bytes, on `backend`'s int4 layout),
    the norms, biases and an untied embedding at the activation precision. On a shape that is only a
    parameter count (the 70b-gqa preset) they are nominal, 1 and 0.5 bytes a value.
    """
    shape: ModelShape
    context_len: int
    concurrency: int = 1
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    step_tokens: int = 2048
    activation_dtype: str | None = None
    block_size: int = 16
    backend: str = "gpu"

    def __post_init__(self) -> None:
        dtype_bytes(self.kv_dtype)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.activation_dtype is not None:
            dtype_bytes(self.activation_dtype)
        if self.weight_dtype.lower() == AUTO:
            if not self.shape.quantized_params:
                raise ValueError(f"weight dtype auto sizes a GGUF file's own quantized weights; {self.shape.name!r} "
                                 f"has none (give a precision or a GGUF type)")
        else:
            weight_bytes_per_value(self.weight_dtype)
        for name in ("context_len", "concurrency", "step_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def weight_bytes(self) -> float:
        s = self.shape
        if self.weight_dtype.lower() == AUTO:
            return s.quantized_bytes + (s.num_params - s.quantized_params) * self._activation_size
        scheme = self.weight_dtype.lower()
        if scheme in INT_WEIGHTS and s.has_layout:
            return sum(held_int_bytes(n, k, scheme, head, self.backend, self._activation_size)
                       for n, k, head in matmul_shapes(s)) + float_params(s) * self._activation_size
        return s.num_params * weight_bytes_per_value(self.weight_dtype)

    @property
    def nominal_weights(self) -> bool:
        """int8 / int4 sized at their nominal bytes a value (the shape does not name its tensors)."""
        return self.weight_dtype.lower() in INT_WEIGHTS and not self.shape.has_layout

    @property
    def kv_bytes_per_token(self) -> float:
        s = self.shape
        block = kv_bytes_per_block(s.num_layers, s.num_kv_heads, s.head_dim, dtype_bytes(self.kv_dtype),
                                   self.block_size, scaled=self.kv_dtype.lower() in KV_SCALED)
        return block / self.block_size

    @property
    def kv_bytes_per_sequence(self) -> float:
        return self.kv_bytes_per_token * self.context_len

    @property
    def kv_bytes(self) -> float:
        return self.kv_bytes_per_sequence * self.concurrency

    @property
    def activation_bytes(self) -> float:
        return self._step_activation_bytes + self.concurrency * self._logit_bytes_per_sequence

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def gpus_needed(self, gpu_memory: int) -> int:
        """GPUs of `gpu_memory` bytes each that hold the total, weights and KV split evenly."""
        return max(1, math.ceil(self.total_bytes / gpu_memory))

    def max_concurrency(self, memory: int) -> int:
        """The most sequences of `context_len` tokens that `memory` bytes (all GPUs) hold; 0 if none."""
        free = memory - self.weight_bytes - self._step_activation_bytes
        per_sequence = self.kv_bytes_per_sequence + self._logit_bytes_per_sequence
        return max(0, int(free // per_sequence))

    def as_dict(self, gpu_memory: int) -> dict:
        return {"model": self.shape.name, "context_len": self.context_len, "concurrency": self.concurrency,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype, "step_tokens": self.step_tokens,
                "backend": self.backend, "nominal_weights": self.nominal_weights,
                "num_params": self.shape.num_params, "kv_bytes_per_token": self.kv_bytes_per_token,
                "weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                "activation_bytes": self.activation_bytes, "total_bytes": self.total_bytes,
                "gpu_memory": gpu_memory, "gpus": self.gpus_needed(gpu_memory)}

    @property
    def _activation_size(self) -> float:
        if self.activation_dtype is not None:
            return dtype_bytes(self.activation_dtype)
        return 4 if WEIGHT_BYTES.get(self.weight_dtype.lower()) == 4 else 2

    @property
    def _step_activation_bytes(self) -> float:
        s = self.shape
        values = 2 * s.hidden_size + s.num_heads * s.head_dim + 2 * s.num_kv_heads * s.head_dim \
            + 2 * s.intermediate_size
        return self.step_tokens * values * self._activation_size

    @property
    def _logit_bytes_per_sequence(self) -> float:
        return self.shape.vocab_size * LOGIT_BYTES
