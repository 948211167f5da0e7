"""Reads a Hugging Face checkpoint folder's (possibly sharded) safetensors; its config.json is model_config's.

Tensors are read lazily by name, so only what the model asks for is loaded and converted.
Never imports transformers model classes.
"""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from actors.model.config import ModelLoadError, read_json

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFWeights:
    """Name -> tensor over the safetensors files of one folder (HF tensor names)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map", {})
            self._file_of = {name: os.path.join(folder, f) for name, f in weight_map.items()}
            for path in set(self._file_of.values()):
                if not os.path.isfile(path):
                    raise ModelLoadError(f"checkpoint shard listed in the index is missing: {path}")
        else:
            files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
            if not files:
                raise ModelLoadError(f"no *.safetensors weights in {folder}")
            self._file_of = {}
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        self._file_of[name] = path
        self._handles: dict[str, object] = {}

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._read(name, lambda handle: handle.get_tensor(name)).to(dtype)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The float type the checkpoint stores the tensor in (None for any other: an int4 pack, say)."""
        return _DTYPES.get(self._read(name, lambda handle: handle.get_slice(name).get_dtype()))

    def _read(self, name: str, read):
        path = self._file_of.get(name)
        if path is None:
            raise ModelLoadError(f"checkpoint {self.folder} lacks the tensor {name!r}")
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        try:
            return read(handle)
        except Exception as e:  # the index named it, the shard does not hold it
            raise ModelLoadError(f"checkpoint {path} lacks the tensor {name!r}: {e}") from None

    def quantized(self, name: str) -> None:
        """Safetensors hold no GGUF blocks: every tensor is read as floats."""
        return None

    def close(self) -> None:
        self._handles.clear()
