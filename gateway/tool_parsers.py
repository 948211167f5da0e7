"""Tool calls in a model's output text, by format (vLLM's `--tool-call-parser` names):

- `hermes` (Hermes, Qwen): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag
  per call; the text before the first tag is the message's content.
- `llama3_json` (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` (or
  "arguments"), several separated by `;`, optionally after `<|python_tag|>`.

Each parser also gives the output format a forced call must take (`call_format`), which the
structured-output engine enforces for `tool_choice` required or named, and the format of calls the
model may make (`triggered_format`: free text until the call's opening, then a valid call), which
it enforces under `tool_choice` auto when a function is `strict`. `ToolCallStream` turns
streamed text into content deltas and whole calls, holding back only what may begin a call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str   # JSON text, as the API carries it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def as_api(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _arguments(tool: dict) -> dict:
    # At most one blank between tokens: a free run of whitespace lets a small model idle to max_tokens.
    return {"type": "json_schema", "json_schema": tool["parameters"], "max_whitespace_cnt": 1}


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); a tag that does not hold a call stays in the content."""
        calls = []
        for m in self._CALL.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = text[:text.index(self.OPEN)].strip()
        return content or None, calls

    def split(self, text: str) -> int:
        """Where calls may begin in `text`: the open tag, or a tail that could grow into one."""
        i = text.find(self.OPEN)
        if i >= 0:
            return i
        for k in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def begins(self, text: str) -> bool:
        return text.startswith(self.OPEN)

    TRIGGER = OPEN

    def tags(self, tools: list[dict]) -> list[dict]:
        return [{"type": "tag", "begin": f'{self.OPEN}\n{{"name": {json.dumps(t["name"])}, "arguments": ',
                 "content": _arguments(t), "end": f"}}\n{self.CLOSE}"} for t in tools]

    def call_format(self, tools: list[dict], parallel: bool) -> dict:
        return {"type": "tags_with_separator", "tags": self.tags(tools), "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}

    def triggered_format(self, tools: list[dict], parallel: bool) -> dict:
        return _triggered(self.TRIGGER, self.tags(tools), parallel)


class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def split(self, text: str) -> int:
        """A call fills the whole output: it may begin only at the start."""
        head = text.lstrip()
        if not head or head.startswith("{") or self.PYTHON_TAG.startswith(head[:len(self.PYTHON_TAG)]):
            return 0
        return len(text)

    def begins(self, text: str) -> bool:
        head = text.lstrip()
        return head.startswith("{") or head.startswith(self.PYTHON_TAG)

    TRIGGER = '{"name": '

    def tags(self, tools: list[dict]) -> list[dict]:
        return [{"type": "tag", "begin": f'{{"name": {json.dumps(t["name"])}, "parameters": ',
                 "content": _arguments(t), "end": "}"} for t in tools]

    def call_format(self, tools: list[dict], parallel: bool) -> dict:
        return {"type": "tags_with_separator", "tags": self.tags(tools), "separator": "; ", "at_least_one": True,
                "stop_after_first": not parallel}

    def triggered_format(self, tools: list[dict], parallel: bool) -> dict:
        return _triggered(self.TRIGGER, self.tags(tools), parallel)


def _triggered(trigger: str, tags: list[dict], parallel: bool) -> dict:
    """Free text, in which `trigger` may only open one of `tags` (a call), held to its schema."""
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
            "stop_after_first": not parallel}


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


class ToolCallStream:
    """One choice's streamed text: content goes out as it comes, up to where a call may begin;
    from a call's start on, the text is held and parsed when the sample ends (a held text that
    turns out to be no call is sent as content then)."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self._held = ""
        self._holding = False
        self.calls: list[ParsedCall] = []

    def push(self, text: str) -> str:
        """The content that can go out now."""
        if self._holding:
            self._held += text
            return ""
        text = self._held + text
        cut = self.parser.split(text)
        self._held = text[cut:]
        self._holding = self.parser.begins(self._held)
        return text[:cut]

    def finish(self) -> str:
        """The content left at the end; `calls` then holds the calls found."""
        held, self._held = self._held, ""
        content, self.calls = self.parser.parse(held) if held else (None, [])
        return "" if self.calls else held
