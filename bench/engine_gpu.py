"""Offline throughput on a GPU: Matinee's whole engine with decode steps replayed from CUDA graphs, the
same engine eager (`enforce_eager`), and transformers' `generate` in padded batches, in bfloat16.

The models are random-weight models of real shapes, written with `save_pretrained` on the GPU host (a
host that reaches no hub), beside a real tokenizer: `--tokenizer DIR` names a folder with one, whose
vocabulary sets the models' (`matinee`'s default model's tokenizer, saved with `save_pretrained`).
Outputs ignore EOS, so random weights produce every requested token.

`python -m bench.engine_gpu --tokenizer DIR [--shapes smollm2-135m,1.5b] [--json out.json]`; each engine
runs in a process of its own, one after the other. The last line printed is the JSON summary.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from bench.engine import Workload, make_chat_workload, run_matinee
from bench.kernels_gpu import print_summary

# SmolLM2-135M's layers, and Qwen2.5-1.5B's (q/k/v biases), both over the tokenizer's vocabulary.
SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
}
KV_CACHE_MEMORY = 16 << 30   # every request's KV at once: no preemption in the measure


def build_model(shape: str, tokenizer_dir: str, folder: str, device: str = "cuda") -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    params = dict(SHAPES[shape])
    config = AutoConfig.for_model(params.pop("model_type"), vocab_size=len(tokenizer), tie_word_embeddings=True,
                                  max_position_embeddings=4096, rms_norm_eps=1e-5, **params)
    with torch.device(device):   # random init runs where the weights are made
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_hf(folder: str, wl: Workload, batch: int) -> dict:
    """transformers' padded static `generate` on the GPU, batches in arrival order, each to its longest output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    hf.generate(torch.tensor([wl.prompts[0][:8]], device="cuda"), max_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(0, len(wl.prompts), batch):
        rows = wl.prompts[i:i + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(wl.output_lens[i:i + batch]),
                        eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del hf
    return {"tok_s": wl.output_tokens / wall, "wall_s": wall}   # only the requested tokens count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokenizer", required=True, help="a folder with the tokenizer the models use")
    ap.add_argument("--shapes", default="smollm2-135m", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--output-scale", type=float, default=1.0, help="scale every output length")
    ap.add_argument("--budget", type=int, default=2048, help="max tokens per step (the GPU default)")
    ap.add_argument("--hf-batch", type=int, default=64, help="transformers' batch (0: skip it)")
    ap.add_argument("--json", help="also write the summary to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("no CUDA device")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for shape in args.shapes.split(","):
        folder = tempfile.mkdtemp(prefix=f"matinee-{shape}-")
        try:
            build_model(shape, args.tokenizer, folder)
            from transformers import AutoConfig

            wl = make_chat_workload(args.num_requests, AutoConfig.from_pretrained(folder).vocab_size, 0,
                                    args.output_scale)
            row = {"shape": shape, "requests": len(wl.prompts), "output_tokens": wl.output_tokens,
                   "prompt_tokens": sum(map(len, wl.prompts))}
            for label, eager in (("graphs", False), ("eager", True)):
                row[label] = run_matinee(folder, wl, "bfloat16", None, args.budget, device="cuda",
                                         enforce_eager=eager, kv_cache_memory=KV_CACHE_MEMORY)
                print(f"{shape} matinee {label}: {row[label]['tok_s']:.0f} tok/s, {row[label]['steps']} steps, "
                      f"overhead {row[label]['overhead_frac']:.2f} of the step", flush=True)
            if args.hf_batch:
                row["hf_static"] = run_hf(folder, wl, args.hf_batch)
                print(f"{shape} transformers generate: {row['hf_static']['tok_s']:.0f} tok/s", flush=True)
            row["graphs_vs_eager"] = row["graphs"]["tok_s"] / row["eager"]["tok_s"]
            if "hf_static" in row:
                row["graphs_vs_hf"] = row["graphs"]["tok_s"] / row["hf_static"]["tok_s"]
            summary["runs"].append(row)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print_summary(summary, args.json)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
