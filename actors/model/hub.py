"""Model names users type: a Hugging Face hub id (`Qwen/Qwen2.5-0.5B-Instruct`) resolves to its
snapshot folder in huggingface_hub's cache, downloaded when the network allows it, as vLLM does.

Offline (HF_HUB_OFFLINE=1) or without a network, a cached snapshot is served as it is; a model that
is not cached fails with one line saying what to download and where.
"""
from __future__ import annotations

import os
import re

from actors.model.config import ModelLoadError

# `org/name`: what the hub's ids look like, and what no relative path a user meant would look like
# once it does not exist on disk.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")
# What Matinee loads from a hub repo: the config, safetensors weights, the tokenizer and its
# template. Not .bin/.pt checkpoints nor every GGUF quantization a repo may hold.
WEIGHT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


def local_model_path(model: str, files: list[str] = WEIGHT_FILES) -> str:
    """`model` itself when it exists on disk, else the local snapshot of the hub repo it names."""
    if os.path.exists(os.path.expanduser(model)) or not is_hub_id(model):
        return model
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(model, allow_patterns=files)
    except Exception as e:   # offline, unreachable, no such repo, gated: all end the same way
        raise ModelLoadError(
            f"model {model!r} is not a local path, nor in the Hugging Face cache at "
            f"{constants.HF_HUB_CACHE}, and cannot be downloaded ({_why(e)}): download it there "
            f"with `hf download {model}` (HF_HUB_CACHE={constants.HF_HUB_CACHE}) where the network "
            f"reaches the hub, or give a local folder") from None


def _why(e: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if isinstance(e, GatedRepoError):
        return "the repo is gated: set HF_TOKEN to a token that may read it"
    if isinstance(e, RepositoryNotFoundError):
        return "the hub has no such repo, or it is private"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no reason given'}"
