"""Reads a GGUF file (llama, qwen2): metadata into a ModelConfig, tensors dequantized on demand, or
handed over in their stored blocks for the quantized kernels.

Tensors are exposed under Hugging Face names so one model class serves both formats. llama.cpp
permutes the rows of Q and K for its interleaved RoPE on llama; we undo that to get the neox layout.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from actors.worker.dequant import dequantize
from actors.model.gguf_file import GGUFFile
from actors.model.config import ModelConfig, ModelLoadError
from kernels.quant_linear import QuantTensor, supported

_FLOATS = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_TORCH_FLOATS = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                 GGMLQuantizationType.BF16: torch.bfloat16}

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _gguf_name(hf_name: str) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


class GGUFWeights:
    """Opens one GGUF file; `config` is its ModelConfig, `get` dequantizes one tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = GGUFFile(path)
        except Exception as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from None
        self._tensors = self._file.tensors
        config = ModelConfig.from_gguf(self._file.metadata, set(self._tensors))
        if "rope_freqs.weight" in self._tensors:
            factors = self._array("rope_freqs.weight").reshape(-1)
            config = dataclasses.replace(config, rope_freq_factors=tuple(float(x) for x in factors))
        self.config = config

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        gname = self._stored_name(name)
        array = self._unpermuted(gname, self._array(gname))
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, order="C")  # F32 tensors come as read-only views of the mmap
        return torch.from_numpy(array).to(dtype)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        """The float type the file stores the tensor in; None for a quantized one."""
        return _TORCH_FLOATS.get(GGMLQuantizationType(self._tensors[self._stored_name(name)].qtype))

    def quantized(self, name: str) -> QuantTensor | None:
        """The tensor's stored blocks (rows in the model's order) where a quantized kernel reads its
        type; None for float tensors and types that are only dequantized."""
        gname = self._stored_name(name)
        info = self._tensors[gname]
        if not supported(info.qtype) or len(info.shape) != 2:
            return None
        raw = self._unpermuted(gname, self._file.raw(gname))
        return QuantTensor(info.qtype, torch.from_numpy(np.array(raw, order="C")), info.shape[1])

    def dequantized_types(self) -> dict[str, int]:
        """The quantized types of the file's matrices that no kernel reads in their blocks, with their bytes in
        the file: those matrices load dequantized even where the others stay packed."""
        unread: dict[str, int] = {}
        for name, info in self._tensors.items():
            qtype = GGMLQuantizationType(info.qtype)
            if len(info.shape) == 2 and qtype not in _FLOATS and not supported(qtype):
                unread[qtype.name] = unread.get(qtype.name, 0) + self._file.nbytes(name)
        return unread

    def tensor_bytes(self) -> int:
        """What the file's tensors take, as stored: the measure resident weights are held to."""
        return sum(self._file.nbytes(name) for name in self._tensors)

    def _stored_name(self, name: str) -> str:
        gname = _gguf_name(name)
        if gname is None or gname not in self._tensors:
            raise ModelLoadError(f"GGUF file {self.path} lacks the tensor {gname or name!r} (for {name})")
        return gname

    def _unpermuted(self, gname: str, array: np.ndarray) -> np.ndarray:
        """Rows as the model reads them: llama's Q and K rows (whole rows, dequantized or stored) back in neox order."""
        if self.config.family == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config.num_heads if "attn_q" in gname else self.config.num_kv_heads
            array = _unpermute_rows(array, heads)
        return array

    def _array(self, gname: str) -> np.ndarray:
        return dequantize(self._file.raw(gname), GGMLQuantizationType(self._tensors[gname].qtype))

    def close(self) -> None:
        self._tensors = {}
        self._file = None  # drops the memory map once the last tensor view is gone


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp interleaved each head's two rotary halves row by row; put the halves back in order.
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
