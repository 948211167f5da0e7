"""Dequantization of the common GGUF block formats, vectorised over a whole tensor.

gguf.quants.dequantize splits tensors into row groups and pays Python overhead per group; for
Q4_0, Q4_1 and Q8_0 (and plain floats) one numpy pass is several times faster. Other types fall
back to gguf's own implementation, which stays the oracle in the tests.
"""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """raw: the stored tensor (quantized: uint8 [..., row_bytes]) -> float32 [..., row_elements]."""
    qtype = Q(qtype)
    if qtype in (Q.F32, Q.F16):
        return np.asarray(raw, dtype=np.float32)
    if qtype not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        return gguf_dequantize(raw, qtype)
    lead = raw.shape[:-1]
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    if qtype == Q.Q8_0:
        out = blocks[:, 2:].view(np.int8).astype(np.float32) * d
    elif qtype == Q.Q4_0:
        out = (_nibbles(blocks[:, 2:]) - 8.0) * d
    else:
        m = blocks[:, 2:4].view(np.float16).astype(np.float32)
        out = _nibbles(blocks[:, 4:]) * d + m
    return out.reshape(*lead, -1)
