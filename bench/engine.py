"""Offline throughput: Matinee against transformers' static `generate`, its continuous batching and
vLLM's offline `LLM.generate`.

`python -m bench.engine --json` runs one skewed workload (about 90% short outputs, 10% long ones,
varied prompt lengths, EOS ignored; `--workload chat` for a uniform chat-like mix) on SmolLM2 in
float32 on the CPU through Matinee's whole engine, through transformers' padded static `generate`
(batches of 16) and through transformers' continuous-batching manager (what `generate_batch` drives,
fed each request's own length), then Matinee again in bfloat16, then vLLM's CPU build in bfloat16
and float32, each in a process of its own after the others have finished (bench/peers.py). Figures
are ratios against the peers of the same run. `--kv-cache-dtype int8` (or fp8) also runs Matinee's
float32 and bfloat16 with that KV cache, each right after its peer in the model dtype's cache
(`--kv-first`: right before it; the first engine of a dtype in a process can run slower, so measure
both orders). At real sizes (`--model /tmp/models/llama-1b-hf`), `--skip f32,hf_static,hf_batch,vllm_f32`
runs bfloat16 alone, and `--also FILE,...` runs Matinee on other files of the same model (its GGUF types)
on the same workload, each a ratio against the one vLLM run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from bench import peers


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, vocab: int, seed: int, scale: float) -> Workload:
    rng = random.Random(seed)
    prompts, lens = [], []
    for i in range(n):
        long = i % 10 == 9  # 10% long, spread over the arrival order
        lens.append(max(1, round((rng.randint(256, 512) if long else rng.randint(16, 64)) * scale)))
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(rng.randint(16, 256))])
    return Workload(prompts, lens)


def make_chat_workload(n: int, vocab: int, seed: int, scale: float) -> Workload:
    """A chat-like offline mix: prompts of 40-400 tokens, outputs of 8-256, uniform and seeded."""
    rng = random.Random(seed)
    lens = [max(1, round(rng.randint(8, 256) * scale)) for _ in range(n)]
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(40, 400))] for _ in range(n)]
    return Workload(prompts, lens)


WORKLOADS = {"skewed": (make_workload, 64), "chat": (make_chat_workload, 48)}


def matmul_gflops(dtype: torch.dtype, seconds: float = 1.0, windows: int = 3) -> float:
    """The best of `windows` timings of 1024x1024 matmuls, each `seconds` long: on a shared VM a
    single window can catch a slow spell, and a low rate would flatter `roofline_frac`."""
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        best = max(best, 2 * 1024 ** 3 * n / (time.perf_counter() - t0) / 1e9)
    return best


def matmul_params(cfg) -> int:
    """Weights that take part in matmuls per token (the LM head included, embeddings looked up)."""
    attn = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size


def run_matinee(model: str, wl: Workload, dtype: str, threads: int | None, budget: int, kv_cache_dtype: str = "auto",
                **config) -> dict:
    """One Matinee engine over the workload, in a fresh process of its own, as each peer runs: nothing an
    engine before it left in the process (threads, an OpenMP team, a heap) is measured with it. OpenMP
    keeps its default wait policy, as `matinee serve` runs it (PASSIVE, which this benchmark forced
    before, made decode steps 2-4x slower on an Intel VM: 25.8 against 6.4 ms at batch 1). `config`: more
    EngineConfig fields (device, enforce_eager, ...)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_matinee_here, model, wl, dtype, threads, budget, kv_cache_dtype, config).result()


def _run_matinee_here(model: str, wl: Workload, dtype: str, threads: int | None, budget: int, kv_cache_dtype: str,
                      config: dict) -> dict:
    from actors import LLM, SamplingParams

    with LLM(model, dtype=dtype, num_threads=threads, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype,
             **{"max_num_seqs": len(wl.prompts), **config}) as llm:
        llm.generate([wl.prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        before = llm.stats()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params)
        wall = time.perf_counter() - t0
        after = llm.stats()
        cfg = llm.engine.model_config
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != wl.output_tokens:
        raise RuntimeError(f"Matinee produced {produced} tokens, expected {wl.output_tokens}")
    step_s = after.step_s - before.step_s
    forward_s = after.forward_s - before.forward_s
    slots = after.kv_slots_allocated - before.kv_slots_allocated
    used = after.kv_slots_used - before.kv_slots_used
    processed = (after.prompt_tokens - before.prompt_tokens) - (after.prefix_cache_hit_tokens
                                                                 - before.prefix_cache_hit_tokens) + produced
    return {"tok_s": produced / wall, "wall_s": wall, "steps": after.steps - before.steps,
            "step_s": step_s, "forward_s": forward_s, "overhead_frac": (step_s - forward_s) / step_s,
            "loop_idle_frac": max(0.0, 1 - step_s / wall), "kv_waste_frac": 1 - used / slots if slots else 0.0,
            "preemptions": after.preemptions - before.preemptions,
            "model_flops": 2 * matmul_params(cfg) * processed, "tokens_processed": processed}


def load_hf(model: str):
    from transformers import AutoModelForCausalLM

    if model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                    dtype=torch.float32, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")


def run_hf_static(hf, wl: Workload, batch: int = 16) -> dict:
    """The usual user path: padded batches in arrival order, each run until its longest output."""
    t0 = time.perf_counter()
    for i in range(0, len(wl.prompts), batch):
        rows = wl.prompts[i:i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(wl.output_lens[i:i + batch]),
                        eos_token_id=None, pad_token_id=0)
    wall = time.perf_counter() - t0
    return {"tok_s": wl.output_tokens / wall, "wall_s": wall}  # only the requested tokens count


def run_hf_batch(hf, wl: Workload, budget: int) -> dict:
    """transformers' continuous batching (the manager behind `generate_batch`), each request with its
    own max_new_tokens, which `generate_batch` itself cannot express."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=None, pad_token_id=0)
    page = 256
    blocks = sum(-(-(len(p) + n) // page) for p, n in zip(wl.prompts, wl.output_lens)) + 8
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=budget,
                                  max_requests_per_batch=len(wl.prompts), use_cuda_graph=False)
    t0 = time.perf_counter()
    produced, done = 0, 0
    with hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                block=True, timeout=30, warmup=False) as mgr:
        for p, n in zip(wl.prompts, wl.output_lens):
            mgr.add_request(p, max_new_tokens=n, eos_token_id=-1)
        while done < len(wl.prompts):
            res = mgr.get_result(timeout=1)
            if res is not None and res.is_finished():
                done += 1
                produced += len(res.generated_tokens)
            elif res is None and not mgr.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    wall = time.perf_counter() - t0
    return {"tok_s": produced / wall, "wall_s": wall, "produced": produced}


PEERS = ("f32", "hf_static", "hf_batch", "bf16", "vllm_bf16", "vllm_f32")   # f32: Matinee in float32
VLLM_DTYPES = {"bfloat16": "vllm_bf16", "float32": "vllm_f32"}


def vllm_job(wl: Workload, dtype: str, model: str, budget: int) -> dict:
    """bench/vllm_offline.py's input: the same prompts, lengths and batch limits Matinee gets."""
    return {"model": model, "dtype": dtype, "max_model_len": 2048, "max_num_seqs": len(wl.prompts),
            "max_num_batched_tokens": budget, "prompts": wl.prompts, "max_tokens": wl.output_lens}


def vllm_ratios(out: dict) -> dict:
    """Matinee's tok/s (float32, bfloat16 when it ran the whole workload, and each `--also` file) over vLLM's
    best dtype."""
    runs = {key: out[f"{key}_tok_s"] for key in VLLM_DTYPES.values() if f"{key}_tok_s" in out}
    if not runs:
        return {}
    best = max(runs, key=runs.get)
    ratios = {"vllm_best": best, "vllm_best_tok_s": runs[best]}
    if "matinee_tok_s" in out:
        ratios["speedup_vs_vllm"] = out["matinee_tok_s"] / runs[best]
    if "matinee_bf16_tok_s" in out and "bf16_num_requests" not in out:
        ratios["bf16_speedup_vs_vllm"] = out["matinee_bf16_tok_s"] / runs[best]
    for name, tok_s in out.get("also_bf16_tok_s", {}).items():
        ratios.setdefault("also_bf16_speedup_vs_vllm", {})[name] = tok_s / runs[best]
    return ratios


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (else a table)")
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--workload", choices=WORKLOADS, default="skewed",
                    help="skewed: 90%% outputs of 16-64 tokens, 10%% of 256-512, prompts 16-256; "
                         "chat: prompts 40-400, outputs 8-256")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 64 (skewed), 48 (chat)")
    ap.add_argument("--output-scale", type=float, default=1.0, help="scale every output length (quick runs)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--budget", type=int, default=1024, help="max tokens per step, for Matinee and transformers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma list of: " + ", ".join(PEERS))
    ap.add_argument("--also", default="", help="comma list of other files of the same model (say its GGUF "
                    "types) that Matinee also runs in bfloat16 on the same workload, against the same vLLM run")
    ap.add_argument("--vllm-python", default=peers.VLLM_PYTHON, help="the interpreter of vLLM's venv")
    ap.add_argument("--vllm-model", default=peers.VLLM_MODEL, help="HF folder of the same weights, for vLLM")
    ap.add_argument("--vllm-omp-bind", default=peers.VLLM_OMP_BIND,
                    help="VLLM_CPU_OMP_THREADS_BIND: auto (one core here) or a core list such as 0-1")
    ap.add_argument("--bf16-requests", type=int, default=None,
                    help="run bfloat16 on the first N requests only (a CPU without bf16 units is slow at it)")
    ap.add_argument("--bf16-scale", type=float, default=None, help="output scale of the bfloat16 run")
    ap.add_argument("--kv-cache-dtype", choices=("int8", "fp8"), default=None,
                    help="also run Matinee with this KV cache, against the model dtype's")
    ap.add_argument("--kv-first", action="store_true",
                    help="run each --kv-cache-dtype engine before its peer in the model dtype's cache, not after")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(PEERS):
        ap.error(f"--skip: unknown {sorted(skip - set(PEERS))}; choose from {', '.join(PEERS)}")
    vllm_dtypes = [d for d, key in VLLM_DTYPES.items() if key not in skip]
    if vllm_dtypes and not os.path.exists(args.vllm_python):
        ap.error(f"{args.vllm_python} not found (build it with setup_vllm_cpu.sh) or --skip vllm_bf16,vllm_f32")
    make, default_n = WORKLOADS[args.workload]

    from actors.config import default_model_path
    from actors.text.tokenizer import load_tokenizer

    model = args.model or default_model_path()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from actors.worker.allocator import keep_freed_memory

    # Process-wide, before any peer runs: every peer gets the same allocator settings.
    allocator_tuned = keep_freed_memory()
    vocab = load_tokenizer(model).vocab_size
    wl = make(args.num_requests or default_n, vocab, args.seed, args.output_scale)
    def log(*a):  # progress on stderr; stdout carries only the result
        print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)

    out = {"model": os.path.basename(model), "workload": args.workload, "num_requests": len(wl.prompts),
           "output_tokens": wl.output_tokens, "prompt_tokens": sum(map(len, wl.prompts)), "threads": threads, "budget": args.budget,
           "output_scale": args.output_scale, "allocator_tuned": allocator_tuned}
    out["fp32_matmul_gflops"] = matmul_gflops(torch.float32)
    out["bf16_matmul_gflops"] = matmul_gflops(torch.bfloat16, windows=1)  # recorded even when the bf16 run is skipped
    log("matmul GFLOP/s fp32", out["fp32_matmul_gflops"], "bf16", out["bf16_matmul_gflops"])

    kv = args.kv_cache_dtype
    if kv and args.kv_first:
        q = run_matinee(model, wl, "float32", threads, args.budget, kv)
        log(f"matinee fp32, {kv} KV cache", q)
    if "f32" in skip and (kv or not {"hf_static", "hf_batch"} <= skip or args.bf16_requests or args.bf16_scale):
        ap.error("--skip f32 leaves the KV, transformers and bf16-subset runs no float32 figure to compare with")
    m = None
    if "f32" not in skip:
        m = run_matinee(model, wl, "float32", threads, args.budget)
        log("matinee fp32", m)
        out.update(matinee_tok_s=m["tok_s"], matinee_wall_s=m["wall_s"], overhead_frac=m["overhead_frac"],
                   loop_idle_frac=m["loop_idle_frac"], kv_waste_frac=m["kv_waste_frac"], steps=m["steps"],
                   preemptions=m["preemptions"],
                   roofline_frac=m["model_flops"] / m["wall_s"] / (out["fp32_matmul_gflops"] * 1e9))
    if kv:
        if not args.kv_first:
            q = run_matinee(model, wl, "float32", threads, args.budget, kv)
            log(f"matinee fp32, {kv} KV cache", q)
        out.update(kv_order="kv_first" if args.kv_first else "kv_after")
        out.update({f"matinee_kv_{kv}_tok_s": q["tok_s"], f"kv_{kv}_speedup": q["tok_s"] / m["tok_s"]})
    if not {"hf_static", "hf_batch"} <= skip:
        hf = load_hf(model)
        if "hf_static" not in skip:
            s = run_hf_static(hf, wl)
            log("hf static", s)
            out.update(hf_static_tok_s=s["tok_s"], hf_static_wall_s=s["wall_s"],
                       speedup_vs_hf_static=m["tok_s"] / s["tok_s"])
        if "hf_batch" not in skip:
            b = run_hf_batch(hf, wl, args.budget)
            log("hf generate_batch", b)
            out.update(hf_batch_tok_s=b["tok_s"], hf_batch_wall_s=b["wall_s"],
                       speedup_vs_hf_batch=m["tok_s"] / b["tok_s"])
        del hf
    if "bf16" not in skip:
        sub = wl
        if args.bf16_requests or args.bf16_scale:
            sub = make(args.bf16_requests or len(wl.prompts), vocab, args.seed,
                       args.bf16_scale or args.output_scale)
            out.update(bf16_num_requests=len(sub.prompts), bf16_output_tokens=sub.output_tokens)
            same = run_matinee(model, sub, "float32", threads, args.budget)  # the fp32 peer on that subset
            out["matinee_fp32_subset_tok_s"] = same["tok_s"]
        if kv and args.kv_first:
            q = run_matinee(model, sub, "bfloat16", threads, args.budget, kv)
            log(f"matinee bf16, {kv} KV cache", q)
        b16 = run_matinee(model, sub, "bfloat16", threads, args.budget)
        log("matinee bf16", b16)
        out.update(matinee_bf16_tok_s=b16["tok_s"])
        if m is not None:
            out["bf16_speedup"] = b16["tok_s"] / out.get("matinee_fp32_subset_tok_s", m["tok_s"])
        if kv:
            if not args.kv_first:
                q = run_matinee(model, sub, "bfloat16", threads, args.budget, kv)
                log(f"matinee bf16, {kv} KV cache", q)
            out.update({f"matinee_bf16_kv_{kv}_tok_s": q["tok_s"], f"bf16_kv_{kv}_speedup": q["tok_s"] / b16["tok_s"]})
    for other in filter(None, args.also.split(",")):
        a = run_matinee(other, wl, "bfloat16", threads, args.budget)
        log("matinee bf16", os.path.basename(other), a)
        out.setdefault("also_bf16_tok_s", {})[os.path.basename(other)] = a["tok_s"]
    for dtype in vllm_dtypes:
        key = VLLM_DTYPES[dtype]
        v = peers.run_vllm_offline(vllm_job(wl, dtype, args.vllm_model, args.budget), args.vllm_omp_bind,
                                   args.vllm_python, log_path=f"/tmp/bench-engine-{key}.log")
        log(key, v)
        if v["tokens"] != wl.output_tokens:
            raise RuntimeError(f"vLLM produced {v['tokens']} tokens, expected {wl.output_tokens}")
        out.update({f"{key}_tok_s": v["tok_s"], f"{key}_wall_s": v["seconds"], f"{key}_startup_s": v["startup_s"],
                    "vllm_omp_bind": args.vllm_omp_bind})
    out.update(vllm_ratios(out))
    print(json.dumps(out, indent=None if args.json else 2))
    return out


if __name__ == "__main__":
    main()
