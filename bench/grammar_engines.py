"""xgrammar against llguidance on the default model's tokenizer: `python -m bench.grammar_engines`.

The measurement behind the structured-output engine's choice (actors/text/grammar.py). llguidance is
not a dependency: `pip install llguidance` first. For each engine: the tokenizer's setup, one JSON
schema's compilation, and the time of each token mask along a document that satisfies the schema
(`--repeats` walks, fresh matchers), each engine with its default JSON options. Prints one JSON
object per engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from actors.text.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}}


def xgrammar_walk(hf, vocab: int, eos: list[int], ids: list[int], repeats: int):
    import xgrammar as xgr

    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos),
                                   max_threads=1)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for x in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - t)
            assert m.accept_token(x)
    return setup, compile_s, masks


def llguidance_walk(hf, vocab: int, eos: list[int], ids: list[int], repeats: int):
    import llguidance.hf
    from llguidance import LLMatcher

    t = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - t
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    masks = []
    for _ in range(repeats):
        m = LLMatcher(tokenizer, grammar)
        for x in ids:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            masks.append(time.perf_counter() - t)
            assert m.consume_token(x), m.get_error()
    return setup, compile_s, masks


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.model)
    eos = list(tok.eos_token_ids)
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False) + eos[:1]
    out = []
    for name, walk in (("xgrammar", xgrammar_walk), ("llguidance", llguidance_walk)):
        setup, compile_s, masks = walk(tok.hf, tok.vocab_size, eos, ids, args.repeats)
        masks.sort()
        out.append({"engine": name, "tokenizer_setup_ms": round(setup * 1e3, 1),
                    "schema_compile_ms": round(compile_s * 1e3, 2), "tokens": len(ids),
                    "mask_mean_us": round(statistics.mean(masks) * 1e6, 1),
                    "mask_p50_us": round(masks[len(masks) // 2] * 1e6, 1),
                    "mask_p90_us": round(masks[int(len(masks) * 0.9)] * 1e6, 1),
                    "mask_max_us": round(masks[-1] * 1e6, 1)})
        print(json.dumps(out[-1]))
    return out


if __name__ == "__main__":
    main()
