"""The cost of constrained decoding: `python -m bench.structured [--batches 1 16] [--rounds 3]`.

The same chat prompts decode `--tokens` tokens each, once free and once held to a JSON schema,
at each batch size (all prompts of a batch submitted together), alternating free and constrained
rounds so drift on a shared machine falls on both. The schema (an array of at least 40 objects
with nested objects, enums and arrays) never ends within `--tokens`, so every sequence of both
runs decodes exactly as many tokens and the ratio is the mask's cost per token: the grammar
matchers' mask, the bitmask applied to the logits, the matcher advancing. The grammar is compiled
before timing (a warm-up of both paths), and prefix caching is off so that every round computes
its prompts alike. Prints one JSON object; the target is ratio >= 0.90 at batch 16.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from actors import LLM, SamplingParams
from actors.messages.front_end import StructuredOutput

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                   "verified": {"type": "boolean"}},
                  "required": ["city", "verified"]},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 40}
TOPICS = ["pets in a shelter", "a zoo's animals", "a farm", "an aquarium", "birds in a park", "a vet's patients",
          "a pet show", "animals in a story"]


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} as JSON "
                                      f"(#{i})."}]) for i in range(n)]


def _round(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    held = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=0, structured=spec)
    results = {}
    with LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.batches), enable_prefix_caching=False) as llm:
        for params in (free, held):   # compiles the grammar; warms both paths
            llm.generate(_prompts(llm, 2), params)
        for batch in args.batches:
            prompts = _prompts(llm, batch)
            rates: dict[str, list[float]] = {"free": [], "json_schema": []}
            for _ in range(args.rounds):
                for name, params in (("free", free), ("json_schema", held)):
                    wall, tokens = _round(llm, prompts, params)
                    assert tokens == batch * args.tokens, "a sequence ended early: the ratio would be unfair"
                    rates[name].append(tokens / wall)
            ratios = [c / f for f, c in zip(rates["free"], rates["json_schema"])]
            results[f"batch_{batch}"] = {
                "free_tok_s": [round(r, 1) for r in rates["free"]],
                "json_schema_tok_s": [round(r, 1) for r in rates["json_schema"]],
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            }
        results["dtype"] = llm.engine.config.resolved_dtype()
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
