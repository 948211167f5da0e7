"""The model's tokenizer from an HF folder and from a GGUF file: encode/decode, EOS, chat template."""
from __future__ import annotations

import pytest

from actors.text.tokenizer import Tokenizer, load_tokenizer
from actors.model.config import ModelLoadError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def test_hf_folder_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tiny_model_dir("qwen2")
    tok = load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    text = "Hello world! The quick brown fox, ünïcode and 😀."
    ids = tok.encode(text)
    assert ids == hf.encode(text) and len(ids) > 5
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == (2,)
    chat = tok.apply_chat_template(CHAT)
    assert all(isinstance(t, int) for t in chat)
    assert tok.decode(chat, skip_special_tokens=False) == tok.render_chat(CHAT)
    assert tok.render_chat(CHAT).endswith("<|im_start|>assistant\n")
    assert tok.decode([3] + ids + [2], skip_special_tokens=True) == text


def test_tokenizer_only_folder(tiny_model_dir, tmp_path):
    from tests.actors.conftest import build_tiny_tokenizer

    build_tiny_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Hello world") == load_tokenizer(tiny_model_dir("llama")).encode("Hello world")
    assert tok.eos_token_ids == (2,)


def test_no_chat_template_is_a_clear_error(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir("llama"))
    bare = Tokenizer(tok.hf, tok.eos_token_ids)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHAT)


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nothing"))


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers_and_is_cached(smollm2_gguf, tmp_path):
    cache = tmp_path / "cache"
    tok = load_tokenizer(smollm2_gguf, cache_dir=cache)     # built from GGUF metadata, then saved
    again = load_tokenizer(smollm2_gguf, cache_dir=cache)   # reloaded from the cache folder
    assert len(list(cache.iterdir())) == 1
    assert tok.encode("Hello world") == [19556, 905]  # as transformers' own GGUF tokenizer encodes it
    text = "The capital of France is Paris. 1 + 1 = 2; émigré 😀"
    assert tok.encode(text) == again.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == again.eos_token_ids == (2,)  # <|im_end|>
    chat = tok.apply_chat_template(CHAT)
    assert chat == again.apply_chat_template(CHAT)
    assert chat[:3] == [1, 9690, 198] and chat[-3:] == [520, 9531, 198]  # "<|im_start|>system" ... "assistant\n"
    assert tok.render_chat(CHAT).endswith("<|im_start|>assistant\n")
