"""ModelShape from a config.json folder, a GGUF file's metadata and tensor table, and the presets."""
from __future__ import annotations

import math
import os

import pytest
from safetensors import safe_open

from actors.model.shape import PRESETS, ModelShape, params_of
from actors.model.config import ModelConfig


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "llama_bias", "qwen2", "qwen3"])
def test_config_json_counts_the_saved_parameters(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    shape = ModelShape.load(folder)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        saved = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert shape.num_params == saved
    assert shape.num_layers == 3 and shape.hidden_size == 64 and shape.max_context == 1024


def test_gguf_reads_the_default_models_shape(smollm2_gguf):
    shape = ModelShape.load(smollm2_gguf)
    expected = PRESETS["smollm2-135m"]
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert (shape.hidden_size, shape.intermediate_size, shape.vocab_size) == (576, 1536, 49152)
    assert shape.num_params == expected.num_params == 134_515_008
    assert ModelShape.load(os.path.dirname(smollm2_gguf)).num_layers == 30   # a folder with one .gguf


# Each preset's stated parameter count is its config.json's arithmetic (the chapter's is its 70e9).
_HF = {
    "llama-3-8b": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(_HF))
def test_presets_match_their_configs(name):
    p = PRESETS[name]
    cfg = ModelConfig.from_hf(dict(_HF[name], vocab_size=p.vocab_size, hidden_size=p.hidden_size,
                                   intermediate_size=p.intermediate_size, num_hidden_layers=p.num_layers,
                                   num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
                                   max_position_embeddings=p.max_context))
    assert cfg.head_dim == p.head_dim
    assert params_of(cfg) == p.num_params


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model 'gpt-5': not a path, nor a preset \\(70b-gqa, "):
        ModelShape.load("gpt-5")
    assert ModelShape.load("Llama-3-8B") is PRESETS["llama-3-8b"]
