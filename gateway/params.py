"""From a validated request to the engine's SamplingParams, with the checks that need the engine:
the context length, `top_k` against the vocabulary, `priority` only where the engine honours it,
and the number of sequences one request may add to the queue.

`max_tokens` defaults as vLLM does: the rest of the context for chat, 16 for completions, unless the
operator set --max-tokens-default; --max-tokens-limit caps what a request may ask for (a 400 beyond
it) and what it gets by default. vLLM's sampling extensions (allowed_token_ids, bad_words,
include_stop_str_in_output) and its prompt truncation are turned into the engine's terms here too.
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.messages.front_end import SamplingParams, StructuredOutput
from gateway.errors import invalid
from gateway.protocol import MAX_SEQUENCES, _Common, stop_list, token_ids_checked

COMPLETION_DEFAULT_MAX_TOKENS = 16


def priority_checked(priority: int | None, engine) -> None:
    """A non-zero `priority` only where the engine orders its queue by it, as vLLM refuses it."""
    if priority and not engine.priority_scheduling:
        raise invalid(f"Got priority {priority}, but priority scheduling is not enabled "
                      "(start the engine with --scheduling-policy priority).", param="priority")


def truncated(prompt: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: only the prompt's last `keep` tokens (-1: the context)."""
    if keep is None:
        return prompt
    if keep == -1:
        keep = max_model_len
    elif keep > max_model_len:
        raise invalid(f"`truncate_prompt_tokens` ({keep}) is larger than this model's maximum context "
                      f"length ({max_model_len}).", param="truncate_prompt_tokens")
    return prompt[-keep:]


def bad_words_token_ids(tokenizer, words) -> list[list[int]]:
    """Each bad word as the token sequences that spell it: alone, and after a space where that
    makes other tokens of the same count (a word-initial token), as vLLM tokenizes them."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


@dataclass(frozen=True)
class MaxTokens:
    """What a request asked for (`asked`, in its field `param`), what it gets when it asked for
    nothing (`default`: None is the rest of the context), and the operator's cap (`limit`)."""
    asked: int | None
    param: str = "max_tokens"
    default: int | None = None
    limit: int | None = None

    def checked(self) -> int | None:
        if self.asked is not None and self.limit is not None and self.asked > self.limit:
            raise invalid(f"`{self.param}` is {self.asked}, but this server allows at most {self.limit} "
                          f"tokens per completion (--max-tokens-limit).", param=self.param,
                          code="max_tokens_over_limit")
        return self.asked

    def resolved(self, room: int) -> int:
        """The request's max_tokens, given the `room` its context leaves."""
        if self.asked is not None:
            return self.asked
        wanted = room if self.default is None else min(self.default, room)
        return wanted if self.limit is None else min(wanted, self.limit)


def sampling_params(req: _Common, prompts: list[list[int]], budget: MaxTokens, engine,
                    prompt_param: str, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    """`engine` is the gateway's EngineHandle (max_model_len, tokenizer, priority_scheduling)."""
    asked = budget.checked()
    max_model_len = engine.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens, but the "
                      f"prompt has {longest} tokens; no room is left for the completion.",
                      param=prompt_param, code="context_length_exceeded")
    room = max_model_len - longest
    max_tokens = budget.resolved(room)
    if asked is not None and longest + asked > max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, "
                      f"you requested {longest + max_tokens} tokens ({longest} in the "
                      f"{prompt_param}, {max_tokens} for the completion). Please reduce the length "
                      f"of the {prompt_param} or the completion.",
                      param=prompt_param, code="context_length_exceeded")
    n = req.n or 1
    if n * len(prompts) > MAX_SEQUENCES:
        raise invalid(f"{len(prompts)} prompts x n={n} is {n * len(prompts)} sequences; at most "
                      f"{MAX_SEQUENCES} are allowed per request.", param="n")
    vocab = engine.tokenizer.vocab_size
    if req.top_k is not None and req.top_k > vocab:
        raise invalid(f"`top_k` must be at most the vocabulary size ({vocab}), got {req.top_k}.",
                      param="top_k")
    bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
    token_ids_checked(bias, vocab, "logit_bias")
    token_ids_checked(req.stop_token_ids or (), vocab, "stop_token_ids")
    token_ids_checked(req.allowed_token_ids or (), vocab, "allowed_token_ids")
    if req.min_tokens and req.min_tokens > max_tokens:
        raise invalid(f"`min_tokens` ({req.min_tokens}) must be at most max_tokens ({max_tokens}).",
                      param="min_tokens")
    priority_checked(req.priority, engine)
    try:
        return SamplingParams(
            n=n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            stop=stop_list(req.stop),
            ignore_eos=bool(req.ignore_eos),
            seed=req.seed,
            logprobs=logprobs,
            stop_token_ids=list(req.stop_token_ids or ()),
            logit_bias=bias,
            min_tokens=req.min_tokens or 0,
            skip_special_tokens=req.skip_special_tokens is not False,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            allowed_token_ids=list(req.allowed_token_ids or ()),
            bad_words_token_ids=bad_words_token_ids(engine.tokenizer, req.bad_words or ()),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
        )
    except ValueError as e:   # the engine's own checks, should a range here be missed
        raise invalid(str(e)) from None
