"""Reads an AWQ int4 checkpoint (AutoAWQ's GEMM layout, `quantization_config` with quant_method "awq")
into Int4Weight.

AWQ stores each projection `p` as three tensors, for K inputs, N outputs and groups of G inputs:
- p.qweight int32 [K, N // 8]: the 4-bit values of outputs 8i..8i+7 for input k in word [k, i], output
  8i + PACK_ORDER[j] in bits 4j..4j+3 (AutoAWQ's interleaving, which vLLM's kernels undo the same way);
- p.qzeros int32 [K // G, N // 8]: the zero points, packed the same way (stored as they are);
- p.scales float16 [K // G, N].
w[n, k] = (q[k, n] - zero[k // G, n]) * scale[k // G, n]: Int4Weight's math, so the conversion only
transposes, reorders and repacks (bit-exact). Every other tensor reads as HFWeights gives it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from actors.worker.gptq_weights import unpack_words
from actors.worker.hf_weights import HFWeights
from actors.model.config import ModelLoadError, read_json
from kernels.quantize import Int4Weight, pack_nibbles

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # nibble j of a word holds output 8i + PACK_ORDER[j]
_OUTPUT_ORDER = torch.tensor([PACK_ORDER.index(c) for c in range(8)])   # output c sits in nibble _OUTPUT_ORDER[c]


@dataclass(frozen=True)
class AWQConfig:
    group_size: int

    @classmethod
    def from_folder(cls, folder: str) -> AWQConfig | None:
        """The checkpoint's AWQ settings, None when config.json has no AWQ `quantization_config`."""
        config = read_json(os.path.join(folder, "config.json")).get("quantization_config")
        if config is None or config.get("quant_method") != "awq":
            return None
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ModelLoadError(f"AWQ checkpoints of {bits} bits are not supported, only 4")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group_size, int) or group_size <= 0:
            raise ModelLoadError(f"AWQ group_size must be a positive integer, not {group_size!r}")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"AWQ version {version!r} is not supported (gemm)")
        if config.get("zero_point", True) is not True:
            raise ModelLoadError("AWQ checkpoints without zero points are not supported")
        return cls(group_size)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
                name: str = "projection") -> Int4Weight:
    """One projection's AWQ tensors -> Int4Weight ([N, K], groups along K)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % group or qzeros.shape != (k // group, n // 8) or scales.shape != (k // group, n):
        raise ModelLoadError(f"AWQ tensors of {name} do not fit together: qweight {tuple(qweight.shape)}, "
                             f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group size {group}")
    q = unpack_words(qweight)[..., _OUTPUT_ORDER].reshape(k, n)          # [K, N // 8, 8] -> [K, N]
    zero = unpack_words(qzeros)[..., _OUTPUT_ORDER].reshape(k // group, n)
    return Int4Weight(pack_nibbles(q.t()), scales.t().to(torch.float16).contiguous(),
                      zero.t().to(torch.uint8).contiguous(), group)


class AWQWeights(HFWeights):
    """An AWQ checkpoint folder: `linear(prefix)` converts one projection; `get` reads the rest."""

    method = "AWQ"

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        config = AWQConfig.from_folder(folder)
        if config is None:
            raise ModelLoadError(f"{folder}/config.json has no AWQ quantization_config: not an AWQ checkpoint")
        self.config = config

    def is_quantized(self, prefix: str) -> bool:
        return f"{prefix}.qweight" in self.names()

    def linear(self, prefix: str) -> Int4Weight:
        """The projection `prefix` (e.g. "model.layers.0.self_attn.q_proj") as an Int4Weight."""
        qweight, qzeros = (self.get(f"{prefix}.{part}", torch.int32) for part in ("qweight", "qzeros"))
        return awq_to_int4(qweight, qzeros, self.get(f"{prefix}.scales", torch.float16), self.config.group_size,
                           prefix)
