"""Chat and completion output shapes over one Generation: stream chunks and the whole response.

One class per endpoint, so the streaming loop and the collecting loop are written once.
"""
from __future__ import annotations

from gateway.generation import ChoiceDelta
from gateway.responses import (Envelope, TokenStrings, chat_choice, chat_delta, chat_logprobs,
                               completion_choice, completion_logprobs, echoed_logprobs,
                               merge_completion_logprobs, prompt_logprobs)
from gateway.reasoning import ReasoningStream, split
from gateway.tool_parsers import ToolCallStream


class _Collected:
    __slots__ = ("texts", "finish", "logprobs")

    def __init__(self, num_choices: int) -> None:
        self.texts = [""] * num_choices
        self.finish: list[str | None] = [None] * num_choices
        self.logprobs: list[list] = [[] for _ in range(num_choices)]


class ChatFormat:
    """`tool_parser` (gateway/tool_parsers.py): the output is parsed for tool calls. `echo` (vLLM's):
    text each reply starts with, the open assistant message it continues. `thinking` (with a
    reasoning parser, gateway/reasoning.py): the output starts inside the model's thinking, which
    goes to `reasoning_content`; None: no reasoning parser. Tool calls are parsed in the answer."""

    def __init__(self, env: Envelope, strings: TokenStrings, num_choices: int,
                 top_logprobs: int | None, prompt_top: int | None = None, tool_parser=None,
                 echo: str | None = None, thinking: bool | None = None) -> None:
        self.env, self.strings, self.top = env, strings, top_logprobs
        self.echo = echo
        self.thinking = thinking
        self.reasoning_streams = [ReasoningStream(thinking) for _ in range(num_choices)] \
            if thinking is not None else None
        self.num_choices = num_choices
        self.acc = _Collected(num_choices)
        self.prompt_top = prompt_top
        self._prompt_lps: list | None = None   # the response's, from the first delta carrying them
        self.tool_parser = tool_parser
        self.tool_streams = [ToolCallStream(tool_parser) for _ in range(num_choices)] if tool_parser else None

    def _take_prompt_lps(self, cd: ChoiceDelta) -> list | None:
        if self.prompt_top is None or cd.prompt_logprobs is None or self._prompt_lps is not None:
            return None
        self._prompt_lps = prompt_logprobs(cd.prompt_logprobs, self.strings, self.prompt_top)
        return self._prompt_lps

    def first_events(self) -> list[dict]:
        events = [self.env.chat_chunk([chat_delta(i, {"role": "assistant", "content": ""}, None, None)
                                       for i in range(self.num_choices)])]
        if self.echo:
            events.append(self.env.chat_chunk([chat_delta(i, {"content": self.echo}, None, None)
                                               for i in range(self.num_choices)]))
        return events

    def chunk(self, cd: ChoiceDelta) -> dict | None:
        lp = chat_logprobs(cd.logprobs, self.strings, self.top) if self.top is not None else None
        prompt_lps = self._take_prompt_lps(cd)
        reasoning, text = self._reasoning_delta(cd)
        finish, calls = cd.finish_reason, None
        if self.tool_streams is not None:
            text, finish, calls = self._tool_delta(cd, text)
        # A token whose text is held back (half a character, a possible stop string) is a chunk of its
        # own, as vLLM streams it: a client sees each token as it comes. Not where a tool parser holds it.
        token = bool(cd.token_ids) and self.tool_streams is None
        if not text and not reasoning and not token and finish is None and not lp and prompt_lps is None:
            return None
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if text or (token and not reasoning):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        chunk = self.env.chat_chunk([chat_delta(cd.index, delta, finish, lp)])
        if prompt_lps is not None:
            chunk["prompt_logprobs"] = prompt_lps
        return chunk

    def _reasoning_delta(self, cd: ChoiceDelta) -> tuple[str, str]:
        """This delta's (thinking, answer) text; all answer without a reasoning parser."""
        if self.reasoning_streams is None:
            return "", cd.text
        stream = self.reasoning_streams[cd.index]
        reasoning, text = stream.push(cd.text)
        if cd.finish_reason is not None:
            more_reasoning, more_text = stream.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        return reasoning, text

    def _tool_delta(self, cd: ChoiceDelta, text: str) -> tuple[str, str | None, list[dict] | None]:
        stream = self.tool_streams[cd.index]
        text = stream.push(text)
        if cd.finish_reason is None:
            return text, None, None
        text += stream.finish()
        if not stream.calls:
            return text, cd.finish_reason, None
        calls = [c.as_api(i) for i, c in enumerate(stream.calls)]
        return text, "tool_calls" if cd.finish_reason == "stop" else cd.finish_reason, calls

    def usage_event(self, usage: dict) -> dict:
        return self.env.chat_chunk([], usage)

    def add(self, cd: ChoiceDelta) -> None:
        a = self.acc
        a.texts[cd.index] += cd.text
        a.finish[cd.index] = cd.finish_reason or a.finish[cd.index]
        if cd.logprobs and self.top is not None:
            a.logprobs[cd.index].extend(chat_logprobs(cd.logprobs, self.strings, self.top)["content"])
        self._take_prompt_lps(cd)

    def whole(self, usage: dict) -> dict:
        a = self.acc
        choices = []
        for i in range(self.num_choices):
            text, finish, calls, reasoning = a.texts[i], a.finish[i], None, None
            if self.thinking is not None:
                reasoning, text = split(text, self.thinking)
            text = (self.echo or "") + text
            if self.tool_parser is not None:
                content, found = self.tool_parser.parse(text)
                if found:
                    text, calls = content, [c.as_api() for c in found]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(chat_choice(i, text, finish,
                                       {"content": a.logprobs[i]} if self.top is not None else None, calls,
                                       reasoning))
        body = self.env.chat(choices, usage)
        if self.prompt_top is not None:
            body["prompt_logprobs"] = self._prompt_lps
        return body


class CompletionFormat:
    """`echo` holds each choice's prompt text, put before its completion (and with `logprobs`, the
    prompt tokens' logprobs before the completion's); `prompt_ids` are each choice's prompt tokens."""

    def __init__(self, env: Envelope, strings: TokenStrings, num_choices: int,
                 logprobs: int | None, echo: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None, prompt_top: int | None = None) -> None:
        self.env, self.strings, self.logprobs = env, strings, logprobs
        self.num_choices = num_choices
        self.acc = _Collected(num_choices)
        self.echo, self.prompt_ids, self.prompt_top = echo, prompt_ids, prompt_top
        self._offsets = [len(e) for e in echo] if echo is not None else [0] * num_choices
        self._started = [False] * num_choices
        self._prompt_lps: list[list | None] = [None] * num_choices

    def first_events(self) -> list[dict]:
        return []

    def _lp(self, cd: ChoiceDelta) -> dict | None:
        if self.logprobs is None or cd.logprobs is None:
            return None
        lp = completion_logprobs(cd.logprobs, self.strings, self._offsets[cd.index])
        for tops in lp["top_logprobs"]:   # the engine returns k tops; trim to what was asked
            while len(tops) > self.logprobs:
                tops.popitem()
        return lp

    def _piece(self, cd: ChoiceDelta) -> tuple[str, dict | None, list | None]:
        """This delta's text and logprobs, after the echoed prompt on a choice's first delta; and
        the choice's prompt_logprobs, on that delta."""
        text, lp, prompt_lps, i = cd.text, self._lp(cd), None, cd.index
        if not self._started[i]:
            self._started[i] = True
            if self.echo is not None:
                text = self.echo[i] + text
                if self.logprobs is not None and cd.prompt_logprobs is not None:
                    head = echoed_logprobs(self.prompt_ids[i], cd.prompt_logprobs, self.strings, self.logprobs)
                    lp = merge_completion_logprobs([head, lp]) if lp is not None else head
            if self.prompt_top is not None and cd.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs(cd.prompt_logprobs, self.strings, self.prompt_top)
        self._offsets[i] += len(cd.text)
        return text, lp, prompt_lps

    def chunk(self, cd: ChoiceDelta) -> dict | None:
        text, lp, prompt_lps = self._piece(cd)
        # A token whose text is held back is a chunk of its own, as in ChatFormat.chunk.
        if not text and not cd.token_ids and cd.finish_reason is None and not lp and prompt_lps is None:
            return None
        return self.env.completion([completion_choice(cd.index, text, cd.finish_reason, lp, prompt_lps)])

    def usage_event(self, usage: dict) -> dict:
        return self.env.completion([], usage)

    def add(self, cd: ChoiceDelta) -> None:
        a = self.acc
        text, lp, prompt_lps = self._piece(cd)
        a.texts[cd.index] += text
        a.finish[cd.index] = cd.finish_reason or a.finish[cd.index]
        if lp is not None:
            a.logprobs[cd.index].append(lp)
        if prompt_lps is not None:
            self._prompt_lps[cd.index] = prompt_lps

    def whole(self, usage: dict) -> dict:
        a = self.acc
        return self.env.completion([
            completion_choice(i, a.texts[i], a.finish[i],
                              merge_completion_logprobs(a.logprobs[i])
                              if self.logprobs is not None else None,
                              self._prompt_lps[i] if self.prompt_top is not None else None)
            for i in range(self.num_choices)], usage)
