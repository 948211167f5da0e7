"""Anthropic's Messages API output: the whole message, the named stream events and the error body,
built from the chat output that gateway/formats.py's ChatFormat gives; and their schemas (structs)
for /openapi.json. Plain dicts out, nothing here knows about HTTP or engines.
"""
from __future__ import annotations

import json
from typing import Any, Union

import msgspec

from gateway.errors import APIError

# Anthropic's error type per HTTP status; 503 (no engine, draining, engine lost) is its "overloaded".
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    type: str
    error: AnthropicErrorDetail
    request_id: str | None = None


class AnthropicUsage(msgspec.Struct):
    input_tokens: int            # the prompt's tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int | None = None


class AnthropicText(msgspec.Struct, tag="text"):
    text: str


class AnthropicToolUse(msgspec.Struct, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class AnthropicMessage(msgspec.Struct):
    id: str
    type: str
    role: str
    model: str
    content: list[Union[AnthropicText, AnthropicToolUse]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(msgspec.Struct):
    input_tokens: int


def error_body(e: APIError, request_id: str | None = None) -> dict:
    """Anthropic's shape has no `param`: the message starts with the field, as Anthropic's do."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": request_id}


def usage(u: dict) -> dict:
    """Anthropic counts cached prompt tokens apart from `input_tokens`; their sum is the prompt."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached}


def stop_reason(finish_reason: str | None, stop_string: str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason and the stop string that ended it."""
    if stop_string is not None:
        return "stop_sequence", stop_string
    return {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn",
            None: None}.get(finish_reason, "end_turn"), None


def message_id(chat_id: str) -> str:
    """Anthropic's `msg_` ids, from the chat envelope's `msg-<request id>`."""
    return "msg_" + chat_id.removeprefix("msg-")


def tool_use(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block; its id in Anthropic's `toolu_` form."""
    f = call["function"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("chatcmpl-tool-"),
            "name": f["name"], "input": json.loads(f["arguments"])}


def _head(chat_id: str, model: str, content: list, reason: tuple, u: dict) -> dict:
    return {"id": message_id(chat_id), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason[0], "stop_sequence": reason[1], "usage": u}


def message(chat: dict, stop_string: str | None) -> dict:
    """The whole message, from ChatFormat.whole's body (one choice)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content = [{"type": "text", "text": msg["content"]}] if msg["content"] else []
    content += [tool_use(c) for c in msg.get("tool_calls") or ()]
    return _head(chat["id"], chat["model"], content, stop_reason(choice["finish_reason"], stop_string),
                 usage(chat["usage"]))


class MessageEvents:
    """A streamed message's events, from ChatFormat.chunk's chunks: text goes out in one text block
    as it comes, each tool call as a tool_use block of its own (whole, as the chunks carry it)."""

    def __init__(self, chat_id: str, model: str) -> None:
        self.chat_id, self.model = chat_id, model
        self._blocks = 0
        self._text_open = False

    def start(self, u: dict) -> list[tuple[str, dict]]:
        head = _head(self.chat_id, self.model, [], (None, None), {**usage(u), "output_tokens": 0})
        return [("message_start", {"type": "message_start", "message": head}), ("ping", {"type": "ping"})]

    def chunk(self, chunk: dict) -> list[tuple[str, dict]]:
        delta = chunk["choices"][0]["delta"]
        events = []
        if text := delta.get("content"):
            if not self._text_open:
                events.append(self._open({"type": "text", "text": ""}))
                self._text_open = True
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            events += self._close()
            block = tool_use(call)
            events.append(self._open({**block, "input": {}}))
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": json.dumps(block["input"], ensure_ascii=False)}))
            events += self._close(force=True)
        return events

    def finish(self, finish_reason: str | None, stop_string: str | None, u: dict) -> list[tuple[str, dict]]:
        reason, sequence = stop_reason(finish_reason, stop_string)
        return self._close() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": usage(u)}),
            ("message_stop", {"type": "message_stop"})]

    def _open(self, block: dict) -> tuple[str, dict]:
        return "content_block_start", {"type": "content_block_start", "index": self._blocks, "content_block": block}

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self._blocks, "delta": delta}

    def _close(self, force: bool = False) -> list[tuple[str, dict]]:
        if not (self._text_open or force):
            return []
        self._text_open = False
        self._blocks += 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]
