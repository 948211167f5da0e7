"""The sampler's cost per step on real logits: `python -m bench.sampler [--batch 1,16]`.

Draws one token per row with Matinee's Sampler and, side by side, with transformers' sampling path
(its temperature / top-k / top-p / min-p warpers, softmax, torch.multinomial: what `generate` runs),
on logits the default model computed for an English text (60 positions, 49,152-token vocabulary),
for the parameter sets chat clients send. Each timing is the median of `--repeats` draws, each after
a 64 MB write has pushed the logits and the code out of the caches, as a forward does in a real step.
Prints one JSON line per case with the ratio transformers / Matinee.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CASES = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
         dict(temperature=0.7, top_k=50), dict(temperature=0.8, top_p=0.95, top_k=40),
         dict(temperature=0.7, min_p=0.05)]
TEXT = ("The history of the city begins in the early medieval period, when a small settlement grew around a "
        "river crossing. Merchants came from the north and the south, and by the twelfth century the town held "
        "a market every week. Its people built a church of stone, then a wall, and later a bridge.")


def model_logits(model: str | None, rows: int = 60) -> torch.Tensor:
    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.model_runner import ModelRunner

    runner = ModelRunner(model, dtype="float32", num_blocks=64, block_size=16)
    ids = runner.tokenizer.hf.encode(TEXT)[:rows]
    return runner.execute(ForwardBatch([SequenceInput(ids, 0, list(range(8)), len(ids))]))


def transformers_draw(params: dict):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    t = params.get("temperature", 1.0)
    warpers = LogitsProcessorList()
    if t > 0 and t != 1.0:
        warpers.append(TemperatureLogitsWarper(t))
    if params.get("top_k"):
        warpers.append(TopKLogitsWarper(params["top_k"]))
    if params.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    if params.get("min_p"):
        warpers.append(MinPLogitsWarper(params["min_p"]))
    ids = torch.zeros(1, 1, dtype=torch.long)

    def draw(logits: torch.Tensor, generator: torch.Generator) -> list[int]:
        if t == 0:
            return logits.argmax(dim=-1).tolist()
        scores = warpers(ids.expand(logits.shape[0], -1), logits.clone())
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1).tolist()
    return draw


def matinee_draw(params: dict, rows: int):
    from actors.messages.front_end import SamplingParams
    from actors.worker.sampler import Sampler, SamplingState

    sampler = Sampler()
    states = [SamplingState(SamplingParams(**params), [1, 2, 3]) for _ in range(rows)]
    return lambda logits, generator: sampler.sample(logits, states, generator).token_ids


def timed(draw, logits: torch.Tensor, batch: int, repeats: int) -> float:
    flush = torch.empty(16 << 20)
    generator = torch.Generator().manual_seed(0)
    times = []
    for i in range(repeats):
        rows = logits[[(i * batch + b) % logits.shape[0] for b in range(batch)]].contiguous()
        flush.add_(1.0)
        start = time.perf_counter()
        draw(rows, generator)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", default="1,16", help="rows per draw, comma-separated")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logits = model_logits(args.model)
    out = []
    for batch in (int(b) for b in args.batch.split(",")):
        for params in CASES:
            ours = timed(matinee_draw(params, batch), logits, batch, args.repeats)
            peer = timed(transformers_draw(params), logits, batch, args.repeats)
            row = {"batch": batch, "params": params, "matinee_us": round(ours * 1e6, 1),
                   "transformers_us": round(peer * 1e6, 1), "speedup": round(peer / ours, 2)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    main()
