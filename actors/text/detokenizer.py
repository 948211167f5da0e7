"""Incremental detokenization and stop-string matching for streamed generation.

Shared by the HTTP gateway and the offline LLM, so it must never import aiohttp or touch the
event loop: plain synchronous classes fed token ids, returning text that is safe to emit.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

# Prompt tokens kept as left context: tokenizers that strip a leading space at the start of a
# decode (SentencePiece) need to see what came before the first generated token.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns token ids into text deltas, one window decode per token.

    Text is released only once it no longer ends in U+FFFD, so a character whose bytes span
    several tokens (emoji, CJK) is never emitted half-done; the deltas joined equal the decode
    of all tokens (`flush()` releases a trailing incomplete character at the end).
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # _ids[prefix:read] decodes to text already emitted; _ids[read:] is not emitted yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._num_context = len(self._ids)
        self.text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add generated tokens; return the newly complete text (possibly empty)."""
        out = []
        for tid in token_ids:
            self._ids.append(tid)
            prefix_text = self._decode(self._ids[self._prefix:self._read])
            new_text = self._decode(self._ids[self._prefix:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                out.append(new_text[len(prefix_text):])
                self._prefix, self._read = self._read, len(self._ids)
        delta = "".join(out)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release whatever is held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


class StopMatcher:
    """Finds stop strings in streamed text, across any split of the text into deltas.

    Text that might be the beginning of a stop string is held back until it is decided; a
    matched stop string is not part of the output (unless `include_stop`, vLLM's
    include_stop_str_in_output) and nothing after it is ever released.
    """

    def __init__(self, stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self._stops = [s for s in stop if s]
        self._include = include_stop
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> str:
        """Feed new text; return the part that can be emitted now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop): first to complete wins
        for s in self._stops:
            start = buf.find(s)
            if start >= 0:
                key = (start + len(s), start, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return buf[:best[0] if self._include else best[1]]
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation: held text never became a stop string, release it."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held


class SampleText:
    """One generated sample's text: detokenizer followed by stop matcher."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop = StopMatcher(stop, include_stop)
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed tokens; return the text to emit now. After a stop string matched, always ''."""
        if self.stopped:
            return ""
        delta = self.stop.push(self.detokenizer.push(token_ids))
        self.text += delta
        return delta

    def finish(self) -> str:
        """Generation ended without a stop string: return the held-back tail."""
        if self.stopped:
            return ""
        delta = self.stop.push(self.detokenizer.flush())
        delta += self.stop.flush() if not self.stopped else ""
        self.text += delta
        return delta
