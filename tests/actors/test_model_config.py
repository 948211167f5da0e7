"""ModelConfig from Hugging Face config dicts (transformers 4 and 5 styles) and GGUF metadata."""
from __future__ import annotations

import pytest

from actors.model.config import ModelConfig, ModelLoadError

_BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8)


def test_defaults_and_derived_head_dim():
    cfg = ModelConfig.from_hf(dict(_BASE))
    assert cfg.family == "llama" and cfg.num_kv_heads == 8 and cfg.head_dim == 8
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None and not cfg.tie_word_embeddings
    assert not cfg.attention_bias and not cfg.qk_norm
    assert cfg.kv_bytes_per_token(4) == 2 * 2 * 8 * 8 * 4


def test_transformers4_rope_fields_and_eos_lists():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(dict(_BASE, rope_theta=500000.0, rope_scaling=scaling, eos_token_id=[128001, 128008],
                                   num_key_value_heads=2, tie_word_embeddings=True),
                              generation_cfg={"eos_token_id": [128001, 128009]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == scaling
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.tie_word_embeddings and cfg.num_kv_heads == 2


def test_transformers5_rope_parameters():
    cfg = ModelConfig.from_hf(dict(_BASE, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_linear_rope_scaling():
    cfg = ModelConfig.from_hf(dict(_BASE, rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_family_specifics():
    qwen2 = ModelConfig.from_hf(dict(_BASE, model_type="qwen2"))
    qwen3 = ModelConfig.from_hf(dict(_BASE, model_type="qwen3", head_dim=32))
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 256


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral_x", "architectures": ["MistralXForCausalLM"]}, "unsupported model architecture 'mistral_x'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding-window"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(dict(_BASE, **change))


def test_missing_key_is_named(tmp_path):
    import json

    from actors.model.config import read_hf_config

    cfg = dict(_BASE)
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="lacks the key 'intermediate_size'"):
        read_hf_config(str(tmp_path))


def test_gguf_metadata():
    meta = {"general.architecture": "qwen2", "qwen2.block_count": 2, "qwen2.embedding_length": 64,
            "qwen2.feed_forward_length": 128, "qwen2.attention.head_count": 4, "qwen2.attention.head_count_kv": 2,
            "qwen2.rope.freq_base": 1e6, "qwen2.context_length": 4096, "qwen2.vocab_size": 300,
            "tokenizer.ggml.eos_token_id": 7, "tokenizer.ggml.eot_token_id": 9}
    cfg = ModelConfig.from_gguf(meta, {"token_embd.weight", "output.weight"})
    assert cfg.family == "qwen2" and cfg.attention_bias and cfg.head_dim == 16 and not cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (7, 9) and cfg.max_position_embeddings == 4096
    with pytest.raises(ModelLoadError, match="GGUF rope scaling 'yarn' is not supported"):
        ModelConfig.from_gguf(dict(meta, **{"qwen2.rope.scaling.type": "yarn"}), set())
    with pytest.raises(ModelLoadError, match="partial rotary"):
        ModelConfig.from_gguf(dict(meta, **{"qwen2.rope.dimension_count": 8}), set())
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gemma'"):
        ModelConfig.from_gguf({"general.architecture": "gemma"}, set())
