"""Decode steps replayed from CUDA graphs: one graph per batch size of a ladder, a batch padded up to the next.

A decode step of a small model on a GPU is bound by launches, not by the GPU: about a dozen kernels a
layer, each a few microseconds of Python and driver work for far less time on the device. A graph
captured once replays all of them in one call. Capture fixes every shape and pointer, and the forward
may not read device values on the host, so a decode batch is copied into static buffers sized for the
largest batch: a padded row has slot -1 (the KV writer skips it) and a context of one key; the block
table keeps every column the pool could need; and the attention's split count is chosen once, for the
longest context the pool holds (a split past a row's keys does no work). The padded rows' logits are
dropped. vLLM and SGLang pad to captured sizes the same way.

Only steps of decodes alone go through here: a prefill chunk or a speculative verify has other shapes,
and an int8 or fp8 KV cache's writer groups tokens by block on the host; those run eagerly.
"""
from __future__ import annotations

import torch

from actors.worker.forward_batch import FlatBatch
from actors.worker.model import AttentionMetadata, DecoderModel, LayerKV
from actors.worker.pinned_batch import PinnedBatch

# vLLM's ladder, shorter: every size up to 8, then steps of 8 to 64, then of 32.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_batch: int) -> list[int]:
    """The ladder below max_batch, and max_batch itself, so every batch the scheduler forms has a graph."""
    return [s for s in CAPTURE_SIZES if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: DecoderModel, kv_caches: list[LayerKV], max_batch: int, max_seq_len: int,
                 block_size: int, capture: bool = True) -> None:
        """capture=False runs the padded forward eagerly instead of replaying: what a test does without a GPU."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_seq_len = max_seq_len
        size, width = self.sizes[-1], -(-max_seq_len // block_size)
        dev = kv_caches[0][0].device
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(size, width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=dev)   # one token a sequence
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(size, model.config.vocab_size, dtype=torch.float32, device=dev)
        self._pinned = PinnedBatch(dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def fits(self, flat: FlatBatch, kv_caches: list[LayerKV]) -> bool:
        """A step of decodes alone, each with its logits, within the captured batch and context, on these caches."""
        n = flat.input_ids.shape[0]
        return (kv_caches is self.kv_caches and flat.max_query_len == 1 and 0 < n <= self.sizes[-1]
                and flat.seq_lens.shape[0] == n and flat.logits_indices.shape[0] == n
                and flat.max_seq_len <= self.max_seq_len)

    def run(self, flat: FlatBatch) -> torch.Tensor:
        """float32 logits [n, vocab] of a batch that fits; a copy, so the next replay cannot overwrite it."""
        n = flat.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self._load(flat, n, size)
        if self.graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.logits[:n].clone()

    def _load(self, flat: FlatBatch, n: int, size: int) -> None:
        width = flat.block_tables.shape[1]
        ids, positions, slots, seq_lens, tables = self._pinned.send(
            [flat.input_ids, flat.positions, flat.slot_mapping, flat.seq_lens, flat.block_tables])
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slots)
        self.seq_lens[:n].copy_(seq_lens)
        # Columns past `width` keep an earlier step's block ids: valid ids, never read below a row's length.
        self.block_tables[:n, :width].copy_(tables)
        if n < size:   # rows an earlier, larger batch used: back to padding
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)

    def _forward(self, size: int) -> None:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
                                 seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 max_query_len=1, max_seq_len=self.max_seq_len)
        with torch.inference_mode():
            logits = self.model.forward(self.input_ids[:size], self.positions[:size], meta, self.kv_caches,
                                        self.logits_indices[:size])
            self.logits[:size].copy_(logits)

    def _capture(self) -> None:
        """Largest first, all in one memory pool: a smaller graph's buffers reuse the larger ones'."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)   # compiles the kernels outside the capture; every row is padding, nothing written
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
