"""Synthetic workloads for the serving benchmark: random lengths, shared system prompts, long-prompt mix.

Prompts are made of common English words drawn with a seeded RNG (about 1.3 tokens per word on
BPE tokenizers), so any OpenAI-compatible server sees the same text without a tokenizer here;
`random-ids` prompts are exactly `input_len` random token ids instead, sent to /v1/completions, so
two servers see the same tokens whatever their chat templates.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can who out up said what some about into than them only other time new these two may "
    "first then do any like my now over such our man me even most made after also did many off "
    "before must well back through years much where your way down should because each just those "
    "people how too little state good very make world still see own men work long here get both "
    "between life being under never day same another know while last might us great old year "
    "come since against go came right used take three house use during without again place "
    "around however home small found thought went say part once general high upon school every "
    "does got united left number course war until always away something fact water though less "
    "public put think almost hand enough far took head yet government system better set told "
    "nothing night end why called didn't eyes find going look asked later knew point next city"
).split()

DATASETS = ("random", "shared-prefix", "long-mix", "random-ids")


@dataclass(frozen=True)
class Request:
    messages: list[dict]
    max_tokens: int
    prompt_words: int
    prompt_ids: list[int] | None = None   # set: a /v1/completions request with these tokens


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n_words)))


def _span(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def make_requests(dataset: str, num: int, *, input_len: int = 128, output_len: int = 64,
                  range_ratio: float = 0.5, num_prefixes: int = 8, prefix_len: int = 512,
                  seed: int = 0, vocab_size: int = 49152) -> list[Request]:
    """`input_len`, `prefix_len` are in words (in tokens for random-ids, whose ids avoid the first
    and last tenth of `vocab_size`, where special tokens live); `output_len` in tokens (max_tokens)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if num < 1:
        raise ValueError("num must be at least 1")
    rng = random.Random(seed)
    out: list[Request] = []
    if dataset == "random":
        for _ in range(num):
            n = _span(rng, input_len, range_ratio)
            out.append(Request([{"role": "user", "content": _text(rng, n)}],
                               _span(rng, output_len, range_ratio), n))
    elif dataset == "shared-prefix":
        prefixes = [f"You are assistant number {i}. " + _text(rng, prefix_len)
                    for i in range(num_prefixes)]
        for _ in range(num):
            sys_prompt = rng.choice(prefixes)
            q = _span(rng, max(8, input_len // 8), range_ratio)
            out.append(Request([{"role": "system", "content": sys_prompt},
                                {"role": "user", "content": _text(rng, q)}],
                               _span(rng, output_len, range_ratio), prefix_len + q))
    elif dataset == "random-ids":
        lo, hi = vocab_size // 10, vocab_size - vocab_size // 10
        for _ in range(num):
            n = _span(rng, input_len, range_ratio)
            out.append(Request([], _span(rng, output_len, range_ratio), n,
                               [rng.randrange(lo, hi) for _ in range(n)]))
    else:   # long-mix: 90% short prompts, 10% prompts 8x as long
        for _ in range(num):
            mean = input_len * 8 if rng.random() < 0.1 else input_len
            n = _span(rng, mean, range_ratio)
            out.append(Request([{"role": "user", "content": _text(rng, n)}],
                               _span(rng, output_len, range_ratio), n))
    return out
