"""The few numbers of a model that size its memory, from a config.json, a GGUF file or a preset.

No weights are read: a GGUF file's tensor table gives its exact parameter count, a config.json's
shape gives it by arithmetic (`params_of`). Presets are well-known shapes, each from its source.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from actors.model.value_bytes import GGUF_WEIGHT_BYTES
from actors.model.config import ModelConfig, read_hf_config


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    max_context: int
    # A GGUF file's matmul weights that the CPU kernels keep packed (--quantization auto): their
    # parameters, and their bytes as held (model_bytes.GGUF_WEIGHT_BYTES). 0 for other sources.
    quantized_params: int = 0
    quantized_bytes: int = 0
    # The tensors beside the matmuls, where the shape's source names them (a config.json, a GGUF file,
    # a preset copied from one). None: the shape is a parameter count alone (the chapter's 70e9), so
    # int8 / int4 are sized at their nominal bytes a value (memory_plan.MemoryPlan.weight_bytes).
    tied_embeddings: bool | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @property
    def has_layout(self) -> bool:
        return self.tied_embeddings is not None

    @classmethod
    def of(cls, cfg: ModelConfig, num_params: int | None = None, name: str = "", quantized: tuple[int, int] = (0, 0)
           ) -> "ModelShape":
        return cls(name=name or cfg.name, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                   num_params=params_of(cfg) if num_params is None else num_params,
                   max_context=cfg.max_position_embeddings, quantized_params=quantized[0],
                   quantized_bytes=quantized[1], tied_embeddings=cfg.tie_word_embeddings,
                   qkv_bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, qk_norm=cfg.qk_norm)

    @classmethod
    def load(cls, model: str) -> "ModelShape":
        """A preset's name, a folder with config.json (or one .gguf), or a .gguf file."""
        if model.lower() in PRESETS:
            return PRESETS[model.lower()]
        if not os.path.exists(os.path.expanduser(model)):
            raise ValueError(f"unknown model {model!r}: not a path, nor a preset ({', '.join(PRESETS)})")
        from actors.model.source import resolve_model_source

        source = resolve_model_source(model)
        if source.kind == "gguf":
            return cls.from_gguf(source.path)
        return cls.from_config_json(source.path)

    @classmethod
    def from_config_json(cls, folder: str) -> "ModelShape":
        cfg = read_hf_config(folder)
        return cls.of(cfg, name=cfg.name or os.path.basename(os.path.normpath(folder)))

    @classmethod
    def from_gguf(cls, path: str) -> "ModelShape":
        """Metadata and the tensor table only; the parameter count is the tensors' element count."""
        from actors.model.gguf_file import GGUFFile

        file = GGUFFile(path)
        cfg = ModelConfig.from_gguf(file.metadata, set(file.tensors))
        params = sum(math.prod(t.shape) for t in file.tensors.values() if t.name != "rope_freqs.weight")
        return cls.of(cfg, num_params=params, name=cfg.name or os.path.basename(path),
                      quantized=packed_weights(file.tensors))


_FUSED = re.compile(r"(blk\.\d+\.)(?:attn_[qkv]|ffn_gate|ffn_up)\.weight")


def packed_weights(tensors: dict) -> tuple[int, int]:
    """(parameters, bytes) of the GGUF tensors the CPU kernels keep packed, by the loader's rule: a 2-D
    weight of a type they read, where every tensor it is fused with (q, k, v; gate, up) is one too."""
    from gguf.constants import GGMLQuantizationType

    def per_value(t) -> float | None:
        try:
            name = GGMLQuantizationType(t.qtype).name.lower()
        except ValueError:   # a type this gguf package does not know: not one the kernels read either
            return None
        return GGUF_WEIGHT_BYTES.get(name) if len(t.shape) == 2 else None

    groups: dict[str, list] = {}
    for t in tensors.values():
        m = _FUSED.fullmatch(t.name)
        key = m.group(1) + ("qkv" if "attn" in t.name else "gate_up") if m else t.name
        groups.setdefault(key, []).append(t)
    params = size = 0
    for members in groups.values():
        if all(per_value(t) is not None for t in members):
            params += sum(math.prod(t.shape) for t in members)
            size += sum(int(math.prod(t.shape) * per_value(t)) for t in members)
    return params, size


def params_of(cfg: ModelConfig) -> int:
    """Parameters of a Llama/Qwen decoder: embeddings, per-layer attention, MLP and norms, head."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size + 2 * h
    if cfg.attention_bias:
        layer += q + 2 * kv
    if cfg.o_proj_bias:
        layer += h
    if cfg.qk_norm:
        layer += 2 * cfg.head_dim
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_layers * layer + h


PRESETS = {
    # The serving chapter's "70B-class GQA model": 80 layers, 8 KV heads, head dim 128, 70e9
    # parameters (its 140 GB at 16-bit); the rest of the shape is Llama-3.1-70B's config.json. A
    # nominal count (the real model has 70.55e9), so no layout: its int4 is the chapter's 35 GB.
    "70b-gqa": ModelShape("70b-gqa", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                          hidden_size=8192, intermediate_size=28672, vocab_size=128256,
                          num_params=70 * 10 ** 9, max_context=131072),
    # meta-llama/Meta-Llama-3-8B config.json (untied embeddings).
    "llama-3-8b": ModelShape("llama-3-8b", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             hidden_size=4096, intermediate_size=14336, vocab_size=128256,
                             num_params=8_030_261_248, max_context=8192, tied_embeddings=False),
    # Qwen/Qwen2.5-0.5B config.json (tied embeddings, q/k/v biases).
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                               hidden_size=896, intermediate_size=4864, vocab_size=151936,
                               num_params=494_032_768, max_context=32768, tied_embeddings=True,
                               qkv_bias=True),
    # HuggingFaceTB/SmolLM2-135M config.json (tied embeddings): the default model's shape.
    "smollm2-135m": ModelShape("smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               hidden_size=576, intermediate_size=1536, vocab_size=49152,
                               num_params=134_515_008, max_context=8192, tied_embeddings=True),
}
