"""The model's shape, read from a Hugging Face config.json or from GGUF metadata.

One frozen dataclass describes every supported decoder (Llama, Qwen2, Qwen3); the model code
reads only this, never the raw config. Anything we cannot run is refused here with a clear error.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from actors.model.value_bytes import kv_bytes_per_token


class ModelLoadError(ValueError):
    """A model that cannot be loaded: missing path, unsupported architecture, missing tensor."""


# model_type -> family. The family decides the few structural differences between decoders.
_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    family: str                       # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # bias on q/k/v projections (Qwen2 always has it)
    qk_norm: bool                     # per-head RMSNorm on q and k before RoPE (Qwen3)
    o_proj_bias: bool = False         # bias on the attention output projection (Llama/Qwen3 attention_bias)
    rope_scaling: dict[str, Any] | None = None   # HF form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    name: str = ""
    # Per-frequency divisors stored by llama.cpp for Llama-3 style scaling (GGUF rope_freqs.weight).
    rope_freq_factors: tuple[float, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"model config: num_attention_heads ({self.num_heads}) is not a multiple "
                                 f"of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V that one token occupies over all layers (the planner's arithmetic)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_size)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> "ModelConfig":
        family = _hf_family(cfg)
        if cfg.get("use_sliding_window"):
            raise ModelLoadError(f"model config: sliding-window attention ({family}) is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"model config: activation {cfg.get('hidden_act')!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise ModelLoadError("model config: mlp_bias is not supported")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = _hf_rope(cfg)
        eos = _as_ids(cfg.get("eos_token_id"))
        if generation_cfg:
            eos += [t for t in _as_ids(generation_cfg.get("eos_token_id")) if t not in eos]
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            o_proj_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            eos_token_ids=tuple(eos),
            bos_token_id=cfg.get("bos_token_id"),
            name=cfg.get("_name_or_path", "") or "",
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """`meta` maps GGUF keys to plain Python values; `tensor_names` tells tied from untied."""
        arch = meta.get("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv = int(get("attention.head_count_kv") or num_heads)
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling = None
        scaling_type = get("rope.scaling.type")
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
        elif scaling_type not in (None, "none"):
            raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported (none, linear)")
        head_dim = int(get("attention.key_length") or hidden // num_heads)
        rot_dim = get("rope.dimension_count")
        if rot_dim is not None and int(rot_dim) != head_dim:
            raise ModelLoadError(f"GGUF partial rotary embedding ({rot_dim} of {head_dim} dims) is not supported")
        # Chat models end a turn with an end-of-turn token that may differ from EOS: stop on both.
        eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
        return cls(
            family=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2",
            qk_norm=False,
            rope_scaling=scaling,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            name=str(meta.get("general.name", "")),
        )


def _hf_family(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    for arch in cfg.get("architectures") or ():
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    named = model_type or ", ".join(cfg.get("architectures") or ()) or "unknown"
    raise ModelLoadError(f"unsupported model architecture {named!r} (supported: llama, qwen2, qwen3)")


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Reads RoPE from transformers 5 (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`) configs."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    merged.pop("rope_theta", None)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        if "factor" not in merged:
            raise ModelLoadError("model config: linear rope_scaling lacks factor")
        return theta, {"rope_type": "linear", "factor": float(merged["factor"])}
    if rope_type != "llama3":
        raise ModelLoadError(f"model config: rope_scaling type {rope_type!r} is not supported "
                             f"(default, linear, llama3)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in merged]
    if missing:
        raise ModelLoadError(f"model config: llama3 rope_scaling lacks {', '.join(missing)}")
    merged["rope_type"] = "llama3"
    merged.pop("type", None)
    return theta, merged


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def read_hf_config(folder: str) -> ModelConfig:
    """A Hugging Face folder's config.json (and generation_config.json, for EOS ids)."""
    cfg = read_json(os.path.join(folder, "config.json"))
    gen_path = os.path.join(folder, "generation_config.json")
    gen = read_json(gen_path) if os.path.isfile(gen_path) else None
    try:
        return ModelConfig.from_hf(cfg, gen)
    except KeyError as e:
        raise ModelLoadError(f"{folder}/config.json lacks the key {e.args[0]!r}") from None


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
