"""Grammars compiled against the model's tokenizer, once per structured output, for the worker.

Compiling takes milliseconds to a second (the tokenizer's own table: ~0.2 s for SmolLM2, once; a
39 KB regex of 5,000 alternatives ~0.65 s on one Zen 3 core), so the worker calls `compile` on a
thread before a step that starts a constrained sequence, never on the event loop, and waits for it
at most COMPILE_TIMEOUT_S (the step waits too); the step then finds the result here. A grammar
that fails, or that overran, is remembered as its error, so a sequence that asks again fails
alone, at once. An overrunning compile finishes on its thread and replaces its error with the
grammar, so a later request for it is served.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from actors.text.grammar import engine_message, grammar_of
from actors.messages.front_end import StructuredOutput
from actors.worker.grammar_state import GrammarState

CACHE_SIZE = 256   # compiled grammars kept (least recently used go first)
COMPILE_TIMEOUT_S = 10.0   # how long a step waits for a grammar before its sequence fails


class GrammarCompiler:
    """`hf_tokenizer()` gives the transformers tokenizer (called on the first compile's thread: it
    may load it); `vocab_size` is the logits' width (ids past the tokenizer's are never allowed);
    the grammars end on `stop_token_ids` (the engine's EOS ids)."""

    def __init__(self, hf_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        # Compile threads and the compute thread share the cache; the lock is never held while
        # compiling, so a slow grammar holds up no other sequence's.
        self._lock = threading.Lock()
        self._engine_lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> None:
        """Compiles `spec` into the cache (a thread's work: it may take a while)."""
        with self._lock:
            if spec in self._cache and not isinstance(self._cache[spec], TimeoutError):
                self._cache.move_to_end(spec)
                return
        try:
            compiled: Any = self._engine().compile_grammar(grammar_of(spec))
        except (RuntimeError, ValueError) as e:
            compiled = ValueError(engine_message(e))
        self._store(spec, compiled)

    def overran(self, spec: StructuredOutput, timeout_s: float) -> None:
        """`spec` did not compile within `timeout_s`: its sequences fail until the compile that is
        still running finishes (and replaces this)."""
        with self._lock:
            if spec not in self._cache:
                self._cache[spec] = TimeoutError(f"the grammar did not compile within {timeout_s:g} s")
                self._evict()

    def _store(self, spec: StructuredOutput, compiled: Any) -> None:
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            self._evict()

    def _evict(self) -> None:
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def is_compiled(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def state(self, spec: StructuredOutput) -> GrammarState:
        """A new sequence's matcher; raises ValueError when `spec` does not compile, or did not
        within the time the worker gave it."""
        with self._lock:
            compiled = self._cache.get(spec)
        if compiled is None:   # evicted since the worker compiled it
            self.compile(spec)
            with self._lock:
                compiled = self._cache[spec]
        if isinstance(compiled, TimeoutError):
            raise ValueError(str(compiled))
        if isinstance(compiled, ValueError):
            raise compiled
        return GrammarState(compiled)

    def _engine(self):
        with self._engine_lock:
            return self._engine_locked()

    def _engine_locked(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._hf(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler
