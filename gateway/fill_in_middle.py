"""`suffix` on /v1/completions: fill-in-the-middle, for models whose tokenizer has FIM tokens.

The prompt becomes prefix-suffix-middle (PSM), the order Qwen2.5-Coder, StarCoder and DeepSeek-Coder
were trained on: <fim_prefix> prompt <fim_suffix> suffix <fim_middle>, and the model writes the
middle. A model without such tokens gets a 400, as OpenAI and vLLM answer.
"""
from __future__ import annotations

from gateway.errors import invalid

# (prefix, suffix, middle) token spellings, by family.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),   # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),         # StarCoder, SantaCoder, SmolLM
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),       # DeepSeek-Coder
)


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """The model's (prefix, suffix, middle) token ids, or None when it has none."""
    vocab = tokenizer.hf.get_vocab()
    for names in FIM_TOKENS:
        if all(n in vocab for n in names):
            return tuple(vocab[n] for n in names)
    return None


def fim_prompt(tokenizer, prompt: str | list[int], suffix: str) -> list[int]:
    ids = fim_token_ids(tokenizer)
    if ids is None:
        raise invalid("This model has no fill-in-the-middle tokens, so `suffix` is not supported.",
                      param="suffix")
    pre, suf, mid = ids
    body = prompt if isinstance(prompt, list) else tokenizer.encode(prompt, add_special_tokens=False)
    return [pre, *body, suf, *tokenizer.encode(suffix, add_special_tokens=False), mid]
