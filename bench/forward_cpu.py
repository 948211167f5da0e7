"""One model forward on the CPU, timed alone: a prefill step of fresh prompts and a decode step of a full
batch, on the default model (or `--model`) as `matinee serve` loads it.

    python -m bench.forward_cpu [--dtype bfloat16] [--prompts 2] [--prompt-len 256] [--decodes 32]
                                [--context 320] [--repeats 10]

Prints the median and best milliseconds of each (the worker's own forward timer, so no scheduling or
sampling), and the prefill's tokens per second. The caches hold random tokens' KV; the decode step reads
`--context` positions per sequence. It also measures this machine's memory read rate (a sum over a
buffer four times the last-level cache) and gives the decode step's memory floor, the resident weight
bytes over that rate, and the fraction of it the best decode step reached (1.0: at the floor; meaningful
at `--decodes 1`, where a step reads each weight once and little else). Asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner


BLOCK = 16   # the KV block size the runner is given


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def prefill_batch(prompts: int, length: int, vocab: int) -> ForwardBatch:
    blocks = blocks_for(length)
    return ForwardBatch([SequenceInput([(7 * j + i) % (vocab - 100) + 100 for j in range(length)], 0,
                                       list(range(i * blocks, (i + 1) * blocks))) for i in range(prompts)])


def decode_batch(decodes: int, context: int) -> ForwardBatch:
    blocks = blocks_for(context + 1)
    return ForwardBatch([SequenceInput([123 + i], context, list(range(i * blocks, (i + 1) * blocks)))
                         for i in range(decodes)])


def read_gb_s(repeats: int = 5) -> float:
    """The best rate, over `repeats` passes, at which the torch threads sum a float32 buffer four times the
    last-level cache: what a step that streams its weights from memory can read at."""
    from kernels import cpu_native

    buffer = torch.ones(4 * cpu_native.last_level_cache_bytes() // 4)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def timed(runner: ModelRunner, batch: ForwardBatch, repeats: int) -> dict:
    for _ in range(3):
        runner.execute(batch)
    times = []
    for _ in range(repeats):
        runner.execute(batch)
        times.append(runner.last_forward_s * 1e3)
    return {"median_ms": round(statistics.median(times), 2), "best_ms": round(min(times), 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    blocks = max(args.prompts * blocks_for(args.prompt_len), args.decodes * blocks_for(args.context + 1))
    runner = ModelRunner(args.model, dtype=args.dtype, kernels="auto", block_size=BLOCK, num_blocks=blocks + 8,
                         quantization=args.quantization)
    vocab = runner.model_config.vocab_size
    prefill = timed(runner, prefill_batch(args.prompts, args.prompt_len, vocab), args.repeats)
    prefill["tokens_per_s"] = round(args.prompts * args.prompt_len / prefill["median_ms"] * 1e3)
    decode = timed(runner, decode_batch(args.decodes, args.context), args.repeats)
    rate = read_gb_s()
    floor_ms = runner.weight_bytes / (rate * 1e9) * 1e3
    out = {"dtype": args.dtype, "prefill": {"prompts": args.prompts, "prompt_len": args.prompt_len, **prefill},
           "decode": {"decodes": args.decodes, "context": args.context, **decode},
           "memory": {"read_gb_s": round(rate, 1), "weight_bytes": runner.weight_bytes,
                      "decode_floor_ms": round(floor_ms, 2), "floor_frac": round(floor_ms / decode["best_ms"], 3)}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
