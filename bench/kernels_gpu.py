"""GPU benchmark of the Triton kernels: correctness at real sizes, decode attention against the
copy-bandwidth ceiling and torch SDPA, and whole-model decode steps against their memory floor.

`python -m bench.kernels_gpu [--json out.json]` on a CUDA machine (a few minutes);
`python -m bench.kernels_gpu --dry-run` runs every section at toy sizes on the CPU under
Triton's interpreter, to check the script itself. The last line printed is the JSON summary.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# (batch, context) grid and head layout of the decode-attention section.
ATTENTION_GRID = [(1, 32768), (16, 4096), (64, 2048), (256, 1024)]
ATTENTION_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
MODEL_BATCHES = [1, 16, 64]
MODEL_CONTEXT = 1024
BLOCK_SIZE = 16

MODELS = {
    # SmolLM2-135M's shape (Llama family, tied embeddings).
    "smollm2-135m": dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
                         attention_bias=False),
    # Qwen2.5-1.5B's shape (q/k/v biases, tied embeddings).
    "qwen2.5-1.5b": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True,
                         attention_bias=True),
}
TINY_MODEL = dict(family="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=False)


class Timer:
    """Milliseconds per call. On the GPU, the device's own time: CUDA events around a CUDA graph of many
    calls (triton's do_bench_cudagraph), so Python's launch overhead, tens of microseconds a Triton launch,
    is not counted; `launches=True` counts it (events around plain calls, after an L2 flush), as an eager
    forward pays it. Wall clock on the CPU."""

    def __init__(self, device: torch.device, dry_run: bool) -> None:
        self.device = device
        self.dry_run = dry_run

    def __call__(self, fn, launches: bool = False) -> float:
        if self.device.type == "cuda":
            import triton.testing

            if launches:
                return float(triton.testing.do_bench(fn, warmup=25, rep=100))
            return float(triton.testing.do_bench_cudagraph(fn, rep=20))
        if not self.dry_run:
            fn()  # warm-up
        start = time.perf_counter()
        reps = 1 if self.dry_run else 5
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1000 / reps


def _paged_batch(batch, context, num_q_heads, num_kv_heads, head_dim, dtype, device, q_len=1, seed=0):
    """A decode (q_len 1) or prefill-chunk batch over shuffled blocks; every sequence `context` long."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device)[: batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    q = torch.randn(batch * q_len, num_q_heads, head_dim, generator=gen, device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, tables, seq_lens, starts, q_len, context, head_dim ** -0.5)


def _error(actual, expected) -> float:
    """Largest |actual - expected| / (1 + |expected|): absolute near zero, relative on large values."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs() / (1 + expected.abs())).max().item()


def check_correctness(ops, ref, device, dtype, dry_run):
    """Error of every kernel against its torch reference (see _error); attention's reference runs in float32."""
    T, H, I = (9, 64, 96) if dry_run else (4096, 4096, 11008)
    hq, hk, d = (4, 2, 64) if dry_run else (32, 8, 128)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    errors = {}
    x, res, w = rand(T, H), rand(T, H), rand(H)
    errors["rms_norm"] = _error(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    y, r = ops.fused_add_rms_norm(x, res, w, 1e-6)
    ry, rr = ref.fused_add_rms_norm(x, res, w, 1e-6)
    errors["fused_add_rms_norm"] = max(_error(y, ry), _error(r, rr))
    gate_up = rand(T, 2 * I)
    errors["silu_and_mul"] = _error(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))

    from kernels import build_cos_sin_cache

    cache = build_cos_sin_cache(d, 8192, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 2048}).to(device)
    positions = torch.randint(0, 8192, (T,), generator=gen, device=device)
    q, k = rand(T, hq, d), rand(T, hk, d)
    oq, ok = ops.rotary_embedding(positions, q, k, cache)
    rq, rk = ref.rotary_embedding(positions, q, k, cache)
    errors["rotary_embedding"] = max(_error(oq, rq), _error(ok, rk))

    num_blocks = 8 if dry_run else 4096
    kc = torch.zeros(num_blocks, BLOCK_SIZE, hk, d, device=device, dtype=dtype)
    vc, rkc, rvc = kc.clone(), kc.clone(), kc.clone()
    n = min(T, num_blocks * BLOCK_SIZE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:n]
    kv = rand(n, hk, d)
    ops.write_kv(kv, kv * 2, kc, vc, slots)
    ref.write_kv(kv, kv * 2, rkc, rvc, slots)
    errors["write_kv"] = max(_error(kc, rkc), _error(vc, rvc))

    # Attention: a mixed batch of decodes and prefill chunks over cached prefixes.
    decode = _paged_batch(2 if dry_run else 16, 40 if dry_run else 4000, hq, hk, d, dtype, device)
    chunk = _paged_batch(1, 50 if dry_run else 1500, hq, hk, d, dtype, device, q_len=7 if dry_run else 512, seed=1)
    args = _concat_batches(decode, chunk)
    out = ops.paged_attention(*args)
    expected = ref.paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    errors["paged_attention"] = _error(out, expected)
    # A long single decode, forced through the split-KV path.
    split_args = _paged_batch(1, 200 if dry_run else 32768, hq, hk, d, dtype, device, seed=2)
    out = ops.paged_attention(*split_args, num_splits=4)
    expected = ref.paged_attention(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                     for a in split_args])
    errors["paged_attention_split_kv"] = _error(out, expected)
    return errors


def _concat_batches(a, b):
    """Two _paged_batch tuples over separate caches -> one mixed batch over one cache."""
    qa, ka, va, ta, sa, qsa, mqa, msa, scale = a
    qb, kb, vb, tb, sb, qsb, mqb, msb, _ = b
    width = max(ta.shape[1], tb.shape[1])
    tables = torch.zeros(ta.shape[0] + tb.shape[0], width, dtype=torch.int32, device=ta.device)
    tables[: ta.shape[0], : ta.shape[1]] = ta
    tables[ta.shape[0]:, : tb.shape[1]] = tb + ka.shape[0]
    starts = torch.cat([qsa, qsb[1:] + qsa[-1]])
    return (torch.cat([qa, qb]), torch.cat([ka, kb]), torch.cat([va, vb]), tables, torch.cat([sa, sb]),
            starts, max(mqa, mqb), max(msa, msb), scale)


def copy_bandwidth(device, timer, dry_run) -> float:
    """Device-to-device copy, bytes read + written per second: the ceiling for memory-bound kernels."""
    numel = (1 << 20) if dry_run else (1 << 30)
    src = torch.empty(numel, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Timed as plain calls: in a CUDA graph the copy becomes a memcpy node on the copy engines, which
    # measured 2.77 TB/s on an H200 where the copy kernel moves 4.25.
    ms = timer(lambda: dst.copy_(src), launches=True)
    return 2 * numel / (ms / 1000)


def attention_grid(ops, device, dtype, timer, ceiling, dry_run):
    from kernels.paged_attention_triton import choose_num_splits

    grid = [(1, 256), (4, 64)] if dry_run else ATTENTION_GRID
    heads = dict(num_q_heads=8, num_kv_heads=2, head_dim=64) if dry_run else ATTENTION_HEADS
    rows = []
    for batch, context in grid:
        args = _paged_batch(batch, context, **heads, dtype=dtype, device=device)
        q, k_cache, v_cache, tables = args[:4]
        kv_bytes = 2 * batch * context * heads["num_kv_heads"] * heads["head_dim"] * k_cache.element_size()
        io_bytes = kv_bytes + 2 * q.numel() * q.element_size()
        triton_ms = timer(lambda: ops.paged_attention(*args))
        splits = choose_num_splits(batch, heads["num_kv_heads"], 1, context, 64, device)
        # Every split count, to check the heuristic's choice against the best.
        by_splits = {s: timer(lambda: ops.paged_attention(*args, num_splits=s)) for s in (1, 2, 4, 8, 16, 32, 64)
                     if context // s >= 64}
        # SDPA on the same keys and values, laid out contiguously per sequence (its best case).
        keys = k_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        values = v_cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        query = q.view(batch, 1, heads["num_q_heads"], heads["head_dim"]).transpose(1, 2)
        sdpa_ms = timer(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True))
        rows.append(dict(batch=batch, context=context, num_splits=splits, triton_ms=triton_ms, sdpa_ms=sdpa_ms,
                         ms_by_splits=by_splits,
                         triton_bw_frac=io_bytes / (triton_ms / 1000) / ceiling,
                         sdpa_bw_frac=io_bytes / (sdpa_ms / 1000) / ceiling,
                         speedup_vs_sdpa=sdpa_ms / triton_ms))
        del keys, values
    return rows


class RandomWeights:
    """Stands in for a checkpoint: every tensor the model asks for, random, made on the device."""

    def __init__(self, config, device):
        self.config = config
        self.device = device
        self.bytes = 0

    def get(self, name, dtype):
        cfg = self.config
        q, kv, h, inter = cfg.q_size, cfg.kv_size, cfg.hidden_size, cfg.intermediate_size
        shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                  "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        part = name.split(".")[-2]
        if name.endswith("norm.weight") or part.endswith("norm"):
            shape = (cfg.head_dim,) if part in ("q_norm", "k_norm") else (h,)
            t = 1.0 + 0.1 * torch.randn(shape, device=self.device)
        elif name.endswith("bias"):
            t = 0.02 * torch.randn(shapes[part][0], device=self.device)
        elif part in shapes:
            t = torch.randn(shapes[part], device=self.device) * shapes[part][1] ** -0.5
        else:  # embed_tokens / lm_head
            t = 0.02 * torch.randn(cfg.vocab_size, h, device=self.device)
        t = t.to(dtype)
        self.bytes += t.numel() * t.element_size()
        return t

    def close(self):
        pass


def model_steps(ops, device, dtype, timer, ceiling, dry_run):
    from actors.worker.model import AttentionMetadata, DecoderModel
    from actors.model.config import ModelConfig

    models = {"tiny": TINY_MODEL} if dry_run else MODELS
    batches = [1, 2] if dry_run else MODEL_BATCHES
    context = 40 if dry_run else MODEL_CONTEXT
    rows = []
    for label, shape in models.items():
        config = ModelConfig(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=context + 16,
                             qk_norm=False, **shape)
        weights = RandomWeights(config, device)
        model = DecoderModel(config, ops, dtype, device)
        model.load_weights(weights, label=label)
        # Decode reads every weight but the embedding table (only B rows), unless it is the LM head too.
        weight_bytes = weights.bytes - (0 if config.tie_word_embeddings
                                        else config.vocab_size * config.hidden_size * dtype.itemsize)
        for batch in batches:
            args = _paged_batch(batch, context, config.num_heads, config.num_kv_heads, config.head_dim,
                                dtype, device)
            _, _, _, tables, seq_lens, starts, _, _, _ = args
            num_blocks = tables.numel() + 1
            kv = [(torch.randn(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, device=device).to(dtype),
                   torch.randn(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, device=device).to(dtype))
                  for _ in range(config.num_layers)]
            positions = seq_lens.long() - 1
            slots = tables.long()[torch.arange(batch, device=device), positions // BLOCK_SIZE] * BLOCK_SIZE \
                + positions % BLOCK_SIZE
            meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                                     query_start_loc=starts, max_query_len=1, max_seq_len=context)
            input_ids = torch.randint(0, config.vocab_size, (batch,), device=device)
            logits_indices = torch.arange(batch, device=device)

            def step():
                with torch.inference_mode():
                    return model.forward(input_ids, positions, meta, kv, logits_indices)

            eager_ms = timer(step, launches=True)
            graph_ms = timer(step) if device.type == "cuda" else None
            kv_bytes = batch * context * config.kv_bytes_per_token(dtype.itemsize)
            floor_ms = (weight_bytes + kv_bytes) / ceiling * 1000
            best = graph_ms if graph_ms is not None else eager_ms
            rows.append(dict(model=label, batch=batch, context=context, eager_ms=eager_ms, graph_ms=graph_ms,
                             floor_ms=floor_ms, weight_bytes=weight_bytes, kv_bytes=kv_bytes,
                             ratio_to_floor=best / floor_ms))
            del kv
        del model
    return rows


def print_summary(summary: dict, path: str | None) -> None:
    """The JSON summary as the last line printed, and into `path` when one is given."""
    text = json.dumps(summary)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    print(text)


def gpu_run(name: str, description: str, argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """A GPU benchmark's arguments (--dry-run, --json) and where it runs: on CUDA in bfloat16, or with
    --dry-run on the CPU under Triton's interpreter in float32 (it mishandles bfloat16). Without CUDA
    or --dry-run it refuses in one line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dry-run", action="store_true", help="toy sizes; on the CPU under Triton's interpreter")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit(f"{name}: no CUDA device here; it measures GPU bandwidth (--dry-run checks the script)")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of a Triton kernel
    return args, torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32


def main(argv: list[str] | None = None) -> None:
    args, device, dtype = gpu_run("kernels_gpu", __doc__, argv)
    from kernels import get_ops

    ops, ref = get_ops("triton", device), get_ops("torch", device)
    timer = Timer(device, args.dry_run)
    torch.manual_seed(0)

    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter, dry run)",
               "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    errors = check_correctness(ops, ref, device, dtype, args.dry_run)
    tolerance = 0.03 if dtype == torch.bfloat16 else 1e-4
    summary["max_error"] = errors
    summary["correct"] = all(e <= tolerance for e in errors.values())
    print(f"correctness ({summary['dtype']}, tolerance {tolerance}):")
    for name, err in errors.items():
        print(f"  {name:28s} {err:.2e} {'ok' if err <= tolerance else 'FAIL'}")

    ceiling = copy_bandwidth(device, timer, args.dry_run)
    summary["copy_bandwidth_gb_s"] = ceiling / 1e9
    print(f"device-to-device copy: {ceiling / 1e9:.0f} GB/s (read + write)")

    summary["decode_attention"] = attention_grid(ops, device, dtype, timer, ceiling, args.dry_run)
    print("decode attention   batch x context  splits  triton ms  bw frac   sdpa ms  bw frac  speedup")
    for r in summary["decode_attention"]:
        print(f"  {r['batch']:>16d} x {r['context']:<7d} {r['num_splits']:6d} {r['triton_ms']:9.3f} "
              f"{r['triton_bw_frac']:8.2f} "
              f"{r['sdpa_ms']:9.3f} {r['sdpa_bw_frac']:8.2f} {r['speedup_vs_sdpa']:8.2f}")

    summary["model_decode_step"] = model_steps(ops, device, dtype, timer, ceiling, args.dry_run)
    print("model decode step  model           batch  eager ms  graph ms  floor ms  x floor")
    for r in summary["model_decode_step"]:
        graph = f"{r['graph_ms']:9.3f}" if r["graph_ms"] is not None else "        -"
        print(f"  {r['model']:>30s} {r['batch']:6d} {r['eager_ms']:9.3f} {graph} {r['floor_ms']:9.3f} "
              f"{r['ratio_to_floor']:8.2f}")

    grid = {(r["batch"], r["context"]): r for r in summary["decode_attention"]}
    big = [r for r in summary["model_decode_step"] if r["model"] == "qwen2.5-1.5b" and r["batch"] == 64]
    summary["targets"] = {
        "attention_1x32k_bw_frac>=0.7": grid[(1, 32768)]["triton_bw_frac"] >= 0.7 if (1, 32768) in grid else None,
        "attention_16x4k_bw_frac>=0.7": grid[(16, 4096)]["triton_bw_frac"] >= 0.7 if (16, 4096) in grid else None,
        "model_1.5b_b64_within_1.5x_floor": big[0]["ratio_to_floor"] <= 1.5 if big else None,
    }
    print_summary(summary, args.json)


if __name__ == "__main__":
    main()
