"""Which part of the model each tensor-parallel rank holds (Megatron's split).

Query heads go with their KV head, so a rank's attention needs no other rank's cache: KV heads are split
across the ranks, or, where there are fewer KV heads than ranks, each rank holds one (replicated) and the
ranks that share it split its query heads. The MLP is split by intermediate rows (in whole 256- or
32-value blocks where it can, so quantized down projections split between blocks), and the embedding
and LM head by vocabulary. Pure arithmetic: no torch, no processes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.model.config import ModelConfig, ModelLoadError

# The quantized block widths, largest first: a split on one of them cuts no GGUF block (K-quants 256,
# the others 32) of a row-parallel weight's input.
_BLOCK_UNITS = (256, 32)


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    heads: range           # query heads this rank computes
    kv_heads: range        # KV heads it holds in its cache
    intermediate: range    # MLP rows (gate, up) and columns (down)
    vocab: range           # embedding and LM head rows

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as this rank's DecoderModel sees it: its heads, its MLP width, its vocabulary rows."""
        return dataclasses.replace(config, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.intermediate), vocab_size=len(self.vocab))


def plan_shards(config: ModelConfig, size: int) -> list[ShardPlan]:
    """Every rank's plan, rank 0 first; ModelLoadError for a model that cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be positive, got {size}")
    if size > config.num_heads:
        raise ModelLoadError(f"--tensor-parallel-size {size} exceeds the model's {config.num_heads} attention heads")
    heads, kv_heads = _attention_split(config.num_heads, config.num_kv_heads, size)
    unit = next((u for u in _BLOCK_UNITS if config.intermediate_size % u == 0
                 and config.intermediate_size // u >= size), 1)
    intermediate = split(config.intermediate_size, size, unit)
    vocab = split(config.vocab_size, size)
    return [ShardPlan(r, size, heads[r], kv_heads[r], intermediate[r], vocab[r]) for r in range(size)]


def split(n: int, size: int, unit: int = 1) -> list[range]:
    """[0, n) in `size` contiguous ranges of whole `unit`s, as even as they come (the first ones larger)."""
    units, extra = divmod(n // unit, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + (units + (r < extra)) * unit)
    bounds[-1] = n
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _attention_split(num_heads: int, num_kv: int, size: int) -> tuple[list[range], list[range]]:
    group = num_heads // num_kv   # query heads per KV head
    if num_kv >= size:
        kv = split(num_kv, size)
        return [range(r.start * group, r.stop * group) for r in kv], kv
    heads, kv = [], []
    for r in range(size):
        k = r * num_kv // size   # the KV head rank r holds; its sharers split its query heads
        sharers = [s for s in range(size) if s * num_kv // size == k]
        if len(sharers) > group:
            raise ModelLoadError(f"--tensor-parallel-size {size}: {len(sharers)} ranks would share KV head {k}, "
                                 f"which has only {group} query heads")
        part = split(group, len(sharers))[sharers.index(r)]
        heads.append(range(k * group + part.start, k * group + part.stop))
        kv.append(range(k, k + 1))
    return heads, kv
