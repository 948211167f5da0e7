"""One forward step's input: per-sequence items, and their flattening into the kernel tensors.

The scheduler thinks in sequences (new tokens, tokens already cached, a block table); the kernels
want flat tensors. `flatten` does the conversion with numpy, without a Python loop per token; a
small batch of decodes (one token each) is flattened in plain Python instead: right after a forward
has streamed the weights through the caches, numpy's two dozen calls took 300-450 us on the 2-core
CPU where the list comprehensions took 90-280 (batches of 1-16; at 32 the two were even), and at
batch 1 that is a few percent of every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from actors.worker.lora_adapter import LoRAAdapter


@dataclass(slots=True)
class SequenceInput:
    token_ids: list[int]          # the new tokens to run this step (a prefill chunk, 1 decode token, or k+1)
    num_computed: int             # tokens of this sequence already in the KV cache (= first new position)
    block_table: list[int]        # physical block ids covering at least num_computed + len(token_ids)
    num_logits: int = 1           # trailing new positions that need logits: k+1 when verifying a draft,
                                  # 0 for a prefill chunk that does not reach the prompt's end
    pool: tuple[int, int] = (0, 0)   # new positions [a, b) whose hidden states an embedding pools
    adapter: LoRAAdapter | None = None   # the LoRA adapter its projections add (None: the base model)


@dataclass(slots=True)
class ForwardBatch:
    seqs: list[SequenceInput] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        return sum(s.num_logits for s in self.seqs)


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_tables: torch.Tensor     # [B, max_blocks] int32 (only the columns max_seq_len needs)
    logits_indices: torch.Tensor   # [num_logits] int64, rows of the flat batch whose logits are returned
    max_query_len: int
    max_seq_len: int
    # Rows of the flat batch whose hidden states (after the final norm) are returned for pooling.
    pool_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))


SMALL_DECODE_BATCH = 16  # up to this many decodes: flattened in Python (measured: see the module doc)


def flatten(batch: ForwardBatch, block_size: int, num_blocks: int, vocab_size: int) -> FlatBatch:
    """Validates and flattens; raises ValueError on a batch the KV cache cannot hold."""
    seqs = batch.seqs
    n = len(seqs)
    if 0 < n <= SMALL_DECODE_BATCH and all(len(s.token_ids) == 1 and s.num_logits == 1 and s.pool[0] == s.pool[1]
                                           for s in seqs):
        return _flatten_decodes(seqs, block_size, num_blocks, vocab_size)
    # One pass over the sequences for every per-sequence number (this runs every step).
    per_seq = np.fromiter(chain.from_iterable((len(s.token_ids), s.num_computed, s.num_logits, len(s.block_table))
                                              for s in seqs), np.int64, 4 * n).reshape(n, 4)
    q_lens, starts, n_logits, table_lens = per_seq.T
    seq_lens = starts + q_lens
    if n and (q_lens.min() < 1 or starts.min() < 0):
        raise ValueError("every sequence in a forward batch needs at least one new token and num_computed >= 0")
    if n and ((n_logits < 0) | (n_logits > q_lens)).any():
        raise ValueError("num_logits must be between 0 and the number of new tokens")
    if (table_lens * block_size < seq_lens).any():
        b = int(np.argmax(table_lens * block_size < seq_lens))
        raise ValueError(f"sequence {b}: block table of {table_lens[b]} blocks cannot hold {seq_lens[b]} tokens")

    query_start_loc = np.zeros(n + 1, np.int64)
    np.cumsum(q_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    max_seq_len = int(seq_lens.max()) if n else 0
    width = max(-(-max_seq_len // block_size), 1)
    block_tables = np.zeros((n, width), np.int64)
    used = np.minimum(table_lens, width)
    ids = np.fromiter(chain.from_iterable(s.block_table[:width] for s in seqs), np.int64, int(used.sum()))
    block_tables[np.arange(width) < used[:, None]] = ids  # row-major: fills each row's prefix in order
    if n and (block_tables.max() >= num_blocks or block_tables.min() < 0):
        raise ValueError(f"block id out of range [0, {num_blocks})")

    input_ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int64, num_tokens)
    if num_tokens and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise ValueError(f"token id out of range [0, {vocab_size})")
    seq_of_token = np.repeat(np.arange(n), q_lens)
    # Token j of sequence b sits at position num_computed_b + (j - query_start_b).
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], q_lens)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    ends = query_start_loc[1:]
    logits_indices = np.repeat(ends - n_logits, n_logits) + (
        np.arange(int(n_logits.sum())) - np.repeat(np.cumsum(n_logits) - n_logits, n_logits))
    pool_rows = []
    for b, (a, e) in ((b, s.pool) for b, s in enumerate(seqs) if s.pool[0] != s.pool[1]):
        if not 0 <= a < e <= q_lens[b]:
            raise ValueError("a sequence's pooled positions must lie among its new tokens")
        pool_rows.extend(range(int(query_start_loc[b]) + a, int(query_start_loc[b]) + e))
    pool_indices = torch.tensor(pool_rows, dtype=torch.int64)
    return FlatBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_tables=torch.from_numpy(block_tables.astype(np.int32)),
        logits_indices=torch.from_numpy(logits_indices.astype(np.int64)),
        max_query_len=int(q_lens.max()) if n else 0,
        max_seq_len=max_seq_len,
        pool_indices=pool_indices,
    )


def _flatten_decodes(seqs: list[SequenceInput], block_size: int, num_blocks: int, vocab_size: int) -> FlatBatch:
    """`flatten` for one new token per sequence, each with its logits: the same tensors, the same checks."""
    positions = [s.num_computed for s in seqs]
    if min(positions) < 0:
        raise ValueError("every sequence in a forward batch needs at least one new token and num_computed >= 0")
    for b, s in enumerate(seqs):
        if len(s.block_table) * block_size <= s.num_computed:
            raise ValueError(f"sequence {b}: block table of {len(s.block_table)} blocks cannot hold "
                             f"{s.num_computed + 1} tokens")
    max_seq_len = max(positions) + 1
    width = -(-max_seq_len // block_size)
    rows = [s.block_table[:width] for s in seqs]
    if min(min(r) for r in rows) < 0 or max(max(r) for r in rows) >= num_blocks:
        raise ValueError(f"block id out of range [0, {num_blocks})")
    input_ids = [s.token_ids[0] for s in seqs]
    if min(input_ids) < 0 or max(input_ids) >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size})")
    n = len(seqs)
    return FlatBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor([r[p // block_size] * block_size + p % block_size for r, p in zip(rows, positions)],
                                  dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32),
        logits_indices=torch.arange(n, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max_seq_len,
    )


class DecodeCursor:
    """A flattened batch of single decode tokens, moved on a step at a time in place: each sequence one
    position further, fed the token it sampled. A decode burst runs the same sequences step after step,
    and right after a forward (cold caches) flattening them anew costs ~100 us at batch 1, where writing
    four integers a sequence into the same tensors costs a few: the tensors are written through
    memoryviews, with no numpy or torch call per step."""

    __slots__ = ("flat", "tables", "block_size", "vocab_size", "_rows", "_ids", "_positions", "_seq_lens", "_slots")

    def __init__(self, flat: FlatBatch, tables: list[list[int]], block_size: int, vocab_size: int) -> None:
        self.flat, self.tables, self.block_size, self.vocab_size = flat, tables, block_size, vocab_size
        width = flat.block_tables.shape[1]
        self._rows = [t[:width] for t in tables]   # the block ids the flattened tables hold
        self._ids, self._positions, self._seq_lens, self._slots = (
            memoryview(t.numpy()) for t in (flat.input_ids, flat.positions, flat.seq_lens, flat.slot_mapping))

    @staticmethod
    def fits(flat: FlatBatch) -> bool:
        """Whether `flat` is one new token per sequence, each with its logits."""
        n = flat.seq_lens.shape[0]
        return flat.max_query_len == 1 and flat.input_ids.shape[0] == n == flat.logits_indices.shape[0]

    def batch(self, token_ids: list[int], adapters: list[LoRAAdapter | None] | None = None) -> ForwardBatch:
        """The next step as a ForwardBatch, for `flatten`, its sequences reading `adapters` (None: the base model)."""
        adapters = adapters or [None] * len(token_ids)
        return ForwardBatch([SequenceInput([t], p + 1, table, adapter=adapter)
                             for t, p, table, adapter in zip(token_ids, self._positions, self.tables, adapters)])

    def advance(self, token_ids: list[int]) -> bool:
        """Moves the batch one step on, fed `token_ids` (one per sequence, in batch order); ValueError for a
        token outside the vocabulary, as `flatten`. False, and nothing changed, when a sequence's next
        position lies past the blocks its flattened row holds: the next step is flattened anew (which
        adds the column, or refuses a table without room)."""
        if len(token_ids) != len(self.tables):
            raise ValueError(f"{len(token_ids)} tokens for a batch of {len(self.tables)} sequences")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        positions = self._positions
        bs = self.block_size
        if any(p + 1 >= len(row) * bs for p, row in zip(positions, self._rows)):
            return False
        ids, seq_lens, slots = self._ids, self._seq_lens, self._slots
        for b, (token, table) in enumerate(zip(token_ids, self._rows)):
            p = positions[b] + 1
            ids[b], positions[b], seq_lens[b] = token, p, p + 1
            slots[b] = table[p // bs] * bs + p % bs
        self.flat.max_seq_len = max(seq_lens)
        return True
