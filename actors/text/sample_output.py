"""One sample's output at a front end, from the engine's TokenDeltas: the text they make and how it ended.

The one output processor of the gateway (gateway/generation.py, a choice of an HTTP request) and the offline
LLM (actors/llm.py, a CompletionOutput): incremental detokenization, stop strings (the sample ends "stop" at
the one that completes first, and the engine is to be told to abort it), the engine's own finish (its reason,
its error, the stop token that ended it), and the held-back tail released at the end.
"""
from __future__ import annotations

from typing import Sequence

from actors.messages.front_end import TokenDelta
from actors.text.detokenizer import Decoder, SampleText


class SampleOutput:
    """Fed each TokenDelta of one sample in order; `push` returns the text it adds.

    `streamed=False` (the offline LLM): without stop strings no text is needed before the end, so the tokens
    are decoded once, when the engine finishes the sample, instead of one window decode per token."""

    __slots__ = ("_sample", "_tokenizer", "_skip_special", "_stop_token_ids", "token_ids", "finish_reason",
                 "stop_reason", "error", "engine_done")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 stop_token_ids: Sequence[int] = (), streamed: bool = True) -> None:
        self._sample = SampleText(tokenizer, prompt_token_ids, stop, skip_special_tokens, include_stop) \
            if streamed or any(stop) else None
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None   # "stop", "length", "error", "abort": set once
        self.stop_reason: str | int | None = None   # the stop string matched, or the stop token that ended it
        self.error: str | None = None
        self.engine_done = False                 # the engine sent this sample's last delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_here(self) -> bool:
        """Ended by a stop string while the engine still runs it: abort it there."""
        return self.finish_reason == "stop" and not self.engine_done and isinstance(self.stop_reason, str)

    @property
    def text(self) -> str:
        """All the text so far (the whole text once finished)."""
        if self._sample is not None:
            return self._sample.text
        return self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special) \
            if self.finished else ""

    @property
    def stop_string(self) -> str | None:
        return self._sample.stop.matched if self._sample is not None else None

    def push(self, d: TokenDelta) -> str:
        """The text `d` adds. After the sample finished here, only whether the engine is done is noted."""
        if self.finished:
            self.engine_done = self.engine_done or d.finish_reason is not None
            return ""
        self.token_ids.extend(d.token_ids)
        text = self._sample.push(d.token_ids) if self._sample is not None else ""
        if self._sample is not None and self._sample.stopped:   # vLLM keeps the tokens up to the one completing it
            self.finish_reason, self.stop_reason = "stop", self._sample.stop.matched
            self.engine_done = d.finish_reason is not None
        elif d.finish_reason is not None:
            if self._sample is not None:
                text += self._sample.finish()
            self.finish_reason, self.error, self.engine_done = d.finish_reason, d.error, True
            if d.finish_reason == "stop" and d.token_ids and d.token_ids[-1] in self._stop_token_ids:
                self.stop_reason = d.token_ids[-1]
        return text

    def end(self, reason: str, error: str | None = None, engine_done: bool = False) -> None:
        """Ended otherwise than by its tokens (a failure, the engine stopped): what came so far stands."""
        if not self.finished:
            if self._sample is not None:
                self._sample.finish()
            self.finish_reason, self.error = reason, error
        self.engine_done = self.engine_done or engine_done
