"""One tensor-parallel rank's view of a checkpoint: each tensor cut to the rows or columns the rank holds.

Wraps HFWeights or GGUFWeights (the same get / quantized interface) so DecoderModel.load_weights loads a
shard exactly as it loads a whole model. Column-parallel weights (q, k, v, gate, up, the embedding and the
LM head) keep their rows of the rank's heads, MLP rows or vocabulary; row-parallel ones (o, down) their
columns. GGUF blocks are cut in their stored form: rows whole, columns on block boundaries (a cut inside a
block falls back to the tensor dequantized, said in the log).
"""
from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from actors.model.config import ModelConfig, ModelLoadError
from actors.worker.shard_plan import ShardPlan
from kernels.quant_linear import QuantTensor
from runtime import get_logger

log = get_logger(component="worker")


class ShardedWeights:
    def __init__(self, weights, plan: ShardPlan, config: ModelConfig) -> None:
        if hasattr(weights, "linear"):
            raise ModelLoadError(f"a {weights.method} checkpoint cannot be split across tensor-parallel ranks yet; "
                                 f"serve it with --tensor-parallel-size 1")
        self._weights, self.plan = weights, plan
        d = config.head_dim
        self._rows = {"q_proj": _scaled(plan.heads, d), "k_proj": _scaled(plan.kv_heads, d),
                      "v_proj": _scaled(plan.kv_heads, d), "gate_proj": plan.intermediate,
                      "up_proj": plan.intermediate, "embed_tokens": plan.vocab, "lm_head": plan.vocab}
        self._cols = {"o_proj": _scaled(plan.heads, d), "down_proj": plan.intermediate}

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self._weights.get(name, dtype)
        module, kind = _module(name)
        if module in self._rows:
            return t[_slice(self._rows[module])].contiguous()
        if module in self._cols and kind == "weight":
            return t[:, _slice(self._cols[module])].contiguous()
        if module == "o_proj" and kind == "bias" and self.plan.rank != 0:
            return torch.zeros_like(t)   # added once, by rank 0, before the all-reduce sums the ranks
        return t

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return self._weights.stored_dtype(name)

    def quantized(self, name: str) -> QuantTensor | None:
        q = self._weights.quantized(name)
        if q is None:
            return None
        module, _ = _module(name)
        if module in self._rows:
            return QuantTensor(q.qtype, q.raw[_slice(self._rows[module])].contiguous(), q.cols)
        if module in self._cols:
            return _columns(name, q, self._cols[module])
        return q

    def tensor_bytes(self) -> int:
        return self._weights.tensor_bytes()

    def dequantized_types(self) -> dict[str, int]:
        return self._weights.dequantized_types()

    def close(self) -> None:
        self._weights.close()


def _columns(name: str, q: QuantTensor, cols: range) -> QuantTensor | None:
    """The columns `cols` of each row, in whole stored blocks; None where a cut falls inside a block."""
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(q.qtype)]
    if cols.start % block or cols.stop % block:
        log.info("tensor-parallel shard cuts inside quantized blocks: dequantized", tensor=name,
                 columns=f"{cols.start}:{cols.stop}", block=block)
        return None
    return QuantTensor(q.qtype, q.raw[:, cols.start // block * block_bytes:cols.stop // block * block_bytes].contiguous(),
                       len(cols))


def _module(name: str) -> tuple[str, str]:
    """("q_proj", "weight") for "model.layers.3.self_attn.q_proj.weight"."""
    parts = name.split(".")
    return parts[-2], parts[-1]


def _scaled(r: range, factor: int) -> range:
    return range(r.start * factor, r.stop * factor)


def _slice(r: range) -> slice:
    return slice(r.start, r.stop)
