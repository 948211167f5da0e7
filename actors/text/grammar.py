"""Structured outputs as grammars: what a StructuredOutput means, checked without a tokenizer.

The grammar engine is xgrammar, chosen over llguidance by measurement on the default model's
tokenizer (SmolLM2, a 49k-token GPT-2-style BPE) on a 2-core AMD EPYC, along a 55-token JSON
document for a schema with nested objects, enums and arrays (two runs each):
- tokenizer setup: xgrammar 176-200 ms, llguidance 435-461 ms;
- a token mask: xgrammar 4-6 us mean, 8-13 us p90, 146 us worst; llguidance 38-89 us mean,
  28-32 us p90, 4-11 ms worst (it builds its lexer lazily while the first tokens are masked);
- a schema: xgrammar compiles it in 6-10 ms, llguidance in 1.5-3 ms.
A schema is compiled once (cached) and a mask is paid on every token of every constrained row,
so the mask decides. The gateway checks a request's grammar here (a bad schema is a 400 naming
the problem); the worker compiles it against the tokenizer (actors/worker/grammar_compiler.py).
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from actors.messages.front_end import StructuredOutput

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_of(spec: StructuredOutput):
    """The xgrammar Grammar of `spec`; a ValueError names what is wrong with it."""
    import xgrammar as xgr   # deferred: only structured requests pay for the import

    try:
        match spec.kind:
            case "json_schema":
                return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
            case "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            case "regex":
                return xgr.Grammar.from_regex(spec.spec)
            case "choice":
                choices = json.loads(spec.spec)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
            case "grammar":
                return xgr.Grammar.from_ebnf(spec.spec)
            case "structural_tag":
                return xgr.Grammar.from_structural_tag(spec.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(engine_message(e)) from None
    raise ValueError(f"unknown structured output kind {spec.kind!r}; expected one of {', '.join(KINDS)}")


@lru_cache(maxsize=256)
def check(spec: StructuredOutput) -> None:
    """Raises ValueError when `spec` cannot be compiled; remembers the ones that can."""
    grammar_of(spec)


def engine_message(error: Exception) -> str:
    """The engine's error without its source location and assertion text."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _ENGINE_PREFIX.sub("", text)


def _ebnf_literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly (JSON's escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)
