"""Embeddings throughput: Matinee's `LLM.embed` against transformers on the same weights.

`python -m bench.embeddings --json` embeds the same seeded sentences (24-96 tokens each) with
SmolLM2 (its GGUF dequantized, float32 on both sides: like for like) at batch 1 (one input a call)
and at batch 64 (64 inputs a call), Matinee pooling its last token and normalising as transformers'
`last_hidden_state` is pooled here. Each engine runs in a process of its own, one after the other.
Figures are inputs a second and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor

import torch


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("tea river music engine paper window light garden number market winter story "
             "bridge silver doctor forest signal harbour letter orange").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(n)]


def _timed(embed, texts: list[str], batch: int, reps: int) -> float:
    embed(texts[:batch])   # warm: kernels compiled, threads up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            embed(texts[i:i + batch])
        best = min(best, time.perf_counter() - t0)
    return len(texts) / best


def run_matinee(model: str, texts: list[str], batches: list[int], reps: int, threads: int) -> dict:
    from actors import LLM
    with LLM(model=model, dtype="float32", quantization="none", num_threads=threads) as llm:
        return {b: _timed(llm.embed, texts, b, reps) for b in batches}


def run_transformers(model: str, texts: list[str], batches: list[int], reps: int, threads: int) -> dict:
    from transformers import AutoModel, AutoTokenizer
    torch.set_num_threads(threads)
    folder, name = os.path.dirname(model), os.path.basename(model)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"   # the last position is every row's last token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    net = AutoModel.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(batch: list[str]) -> torch.Tensor:
        enc = tok(batch, return_tensors="pt", padding=True)
        hidden = net(**enc).last_hidden_state[:, -1]
        return torch.nn.functional.normalize(hidden, dim=-1)

    return {b: _timed(embed, texts, b, reps) for b in batches}


def main() -> None:
    from actors.model.source import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=default_model_path(), help="a GGUF file (default: SmolLM2's)")
    ap.add_argument("--inputs", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    texts, batches = sentences(args.inputs, 0), [1, 64]
    results = {}
    for name, fn in (("matinee", run_matinee), ("transformers", run_transformers)):
        with ProcessPoolExecutor(1) as pool:   # one engine at a time, each in a fresh process
            results[name] = pool.submit(fn, args.model, texts, batches, args.reps, args.threads).result()
    out = {"model": os.path.basename(args.model), "inputs": args.inputs, "threads": args.threads,
           "inputs_per_s": results,
           "ratio": {b: results["matinee"][b] / results["transformers"][b] for b in batches}}
    print(json.dumps(out, indent=2) if args.json else out)


if __name__ == "__main__":
    main()
