"""The model's tokenizer: encode, decode, EOS ids and the chat template, from an HF folder or a GGUF.

Building a tokenizer from GGUF metadata takes many seconds, so the result is saved once in a
cache folder (keyed by the file's path, size and mtime) and reloaded from there afterwards.
"""
from __future__ import annotations

import copy
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from actors.model.config import ModelLoadError
from actors.model.source import ModelSource, resolve_model_source

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "matinee" / "tokenizers"


class Tokenizer:
    """A thin face over a transformers tokenizer, with the calls the engine and gateway need."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos = [int(t) for t in eos_token_ids]
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)
        # The Rust tokenizer decodes several times faster than the Python wrapper; use it when the
        # wrapper would not post-process (clean up spaces) the text differently.
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        cleans = bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False))
        self._fast_decode = backend.decode if backend is not None and not cleans else None

    def with_chat_template(self, template: str) -> Tokenizer:
        """The same tokenizer rendering chats with `template` instead of the model's own."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        """Token ids of the conversation rendered by the model's own chat template."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        out = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False,
                                          chat_template=self.chat_template, **kwargs)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        """The conversation as text (what apply_chat_template tokenizes)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, chat_template=self.chat_template, **kwargs)


def load_tokenizer(model: str | os.PathLike | ModelSource | None = None,
                   cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR) -> Tokenizer:
    """The tokenizer of a model folder or GGUF file (None: the default model).

    `cache_dir=None` disables the GGUF tokenizer cache.
    """
    from transformers import AutoTokenizer  # deferred: importing transformers takes seconds

    if isinstance(model, ModelSource):
        source = model
    elif model is not None and any(os.path.isfile(os.path.join(model, f))
                                   for f in ("tokenizer.json", "tokenizer_config.json")):
        source = ModelSource("hf", os.fspath(model))  # a tokenizer-only folder has no config.json
    else:
        source = resolve_model_source(model)
    eos: list[int] = []
    try:
        if source.kind == "hf":
            from actors.model.config import read_hf_config

            hf = AutoTokenizer.from_pretrained(source.path)
            try:
                eos = list(read_hf_config(source.path).eos_token_ids)
            except ModelLoadError:
                pass  # a tokenizer-only folder
        else:
            hf = _gguf_tokenizer(source.path, cache_dir)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {source.path}: {e}") from None
    return Tokenizer(hf, eos)


def _gguf_tokenizer(path: str, cache_dir: str | os.PathLike | None):
    from transformers import AutoTokenizer

    cached = None
    if cache_dir is not None:
        st = os.stat(path)
        key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
        cached = Path(cache_dir) / key
        if (cached / "tokenizer_config.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cached))
            except Exception:
                pass  # a damaged cache entry is rebuilt below
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    if cached is not None:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        try:
            hf.save_pretrained(str(tmp))
            os.replace(tmp, cached)  # atomic: concurrent loaders never read half a folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # read-only home, or another process won the race
    return hf
