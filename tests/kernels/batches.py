"""Random paged-attention batches for the kernel tests, and a slow but obvious oracle."""

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self):
        return (
            self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, self.max_query_len, self.max_seq_len, self.scale,
        )


def make_batch(
    shapes: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    extra_blocks: int = 3,
    seed: int = 0,
    device: str = "cpu",
) -> PagedBatch:
    """shapes: (q_len, seq_len) per sequence; blocks are shuffled so tables are not identity."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(s + block_size - 1) // block_size for _, s in shapes]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq)
    # Unused table entries hold a wrong-but-valid block id so a kernel reading past the
    # sequence end would pick up garbage instead of silently reading zeros.
    tables = torch.full((len(shapes), max_blocks), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    total = sum(q for q, _ in shapes)
    q = torch.randn((total, num_q_heads, head_dim), generator=gen).to(dtype)
    starts = [0]
    for q_len, _ in shapes:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q for q, _ in shapes), max_seq_len=max(s for _, s in shapes),
        scale=head_dim ** -0.5,
    )


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """Per-sequence, per-head float64 attention read token by token through the block table."""
    q = batch.q.double()
    out = torch.empty_like(q)
    block_size = batch.k_cache.shape[1]
    group = q.shape[1] // batch.k_cache.shape[2]
    for b in range(batch.seq_lens.shape[0]):
        start, end = int(batch.query_start_loc[b]), int(batch.query_start_loc[b + 1])
        seq_len = int(batch.seq_lens[b])
        slots = [(int(batch.block_tables[b, p // block_size]), p % block_size) for p in range(seq_len)]
        keys = torch.stack([batch.k_cache[blk, off] for blk, off in slots]).double()  # [S, Hk, D]
        values = torch.stack([batch.v_cache[blk, off] for blk, off in slots]).double()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        for i in range(end - start):
            pos = seq_len - (end - start) + i
            scores = torch.einsum("hd,shd->hs", q[start + i], keys[: pos + 1]) * batch.scale
            out[start + i] = torch.einsum("hs,shd->hd", scores.softmax(-1), values[: pos + 1])
    return out
