"""Grammars compiled against the model's tokenizer, once per structured output, for the worker.

Compiling takes milliseconds to a second (the tokenizer's own table: ~0.2 s for SmolLM2, once),
so the worker calls `compile` on a thread before a step that starts a constrained sequence, never
on the event loop; the step then finds the result here. A grammar that fails is remembered as its
error, so a sequence that asks again fails alone, at once.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from actors.grammar import engine_message, grammar_of
from actors.messages import StructuredOutput
from actors.worker.grammar_state import GrammarState

CACHE_SIZE = 256   # compiled grammars kept (least recently used go first)


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
        self._lock = threading.Lock()   # compile threads and the compute thread share the cache

    def compile(self, spec: StructuredOutput) -> None:
        """Compiles `spec` into the cache (a thread's work: it may take a while)."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return
            try:
                compiled: Any = self._engine().compile_grammar(grammar_of(spec))
            except (RuntimeError, ValueError) as e:
                compiled = ValueError(engine_message(e))
            self._cache[spec] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def is_compiled(self, spec: StructuredOutput) -> bool:
        with self._lock:
            return spec in self._cache

    def state(self, spec: StructuredOutput) -> GrammarState:
        """A new sequence's matcher; raises ValueError when `spec` does not compile."""
        self.compile(spec)
        with self._lock:
            compiled = self._cache[spec]
        if isinstance(compiled, ValueError):
            raise compiled
        return GrammarState(compiled)

    def _engine(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._hf(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler
