"""Multi-LoRA throughput: output tok/s of 32 concurrent requests on the base model alone, then spread
over 1, 4 and 16 distinct adapters (rank 16 on all seven projections), and the time to read an adapter.

`python -m bench.lora --json` runs each case in a process of its own, one after the other, through the
offline engine (all requests submitted at once: concurrency 32) on SmolLM2 by default. The adapters
are random (speed does not depend on the values), written as PEFT folders. The figure that counts is
each case's tok/s over the base model's in the same run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from actors.config import default_model_path
from actors.worker.lora_adapter import MODULE_PATHS, module_shapes


def write_adapter(folder: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter of `rank` on every projection of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (d_in, d_out) in module_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{MODULE_PATHS[module]}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [p.split(".")[-1] for p in MODULE_PATHS.values()]}, f)
    return folder


def run_case(model: str, adapters: dict[str, str], num_adapters: int, requests: int, prompt_len: int,
             output_len: int, threads: int, dtype: str = "auto") -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_case_here, model, adapters, num_adapters, requests, prompt_len, output_len,
                           threads, dtype).result()


def workload(vocab: int, adapters: dict[str, str], num_adapters: int, requests: int,
             prompt_len: int) -> tuple[list[list[int]], list[str | None]]:
    """The prompts (seeded random token ids) and each one's adapter, round robin over the first
    `num_adapters` (None: the base model)."""
    names = list(adapters)[:num_adapters]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt_len)] for _ in range(requests)]
    return prompts, [names[i % len(names)] if names else None for i in range(requests)]


def run_vllm_case(model: str, vocab: int, adapters: dict[str, str], num_adapters: int, requests: int,
                  prompt_len: int, output_len: int) -> dict:
    """The same case through vLLM's CPU build offline (`--enable-lora`), bf16, in its own interpreter."""
    from bench.peers import run_vllm_offline

    prompts, loras = workload(vocab, adapters, num_adapters, requests, prompt_len)
    used = {n: adapters[n] for n in loras if n}
    job = {"model": model, "dtype": "bfloat16", "max_model_len": prompt_len + output_len + 16,
           "max_num_seqs": requests, "max_num_batched_tokens": max(2048, prompt_len * requests),
           "prompts": prompts, "max_tokens": [output_len] * requests, "loras": used, "lora_of": loras}
    out = run_vllm_offline(job)
    return {"adapters": num_adapters, "tok_s": out["tok_s"], "wall_s": out["seconds"]}


def _case_here(model, adapters, num_adapters, requests, prompt_len, output_len, threads, dtype) -> dict:
    from actors import LLM, SamplingParams

    names = list(adapters)[:num_adapters]
    with LLM(model, num_threads=threads, max_num_seqs=requests, lora_modules=[f"{n}={adapters[n]}" for n in names]
             or None, max_loras=max(num_adapters, 1), max_lora_rank=16, dtype=dtype) as llm:
        prompts, loras = workload(llm.engine.model_config.vocab_size, adapters, num_adapters, requests, prompt_len)
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0), lora_request=loras[0])
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras)
        wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"adapters": num_adapters, "tok_s": produced / wall, "wall_s": wall}


def load_time(model: str, folder: str, reps: int = 5) -> float:
    """Seconds to read and check one adapter folder (what /v1/load_lora_adapter waits for), best of `reps`."""
    from actors.worker.lora_adapter import read_adapter
    from actors.worker.model_runner import open_model
    from actors.model.source import resolve_model_source

    cfg, weights = open_model(resolve_model_source(model))
    weights.close()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        read_adapter("x", folder, cfg, 16)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cases", type=int, nargs="+", default=[0, 1, 4, 16], help="distinct adapters; 0: the base")
    ap.add_argument("--dtype", default="auto", help="Matinee's (bfloat16 to compare with vLLM's bf16 like for like)")
    ap.add_argument("--vllm", action="store_true",
                    help="also each case through vLLM's CPU build (--enable-lora), one after the other; --model "
                         "must then be an HF folder both read (say /tmp/smollm2-hf-vllm)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from actors.worker.model_runner import open_model
    from actors.model.source import resolve_model_source

    cfg, weights = open_model(resolve_model_source(args.model))
    weights.close()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {f"a{i}": write_adapter(os.path.join(tmp, f"a{i}"), cfg, 16, i) for i in range(max(args.cases))}
        results = [run_case(args.model, adapters, n, args.requests, args.prompt_len, args.output_len, args.threads,
                            args.dtype) for n in args.cases]
        vllm = [run_vllm_case(args.model, cfg.vocab_size, adapters, n, args.requests, args.prompt_len,
                              args.output_len) for n in args.cases] if args.vllm else []
        load_s = load_time(args.model, adapters["a0"]) if adapters else None
    for cases in (results, vllm):
        base = next((r["tok_s"] for r in cases if r["adapters"] == 0), None)
        for r in cases:
            r["vs_base"] = r["tok_s"] / base if base else None
    for r, v in zip(results, vllm):
        r["vs_vllm"] = r["tok_s"] / v["tok_s"]
    report = {"model": os.path.basename(args.model), "requests": args.requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "threads": args.threads, "dtype": args.dtype, "cases": results,
              "vllm_cases": vllm,
              "adapter_load_s": load_s}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in results:
            print(f"{r['adapters']:>3} adapters: {r['tok_s']:8.1f} tok/s  ({r['vs_base'] or 0:.2f}x the base)"
                  + (f", {r['vs_vllm']:.2f}x vLLM" if "vs_vllm" in r else ""))
        print(f"adapter load: {load_s * 1e3:.0f} ms" if load_s else "")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
