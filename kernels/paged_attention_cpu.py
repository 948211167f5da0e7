"""Paged attention on the CPU: paged_attention_cpu.c's launchers, for short query runs and for prefill chunks.

Decode tokens and short speculative verifications read their context in place through the block
table, in float32 or bfloat16, from a cache of the same dtype or an int8 or fp8 one (kv_quant.py); the reference (paged_attention.py) gathers a padded copy
of every sequence's context and runs SDPA over it, which took 40% of a SmolLM2 decode step at
batch 7 (0.6k-token contexts) on the reference 2-core AMD EPYC. Longer runs (prefill chunks) go to
the prefill kernel of the same file, which reads each key once for up to 48 query rows (SDPA on a
gathered float32 copy, what they ran before, took 2.5-4x its time on 256-512-token prompts), while
the short runs of the same batch stay in the decode kernel; other dtypes go to the reference. On a CPU
with AMX a bf16 prefill runs on its tiles (1.8-1.95x the AVX-512 BF16 path on SmolLM2's heads, on a Xeon:
bench/attention_cpu.py --prefill).
"""

from __future__ import annotations

import ctypes

import structlog
import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.kv_quant import check_scales, is_quantized
from kernels.paged_attention import paged_attention as reference_paged_attention

# Longer runs: the prefill kernel (or, for a head size it does not take, SDPA per chunk). SmolLM2's heads,
# 8 sequences, 200-1500 tokens of past, on a Zen 5: the decode kernel took 0.79-0.96x the prefill kernel's
# time at 5 new tokens (bf16 and float32), 0.91-1.07x at 6, 1.0-1.4x at 7 and 8, 2-3x at 16.
MAX_QUERY_LEN = {torch.float32: 5, torch.bfloat16: 5}
INVARIANT_QUERY_LEN = 1 << 30   # the batch-invariant table's: every run through the decode kernel
_CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1}   # paged_attention_cpu.c's kinds (2, 3: int8, fp8)
PREFILL_D_MULTIPLE, PREFILL_MAX_GROUP = 8, 24
# The decode kernel's prefetches go into L1 or L2 (paged_attention_cpu.c's `prefetch`): measured once per
# machine on a batch of decodes whose caches are twice the last-level cache, L2 kept where it wins by MARGIN.
# (On a 2-core Xeon with AMX the probe had L2 8-9% faster, and SmolLM2's bf16 decode attention at 32 x 320
# ran 5-8% faster with it, where a margin of 10% had kept L1.)
PREFETCH_LEVELS = {"l1": 1, "l2": 2}
MARGIN = 1.05
PROBE_HEADS, PROBE_KV_HEADS, PROBE_D, PROBE_BLOCK = 9, 3, 64, 16   # SmolLM2's heads
PROBE_BATCH, PROBE_CONTEXT = 32, 256


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q[T, Hq, D] -> out[T, Hq, D]; the kernels contract of paged_attention.py."""
    lib = cpu_native.library()
    check_scales(k_cache, v_cache, k_scales, v_scales)
    if not _kernels_take(lib, q, k_cache):
        return _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
                          scale, k_scales, v_scales)
    if not kernel_takes(q.dtype, max_query_len, q.shape[1], k_cache.shape[2], q.shape[2]):
        return _split(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales)
    return _kernel(lib, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales)


def invariant_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                              max_query_len: int, max_seq_len: int, scale: float, k_scales: torch.Tensor | None = None,
                              v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention for the batch-invariant kernels: every query run, however long, through the decode
    kernel, which computes each row alone (its keys from key 0, in parts of SEG keys), so a token's output is
    the same in a prefill chunk of any length, beside any other runs, and as a lone decode."""
    lib = cpu_native.library()
    if not _kernels_take(lib, q, k_cache):
        raise ValueError("batch-invariant attention needs the CPU C kernels and a float32 or bf16 query")
    check_scales(k_cache, v_cache, k_scales, v_scales)
    return _kernel(lib, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales,
                   short_max=INVARIANT_QUERY_LEN)


def _kernels_take(lib, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_attention_cpu.c reads these: built, a float32 or bf16 query on the CPU, a cache of its dtype
    or quantized."""
    return (lib is not None and q.dtype in _CACHE_KINDS and (k_cache.dtype == q.dtype or is_quantized(k_cache))
            and q.device.type == "cpu")


def _reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
               k_scales, v_scales) -> torch.Tensor:
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # torch's CPU SDPA runs float32 faster than bf16: SmolLM2's heads, 4 x 287-token chunks,
        # 6.5 ms a layer against 9.8 (the gathered context is widened as it is copied anyway).
        return reference_paged_attention(q.float(), k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                         max_query_len, max_seq_len, scale, k_scales, v_scales).to(torch.bfloat16)
    return reference_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     max_query_len, max_seq_len, scale, k_scales, v_scales)


def _split(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales) -> torch.Tensor:
    """A batch with prefill chunks of a shape the prefill kernel does not take: the short query runs
    through the decode kernel, SDPA on each chunk's own context (the reference would pad every chunk to
    the longest and gather every context to the longest sequence)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if len(starts) != len(lens) + 1 or block_tables.shape[0] != len(lens) or starts[-1] != q.shape[0]:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    limit = MAX_QUERY_LEN[q.dtype]
    short = [b for b in range(len(lens)) if starts[b + 1] - starts[b] <= limit]
    out = torch.empty_like(q)
    if short:
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in short])
        q_lens = torch.tensor([0] + [starts[b + 1] - starts[b] for b in short])
        picked = torch.tensor(short)
        out[rows] = _kernel(cpu_native.library(), q[rows], k_cache, v_cache, block_tables[picked], seq_lens[picked],
                            torch.cumsum(q_lens, 0).to(torch.int32), scale, k_scales, v_scales)
    for b in range(len(lens)):
        first, end = starts[b], starts[b + 1]
        if end - first <= limit:
            continue
        if is_quantized(k_cache):   # the reference dequantizes the blocks as it gathers them
            out[first:end] = _reference(q[first:end], k_cache, v_cache, block_tables[b:b + 1], seq_lens[b:b + 1],
                                        torch.tensor([0, end - first], dtype=torch.int32), end - first, lens[b],
                                        scale, k_scales, v_scales)
        else:
            out[first:end] = _chunk(q[first:end], k_cache, v_cache, block_tables[b], lens[b], scale)
    return out


def choose_prefetch(lib: ctypes.CDLL) -> str:
    """Sets where `lib`'s decode kernel prefetches, from the measurement kept beside it (taken now if
    there is none yet); returns the level's name."""
    try:
        ms = cpu_native.kept_measurement(".attention-prefetch.json", f"{torch.get_num_threads()} threads",
                                         lambda: measure_prefetch(lib), lib)
    except (MemoryError, RuntimeError, ValueError) as e:   # the kernels still serve, prefetching into L1
        structlog.get_logger().warning("paged attention prefetch not measured", into="l1", error=str(e))
        return "l1"
    level = prefetch_level(ms)
    lib.matinee_attention_prefetch_to(PREFETCH_LEVELS[level])
    structlog.get_logger().info("paged attention prefetch", into=level, ms=ms)
    return level


def prefetch_level(ms: dict[str, float]) -> str:
    """From `measure_prefetch`'s timings: L2 where it is faster by MARGIN, else L1 (the kernel's default)."""
    return "l2" if ms["l2"] * MARGIN < ms["l1"] else "l1"


def measure_prefetch(lib: ctypes.CDLL, repeats: int = 3) -> dict[str, float]:
    """Best-of ms of a decode step's attention over layers of float32 caches twice the last-level cache
    (scattered blocks, as a pool holds them), with the prefetches into L1 and into L2. Leaves the level
    as it found it."""
    blocks = PROBE_BATCH * PROBE_CONTEXT // PROBE_BLOCK
    layer_bytes = 2 * blocks * PROBE_BLOCK * PROBE_KV_HEADS * PROBE_D * 4
    layers = max(2, min(64, -(-2 * cpu_native.last_level_cache_bytes() // layer_bytes)))
    shape = (blocks, PROBE_BLOCK, PROBE_KV_HEADS, PROBE_D)
    caches = [(torch.empty(shape).uniform_(-1, 1), torch.empty(shape).uniform_(-1, 1)) for _ in range(layers)]
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(blocks, generator=gen).to(torch.int32).view(PROBE_BATCH, -1)
    q = torch.randn(PROBE_BATCH, PROBE_HEADS, PROBE_D, generator=gen)
    lens = torch.full((PROBE_BATCH,), PROBE_CONTEXT, dtype=torch.int32)
    starts = torch.arange(PROBE_BATCH + 1, dtype=torch.int32)

    def step(level: int):
        def run():
            lib.matinee_attention_prefetch_to(level)
            for k, v in caches:
                _kernel(lib, q, k, v, tables, lens, starts, PROBE_D ** -0.5, None, None)
        return run

    before = lib.matinee_attention_prefetch_to(0)
    try:
        return cpu_native.best_ms({name: step(level) for name, level in PREFETCH_LEVELS.items()}, repeats)
    finally:
        lib.matinee_attention_prefetch_to(before)


def kernel_takes(dtype: torch.dtype, max_query_len: int, num_q_heads: int, num_kv_heads: int,
                 head_dim: int) -> bool:
    """Whether matinee_paged_attention computes a whole step in these activations: runs longer than
    MAX_QUERY_LEN go to its prefill kernel, which takes only some head shapes (prefill_fits)."""
    return dtype in MAX_QUERY_LEN and (max_query_len <= MAX_QUERY_LEN[dtype]
                                       or prefill_fits(num_q_heads, num_kv_heads, head_dim))


def prefill_fits(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes the prefill kernel takes: D a multiple of 8, a group of at most 24 query heads per KV head
    (each KV head's keys are read in place once per 48, AVX2: 24, query rows, where SDPA on a gathered
    float32 copy ran at ~60 GFLOP/s: SmolLM2's heads, 256-token prompts)."""
    return head_dim % PREFILL_D_MULTIPLE == 0 and num_q_heads % num_kv_heads == 0 and \
        num_q_heads // num_kv_heads <= PREFILL_MAX_GROUP


def _chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
           scale: float) -> torch.Tensor:
    """One sequence's chunk q[n, Hq, D], the last n of its seq_len positions, in float32 SDPA (faster
    than bf16 on the CPU); a chunk that is the whole sequence (a fresh prompt) needs no mask."""
    n, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    ids = table[:(seq_len + block_size - 1) // block_size].long()
    if n > seq_len or ids.shape[0] * block_size < seq_len:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    if int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]:
        raise ValueError("paged_attention: a block id out of range")

    def context(cache: torch.Tensor) -> torch.Tensor:   # [1, Hk, seq_len, D], float32
        return cache.index_select(0, ids).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)[None].float()

    keys, values = context(k_cache), context(v_cache)
    query = q.transpose(0, 1)[None].float()
    mask = None
    if n != seq_len:   # query i sits at position seq_len - n + i
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=num_q_heads != num_kv_heads)
    return out[0].transpose(0, 1).to(q.dtype)


def _kernel(lib, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales,
            v_scales, short_max: int | None = None) -> torch.Tensor:
    """Every query run through paged_attention_cpu.c, reading the context in place: runs of at most
    MAX_QUERY_LEN tokens (decodes, verifications) through its decode kernel, longer ones (prefill chunks)
    through its prefill kernel, which reads each key once for up to 48 (AVX2: 24) query rows. In a step of
    4 fresh 256-token prompts and 24 decodes the reference took 15 ms a layer, the decodes 3 ms of it (0.5
    in the kernel); SDPA on each chunk's gathered float32 context took 2.5-4x the prefill kernel's time."""
    quantized = is_quantized(k_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if cache_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"K/V caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit queries "
                         f"of head_dim {head_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention needs contiguous K/V caches")
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if tables.shape[0] != batch or starts.shape[0] != batch + 1:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    # The kernel checks the rest of the metadata it follows (ranges, lengths, block ids) itself:
    # here that took ~30 small torch ops per layer, 4 ms of a 90 ms decode step.
    status = lib.matinee_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr() if quantized else None,
        v_scales.data_ptr() if quantized else None, tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
        out.data_ptr(), batch, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, tables.shape[1],
        k_cache.shape[0], scale, torch.get_num_threads(), int(q.dtype == torch.bfloat16), cache_kind(k_cache),
        MAX_QUERY_LEN[q.dtype] if short_max is None else short_max)
    _raise_for(status, q, k_cache)
    return out


def cache_kind(k_cache: torch.Tensor) -> int:
    """paged_attention_cpu.c's code for a cache's dtype."""
    if is_quantized(k_cache):
        return 3 if k_cache.dtype == torch.float8_e4m3fn else 2
    return _CACHE_KINDS[k_cache.dtype]


def _raise_for(status: int, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The error of a paged_attention_cpu.c status (0: none)."""
    if status == -2:
        raise ValueError("paged_attention: block tables, query_start_loc and seq_lens disagree")
    if status == -3:
        raise ValueError("paged_attention: a block id out of range")
    if status == -4:
        raise ValueError(f"paged_attention: the CPU kernels do not take q {tuple(q.shape)} {q.dtype} over "
                         f"a {k_cache.dtype} cache {tuple(k_cache.shape)}")
    if status != 0:
        raise MemoryError("paged_attention: no memory for a sequence's scratch")
