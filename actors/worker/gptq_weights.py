"""Reads a GPTQ int4 checkpoint (safetensors with `quantization_config` in config.json) into Int4Weight.

GPTQ stores each projection `p` as four tensors (AutoGPTQ's layout, read the same way by
transformers and vLLM), for K inputs, N outputs and groups of G inputs:
- p.qweight int32 [K // 8, N]: input 8i + j of output n in bits 4j..4j+3 of qweight[i, n];
- p.qzeros int32 [K // G, N // 8]: the zero point of output 8i + j in bits 4j.. of qzeros[g, i],
  stored minus one in the original format (checkpoint_format "gptq"), as is in "gptq_v2";
- p.scales float16 [K // G, N];
- p.g_idx int32 [K]: the group of each input, k // G unless quantized in activation order.
w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]: Int4Weight's math, so the
conversion only transposes and repacks (bit-exact). Quantized in activation order (desc_act), a group's
inputs lie anywhere: they are sorted by group (stably) into Int4Weight's columns, and its `order` makes
every matmul read x in that order, as vLLM's GPTQ kernels permute their input. Every other tensor reads
as HFWeights gives it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from actors.worker.hf_weights import HFWeights
from actors.model.config import ModelLoadError, read_json
from kernels.quantize import Int4Weight, pack_nibbles

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)   # nibble j of an int32 sits at bit 4j


@dataclass(frozen=True)
class GPTQConfig:
    group_size: int     # -1: one group over all inputs
    zero_offset: int    # added to each stored zero point: 1 in the original format, 0 in v2

    @classmethod
    def from_folder(cls, folder: str) -> GPTQConfig | None:
        """The checkpoint's GPTQ settings, None when config.json has no `quantization_config`."""
        config = read_json(os.path.join(folder, "config.json")).get("quantization_config")
        if config is None:
            return None
        method = config.get("quant_method")
        if method != "gptq":
            raise ModelLoadError(f"quantization method {method!r} is not supported; GPTQ and AWQ int4 checkpoints are")
        if config.get("bits") != 4:
            raise ModelLoadError(f"GPTQ checkpoints of {config.get('bits')} bits are not supported, only 4")
        group_size = config.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
            raise ModelLoadError(f"GPTQ group_size must be a positive integer or -1, not {group_size!r}")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return cls(group_size, 1 if fmt == "gptq" else 0)


def unpack_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 8], nibble j of each word at index j."""
    return (packed[..., None] >> _SHIFTS) & 0xF


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 config: GPTQConfig, name: str = "projection") -> Int4Weight:
    """One projection's GPTQ tensors -> Int4Weight ([N, K], groups along K)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = k if config.group_size == -1 else config.group_size
    groups = k // group
    if k % group or qzeros.shape != (groups, n // 8) or scales.shape != (groups, n) or n % 8:
        raise ModelLoadError(f"GPTQ tensors of {name} do not fit together: qweight {tuple(qweight.shape)}, "
                             f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group size {group}")
    q = unpack_words(qweight).transpose(1, 2).reshape(k, n)          # [K // 8, 8, N] -> [K, N]
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        g_idx = g_idx.long()
        if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= groups or \
                not bool((torch.bincount(g_idx, minlength=groups) == group).all()):
            raise ModelLoadError(f"GPTQ g_idx of {name} does not put {group} inputs in each of {groups} groups")
        order = torch.sort(g_idx, stable=True).indices          # activation order: each group's inputs together
        q = q[order]
    zero = unpack_words(qzeros).reshape(groups, n) + config.zero_offset
    return Int4Weight(pack_nibbles(q.t()), scales.t().to(torch.float16).contiguous(),
                      zero.t().to(torch.uint8).contiguous(), group, order)


class GPTQWeights(HFWeights):
    """A GPTQ checkpoint folder: `linear(prefix)` converts one projection; `get` reads the rest."""

    method = "GPTQ"

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        config = GPTQConfig.from_folder(folder)
        if config is None:
            raise ModelLoadError(f"{folder}/config.json has no quantization_config: not a GPTQ checkpoint")
        self.config = config

    def is_quantized(self, prefix: str) -> bool:
        return f"{prefix}.qweight" in self.names()

    def linear(self, prefix: str) -> Int4Weight:
        """The projection `prefix` (e.g. "model.layers.0.self_attn.q_proj") as an Int4Weight."""
        tensors = [self.get(f"{prefix}.{part}", torch.int32) for part in ("qweight", "qzeros")]
        scales = self.get(f"{prefix}.scales", torch.float16)
        g_idx = self.get(f"{prefix}.g_idx", torch.int32) if f"{prefix}.g_idx" in self.names() else None
        return gptq_to_int4(*tensors, scales, g_idx, self.config, prefix)
