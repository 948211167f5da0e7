"""Dequantization of a GGUF tensor as the loader reads it, vectorised over the whole tensor.

gguf.quants.dequantize splits tensors into row groups and pays Python overhead per group; Q4_0, Q4_1
and Q8_0 go through kernels.quant_matmul.dequantize_gguf instead, Q4_K, Q5_K and Q6_K through
kernels.kquant.dequantize_raw (one pass each, the decoders the quantized kernels' references use),
plain floats are widened. Other types fall back to gguf's own
implementation, which stays the oracle in the tests.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from kernels import kquant
from kernels.quant_matmul import dequantize_gguf
from kernels.quantize import GGUF_BLOCK_BYTES, GGUFWeight


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """raw: the stored tensor (quantized: uint8 [..., row_bytes]) -> float32 [..., row_elements]."""
    qtype = Q(qtype)
    if qtype in (Q.F32, Q.F16):
        return np.asarray(raw, dtype=np.float32)
    if qtype not in GGUF_BLOCK_BYTES and qtype not in kquant.TYPES:
        return gguf_dequantize(raw, qtype)
    rows = torch.from_numpy(np.array(raw).reshape(-1, raw.shape[-1]))   # a copy: the file map is read-only
    floats = kquant.dequantize_raw(rows, qtype) if qtype in kquant.TYPES else dequantize_gguf(GGUFWeight(rows, qtype))
    return floats.numpy().reshape(*raw.shape[:-1], -1)
