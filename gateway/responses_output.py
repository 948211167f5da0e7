"""A chat completion's chunks (formats.ChatFormat.chunk) turned into a Response object and its
stream of named events: response.created ... response.completed.

Whole and streamed responses are built by the same feed, so the two cannot disagree. The message
item opens at the first text that is not blank: text that is only whitespace before tool calls
makes no message, as in the chat response where the parser leaves such content empty.

With `logprobs` (the request's include of message.output_text.logprobs), each token's logprob and
its alternatives, as the chat chunks carry them, ride on the text delta that shows the token (a
token whose text is held back, a possible stop string, waits for the next text), and the whole
list is the output_text part's `logprobs`.
"""
from __future__ import annotations

import time
import uuid

from gateway import protocol

Event = tuple[str, dict]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict) -> dict:
    """Chat usage in the Responses API's names."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


class ResponseBuilder:
    """`fields`: what every copy of the Response object carries besides its status, output and
    usage (the id, the model, the request's settings echoed)."""

    def __init__(self, fields: dict, logprobs: bool = False) -> None:
        self.fields = {"id": _item_id("resp"), "object": "response", "created_at": int(time.time()), **fields}
        self.seq = 0
        self.text = ""
        self.pending = ""        # leading whitespace, shown once text that is not comes
        self.message_id: str | None = None
        self.calls: list[dict] = []   # chat tool calls: {"id", "function": {"name", "arguments"}}
        self.finish_reason: str | None = None
        self.output: list[dict] = []
        self.logprobs = logprobs
        self.token_lps: list[dict] = []     # every token's, the output_text part's `logprobs`
        self.waiting_lps: list[dict] = []   # those whose text no delta has shown yet

    @property
    def id(self) -> str:
        return self.fields["id"]

    def _event(self, type_: str, **fields) -> Event:
        event = (type_, {"type": type_, "sequence_number": self.seq, **fields})
        self.seq += 1
        return event

    def response(self, status: str, usage_: dict | None = None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.fields, "status": status, "error": error, "incomplete_details": incomplete,
                "output": list(self.output), "usage": usage_}

    def start(self) -> list[Event]:
        body = self.response("in_progress")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def feed(self, chunk: dict) -> list[Event]:
        """One chat chunk (one choice) in; the events it makes out."""
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if self.logprobs and choice.get("logprobs"):
            lps = choice["logprobs"]["content"]
            self.token_lps += lps
            self.waiting_lps += lps
        events = self._text(delta.get("content") or "")
        self.calls += delta.get("tool_calls") or []
        self.finish_reason = choice["finish_reason"] or self.finish_reason
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = []
        if self.message_id is None:
            self.pending += text
            if not self.pending.strip():
                return []
            text, self.pending = self.pending, ""
            events += self._open_message()
        events.append(self._delta(text))
        return events

    def _delta(self, text: str) -> Event:
        self.text += text
        lps, self.waiting_lps = self.waiting_lps, []
        return self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                           content_index=0, delta=text, logprobs=[_delta_logprob(lp) for lp in lps])

    def _open_message(self) -> list[Event]:
        self.message_id = _item_id("msg")
        item = {"id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                            content_index=0, part=_part(""))]

    def finish(self, chat_usage: dict) -> tuple[list[Event], dict]:
        """The closing events, the terminal one last, and the whole Response object."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events: list[Event] = []
        if self.message_id is None and not self.calls:   # a reply of blanks, or of nothing, is still a message
            events += self._open_message()
        if self.pending and self.message_id is not None:
            events += self._text_now(self.pending)
        if self.message_id is not None:
            part = _part(self.text, self.token_lps)
            item = {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": [part]}
            at = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            events += [self._event("response.output_text.done", **at, text=self.text,
                                   logprobs=[_delta_logprob(lp) for lp in self.token_lps]),
                       self._event("response.content_part.done", **at, part=part),
                       self._event("response.output_item.done", output_index=0, item=item)]
            self.output.append(item)
        for call in self.calls:
            events += self._call(call)
        body = self.response(status, usage(chat_usage))
        events.append(self._event(f"response.{status}", response=body))
        return events, body

    def _text_now(self, text: str) -> list[Event]:
        self.pending = ""
        return [self._delta(text)]

    def _call(self, call: dict) -> list[Event]:
        index, fid = len(self.output), _item_id("fc")
        fn = call["function"]
        item = {"id": fid, "type": "function_call", "status": "in_progress", "call_id": call["id"],
                "name": fn["name"], "arguments": ""}
        done = {**item, "status": "completed", "arguments": fn["arguments"]}
        self.output.append(done)
        at = {"item_id": fid, "output_index": index}
        return [self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.function_call_arguments.delta", **at, delta=fn["arguments"]),
                self._event("response.function_call_arguments.done", **at, arguments=fn["arguments"]),
                self._event("response.output_item.done", output_index=index, item=done)]

    def failed(self, error: dict) -> list[Event]:
        """An error after the stream began: OpenAI's `error` event, then response.failed."""
        events = [self._event("error", code=error["code"], message=error["message"], param=error["param"])]
        body = self.response("failed", error={"code": error["code"] or "server_error", "message": error["message"]})
        return events + [self._event("response.failed", response=body)]

    def assistant_message(self) -> protocol.ChatMessage:
        """The output as the chat message that continues the conversation."""
        calls = [protocol.ToolCall(function=protocol.FunctionCall(c["function"]["name"], c["function"]["arguments"]),
                                   id=c["id"]) for c in self.calls]
        text = self.text if self.message_id is not None else None
        return protocol.ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def _delta_logprob(lp: dict) -> dict:
    """A chat logprob in a delta event's shape: token, logprob and alternatives, without bytes."""
    return {"token": lp["token"], "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]]}
