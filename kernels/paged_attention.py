"""Paged attention over a mixed batch (decode tokens and prefill chunks): the pure-torch reference.

The CPU serving path and the oracle for paged_attention_triton.py. Each sequence's keys and
values are gathered through its block table into one padded batch, and a single call to
scaled_dot_product_attention does the work, so there is no Python loop over sequences. An int8 or
fp8 cache (kv_quant.py) is dequantized to float32 as it is gathered.
"""

import torch
import torch.nn.functional as F

from kernels.kv_quant import check_scales, dequantize, is_quantized


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """[num_blocks, bs, Hk, D] via tables[B, *] -> [B, Hk, max_seq_len, D] (a strided view); a
    quantized cache's blocks come out as float32, times their scales [num_blocks, Hk]."""
    block_size = cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    batch = block_tables.shape[0]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    # index_select copies whole blocks with memcpy; advanced indexing is about twice slower here.
    gathered = cache.index_select(0, ids)
    if is_quantized(cache):
        gathered = dequantize(gathered, scales.index_select(0, ids))
    gathered = gathered.view(batch, num_blocks * block_size, *cache.shape[2:])
    return gathered[:, :max_seq_len].transpose(1, 2)


def _decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, k_scales=None, v_scales=None):
    """One query per sequence, rows in batch order: q[B, Hq, D] -> [B, Hq, D]."""
    keys = _gather_context(k_cache, block_tables, max_seq_len, k_scales).to(q.dtype)
    values = _gather_context(v_cache, block_tables, max_seq_len, v_scales).to(q.dtype)
    key_pos = torch.arange(max_seq_len, device=q.device)
    mask = (key_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    # The query heads sharing a KV head go in as that head's query rows ([B, Hk, group, D]): one
    # attention of `group` rows per KV head runs faster than `group` attentions of one row each.
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def _prefill(q, k_cache, v_cache, block_tables, seq_lens, q_lens, seq_of_token, max_query_len, max_seq_len, scale,
             k_scales=None, v_scales=None):
    """Query chunks of several tokens: q[T, Hq, D], token t in sequence seq_of_token[t]."""
    device = q.device
    batch = seq_lens.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    starts = torch.cumsum(q_lens, 0) - q_lens
    row_of_token = torch.arange(num_tokens, device=device) - starts[seq_of_token]
    # Scatter queries into [B, max_query_len] slots.
    padded_q = q.new_zeros(batch, max_query_len, num_q_heads, head_dim)
    padded_q[seq_of_token, row_of_token] = q
    keys = _gather_context(k_cache, block_tables, max_seq_len, k_scales).to(q.dtype)
    values = _gather_context(v_cache, block_tables, max_seq_len, v_scales).to(q.dtype)
    key_pos = torch.arange(max_seq_len, device=device)
    # Query row i of sequence b sits at absolute position seq_len_b - q_len_b + i.
    query_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_query_len, device=device)[None, :]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < seq_lens[:, None, None])
    # Padding rows must see at least one key, or softmax gives NaN (they are dropped anyway).
    mask[:, :, 0] = True
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
        enable_gqa=num_q_heads != keys.shape[1],
    )  # [B, Hq, Lq, D]
    return out.transpose(1, 2)[seq_of_token, row_of_token]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q[T, Hq, D] -> out[T, Hq, D]; see the kernels contract for the batch layout. k_scales and
    v_scales [num_blocks, Hk] go with an int8 or fp8 cache.

    Decodes and prefill chunks are computed apart: padding every sequence of a mixed batch to
    the longest chunk would multiply the work of each decode by that chunk's length.
    """
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_scales(k_cache, v_cache, k_scales, v_scales)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return q.new_empty(q.shape)
    device = q.device
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    if max_query_len == 1 and num_tokens == batch:
        return _decode(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, k_scales, v_scales)

    starts = query_start_loc.to(device=device, dtype=torch.long)
    q_lens = starts[1:] - starts[:-1]
    is_decode = q_lens == 1
    decodes = is_decode.nonzero().squeeze(1)
    chunks = (~is_decode).nonzero().squeeze(1)
    if decodes.numel() == 0:
        seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
        return _prefill(q, k_cache, v_cache, block_tables, seq_lens, q_lens, seq_of_token,
                        max_query_len, max_seq_len, scale, k_scales, v_scales)

    out = torch.empty_like(q)
    # Sizes of each part, so neither gathers keys up to the other's longest sequence.
    dec_rows, dec_lens = starts[decodes], seq_lens[decodes]
    out[dec_rows] = _decode(q[dec_rows], k_cache, v_cache, block_tables[decodes], dec_lens,
                            int(dec_lens.max()), scale, k_scales, v_scales)
    if chunks.numel():
        chunk_q_lens, chunk_lens = q_lens[chunks], seq_lens[chunks]
        seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
        chunk_rows = (~is_decode[seq_of_token]).nonzero().squeeze(1)
        # Renumber the chunked sequences 0..len(chunks)-1 for the sub-batch.
        sub_index = torch.cumsum(~is_decode, 0) - 1
        out[chunk_rows] = _prefill(
            q[chunk_rows], k_cache, v_cache, block_tables[chunks], chunk_lens, chunk_q_lens,
            sub_index[seq_of_token[chunk_rows]], int(chunk_q_lens.max()), int(chunk_lens.max()), scale,
            k_scales, v_scales,
        )
    return out
