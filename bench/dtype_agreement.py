"""How often bfloat16 greedy decoding agrees with float32 on a model: `python -m bench.dtype_agreement`.

bfloat16 cannot be exact (its 8-bit mantissa moves logits by ~1e-2), so the measure is how far the two
greedy continuations run identical: the share of prompts whose whole continuation matches, and the
mean share of tokens before the first divergence. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json

from actors import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "List three uses of copper.", "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Give me a tip for learning to code.", "What does a compiler do?",
    "Describe a cat in one sentence.", "What is 17 times 23?", "Name a famous painting and its painter.",
    "Summarise the plot of Romeo and Juliet.", "What causes rain?", "Suggest a name for a bakery.",
    "How many legs does a spider have?", "What is a prime number?", "Write a limerick about a robot.",
    "Why do we sleep?", "What is the speed of light?",
]


def continuations(dtype: str, model: str | None, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, dtype=dtype) as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    f32 = continuations("float32", args.model, args.max_tokens)
    bf16 = continuations("bfloat16", args.model, args.max_tokens)
    prefixes = []
    for a, b in zip(f32, bf16):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same / max(len(a), 1))
    out = {"prompts": len(PROMPTS), "max_tokens": args.max_tokens,
           "identical": sum(p == 1.0 for p in prefixes) / len(prefixes),
           "mean_prefix_agreement": sum(prefixes) / len(prefixes),
           "first_token_agreement": sum(a[:1] == b[:1] for a, b in zip(f32, bf16)) / len(f32)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
