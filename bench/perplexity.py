"""Perplexity of a model on an English text through Matinee's forward: `python -m bench.perplexity [engine flags]`.

The text (by default the first chapter of Pride and Prejudice, public domain, in tests/data/) is
tokenized and cut into chunks of --context tokens; each chunk is one forward of the model runner the
engine builds from the same flags (--quantization, --dtype, --kernels, any later KV cache format),
and, as llama.cpp's llama-perplexity does, only the second half of each chunk is scored, so every
scored token sees at least half a context. Prints one JSON object: perplexity, tokens scored, flags.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from actors.config import EngineConfig
from actors.engine import _make_runner   # the engine's own runner: every engine flag applies
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from gateway.flags import add_flags, build

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "pride_and_prejudice_ch1.txt"


def perplexity(config: EngineConfig, text: str, context: int) -> dict:
    runner = _make_runner(config)
    ids = runner.tokenizer.encode(text)
    chunks = [ids[i:i + context] for i in range(0, len(ids) - context + 1, context)]
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one context of {context}")
    blocks = list(range(-(-context // runner.block_size)))
    nll, scored = 0.0, 0
    for chunk in chunks:
        logits = runner.execute(ForwardBatch([SequenceInput(chunk, 0, blocks, num_logits=context)]))
        first = context // 2
        logprobs = torch.log_softmax(logits[first - 1:-1].double(), dim=-1)
        targets = torch.tensor(chunk[first:])
        nll -= logprobs.gather(1, targets[:, None]).sum().item()
        scored += len(targets)
    return {"perplexity": round(math.exp(nll / scored), 4), "tokens_scored": scored, "chunks": len(chunks),
            "context": context, "quantization": config.quantization, "dtype": runner.dtype.__repr__()[6:],
            "kv_cache_dtype": config.kv_cache_dtype,
            "weight_bytes": runner.weight_bytes}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=TEXT, help="a UTF-8 text file")
    ap.add_argument("--context", type=int, default=256, help="tokens per chunk")
    add_flags(ap.add_argument_group("engine"), EngineConfig)
    args = ap.parse_args(argv)
    result = perplexity(build(EngineConfig, args), args.text.read_text(encoding="utf-8"), args.context)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
