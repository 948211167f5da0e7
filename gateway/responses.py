"""OpenAI response bodies (chat and completions, whole and chunked) and their logprobs.

Plain dicts, encoded by msgspec where they are sent; nothing here knows about HTTP or engines.
"""
from __future__ import annotations

import time

from actors.messages.front_end import TokenLogprobs

_MIN_LOGPROB = -9999.0   # JSON has no -inf; vLLM clamps the same way


class TokenStrings:
    """Token id -> its text, cached: logprobs name every sampled and top token."""

    def __init__(self, tokenizer, max_size: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._max = max_size

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if len(self._cache) >= self._max:
                self._cache.clear()
            s = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return s


def token_id_strings(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids`: a token named by its id, which any token can be (a
    token that is half a character has no text of its own)."""
    return f"token_id:{token_id}"


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def chat_logprobs(lps: list[TokenLogprobs] | None, strings: TokenStrings, top_n: int) -> dict | None:
    if lps is None:
        return None
    content = []
    for t in lps:
        s = strings(t.token_id)
        content.append({
            "token": s, "logprob": _lp(t.logprob), "bytes": list(s.encode("utf-8", "replace")),
            "top_logprobs": [{"token": (ts := strings(tid)), "logprob": _lp(lp),
                              "bytes": list(ts.encode("utf-8", "replace"))}
                             for tid, lp in t.top[:top_n]],
        })
    return {"content": content}


def completion_logprobs(lps: list[TokenLogprobs] | None, strings: TokenStrings,
                        text_offset: int) -> dict | None:
    if lps is None:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_offset
    for t in lps:
        s = strings(t.token_id)
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(t.logprob))
        out["top_logprobs"].append({strings(tid): _lp(lp) for tid, lp in t.top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def prompt_logprobs(lps: list[TokenLogprobs], strings: TokenStrings, top_n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a dict from token id
    to its logprob, rank and text, holding the prompt's own token and the top `top_n`."""
    out: list[dict | None] = [None]
    for t in lps:
        entry = {str(tid): {"logprob": _lp(lp), "rank": rank, "decoded_token": strings(tid)}
                 for rank, (tid, lp) in enumerate(t.top[:top_n], start=1)}
        entry.setdefault(str(t.token_id), {"logprob": _lp(t.logprob), "rank": t.rank,
                                           "decoded_token": strings(t.token_id)})
        out.append(entry)
    return out


def echoed_logprobs(prompt_ids: list[int], lps: list[TokenLogprobs], strings: TokenStrings,
                    top_n: int) -> dict:
    """The prompt's part of a completion's logprobs with `echo` (the first token has none)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        s = strings(token_id)
        t = lps[i - 1] if i else None
        out["tokens"].append(s)
        out["token_logprobs"].append(None if t is None else _lp(t.logprob))
        out["top_logprobs"].append(None if t is None else {strings(tid): _lp(lp) for tid, lp in t.top[:top_n]})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in merged:
            merged[k].extend(p[k])
    return merged


class Envelope:
    """id / created / model shared by every chunk of one response."""

    def __init__(self, prefix: str, request_id: str, model: str) -> None:
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model

    def chat_chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def chat(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage}

    def completion(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """`reasoning`: a reasoning model's thinking (None: no reasoning parser); "" means none."""
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      prompt_lps: list | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_lps is not None:
        choice["prompt_logprobs"] = prompt_lps
    return choice
