"""A reasoning model's thinking split from its answer: `--reasoning-parser` (vLLM's names).

Such a model thinks first and closes its thinking with `</think>` (its template usually opens it
with `<think>` in the prompt); the thinking goes to `reasoning_content`, the rest to `content`,
across any split of the stream. A structured output or a forced tool call constrains the answer
only: its grammar follows whatever thinking comes first. Never touches HTTP.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from actors.messages.front_end import StructuredOutput
from gateway.errors import invalid

START, END = "<think>", "</think>"
# Prompt tokens read to see whether the template left the thinking open or closed it already.
_PROMPT_TAIL_TOKENS = 32
# Whitespace a model writes between its thinking and a constrained answer.
_GAP = {"type": "regex", "pattern": "[ \\n]{0,4}"}


@dataclass(frozen=True)
class ReasoningParser:
    """`enable_thinking`: whether `chat_template_kwargs.enable_thinking: false` turns the thinking
    off (Qwen3's switch). A missing `</think>` leaves the whole output thinking (a cut-off answer),
    as vLLM's parsers read it."""
    enable_thinking: bool

    def thinks(self, chat_template_kwargs: dict | None, prompt_tail: str) -> bool:
        """Whether this request's output starts inside the thinking. `prompt_tail`: the end of the
        rendered prompt; a template that closed the thinking there (`<think>\\n\\n</think>`,
        Qwen3's way to turn it off) leaves only an answer to come."""
        if self.enable_thinking and (chat_template_kwargs or {}).get("enable_thinking") is False:
            return False
        return not prompt_tail.rfind(END) > prompt_tail.rfind(START)


PARSERS = {"qwen3": ReasoningParser(enable_thinking=True), "deepseek_r1": ReasoningParser(enable_thinking=False)}


def prompt_tail(tokenizer, prompt: list[int]) -> str:
    return tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)


class ReasoningStream:
    """One choice's text split into (thinking, answer) as it streams. A leading `<think>` the model
    writes itself is dropped; text that may be the start of a tag is held back until decided."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self._held = ""
        self._opened = False   # past where a leading <think> could be

    def push(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        buf = self._held + text
        if not self._opened:
            head = buf.lstrip()
            if START.startswith(head):       # all of it may still become <think>: wait
                self._held = buf
                return "", ""
            self._opened = True
            if head.startswith(START):
                buf = head[len(START):]
        end = buf.find(END)
        if end >= 0:
            self.thinking, self._held = False, ""
            return buf[:end], buf[end + len(END):]
        keep = next((k for k in range(min(len(END) - 1, len(buf)), 0, -1) if buf.endswith(END[:k])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """At the end: held text never became a tag; a model that never closed its thinking only thought."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)


def split(text: str, thinking: bool) -> tuple[str, str]:
    """A whole output's (thinking, answer): the streamed split, at once."""
    stream = ReasoningStream(thinking)
    reasoning, content = stream.push(text)
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content


def after_thinking(spec: StructuredOutput, param: str) -> StructuredOutput:
    """`spec` as the grammar of the answer: any thinking up to `</think>` first, then it."""
    match spec.kind:
        case "json_schema":
            answer = {"type": "json_schema", "json_schema": json.loads(spec.spec)}
        case "json_object":
            answer = {"type": "json_schema", "json_schema": {"type": "object"}}
        case "regex":
            answer = {"type": "regex", "pattern": spec.spec}
        case "grammar":
            answer = {"type": "grammar", "grammar": spec.spec}
        case "choice":
            answer = {"type": "or", "elements": [{"type": "const_string", "value": c}
                                                  for c in json.loads(spec.spec)]}
        case _:   # structural_tag
            tag = json.loads(spec.spec)
            if not isinstance(tag, dict) or "format" not in tag:
                raise invalid(f"With a reasoning parser, `{param}` must be a structural tag with a "
                              "`format` (the legacy `structures`/`triggers` form cannot follow the "
                              "model's thinking).", param=param)
            answer = tag["format"]
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END}
    return StructuredOutput("structural_tag", json.dumps(
        {"type": "structural_tag", "format": {"type": "sequence", "elements": [thinking, _GAP, answer]}},
        ensure_ascii=False))
