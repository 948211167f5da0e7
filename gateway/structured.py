"""From a request's structured-output fields to the engine's StructuredOutput, checked into 400s.

OpenAI's `response_format` (`text` asks for nothing, `json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar` (GBNF-style EBNF with a `root` rule): one constraint per request. Nothing that
fails here reaches the engine.

Compiling is bounded: a constraint longer than `--max-grammar-chars` is refused before anything
parses it, and the compile check runs on its own daemon thread (at most COMPILE_THREADS at once,
so it never takes the threads that tokenize) for at most `--grammar-timeout` seconds. A thread
cannot be stopped: one that overruns finishes on its own, but its request has its 400 at once and
holds one of the few slots meanwhile. The handlers check the queue's capacity before compiling.
"""
from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

from actors.text.grammar import check
from actors.messages.front_end import StructuredOutput
from gateway.errors import invalid, unavailable
from gateway.protocol import _Common

COMPILE_THREADS = 4
_slots = threading.BoundedSemaphore(COMPILE_THREADS)


@dataclass(frozen=True)
class Structured:
    """A request's constraint, and the field it came from (named in its errors)."""
    spec: StructuredOutput
    param: str


def structured_output(req: _Common, tool_calls: StructuredOutput | None = None,
                      max_chars: int | None = None) -> Structured | None:
    """The request's constraint, checked in everything but whether it compiles (see `compiled`);
    None when it asks for none. `tool_calls`: the grammar of the calls a `tool_choice` forces
    (gateway/tools.py), one constraint like the others. `max_chars` bounds the constraint's text."""
    found = _requested(req) + ([(tool_calls, "tools")] if tool_calls is not None else [])
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"Only one structured output per request; got {', '.join(f'`{p}`' for _, p in found)}.",
                      param=found[1][1])
    spec, param = found[0]
    if req.ignore_eos:
        raise invalid("`ignore_eos` cannot be combined with a structured output: it ends where its "
                      "grammar ends.", param="ignore_eos")
    if req.min_tokens:
        raise invalid("`min_tokens` cannot be combined with a structured output: the grammar may end "
                      "before it.", param="min_tokens")
    if max_chars is not None and len(spec.spec) > max_chars:
        raise invalid(f"`{param}` is {len(spec.spec)} characters long; this server compiles at most "
                      f"{max_chars} (--max-grammar-chars).", param=param, code="grammar_too_large")
    return Structured(spec, param)


async def compiled(structured: Structured | None, timeout_s: float) -> StructuredOutput | None:
    """The constraint, once it is known to compile within `timeout_s` seconds; a 400 naming the
    field when it does not, or naming the limit when it takes longer."""
    if structured is None:
        return None
    try:
        await _on_own_thread(check, structured.spec, timeout_s)
    except TimeoutError:
        raise invalid(f"`{structured.param}` did not compile within {timeout_s:g} s (--grammar-timeout).",
                      param=structured.param, code="grammar_timeout") from None
    except ValueError as e:
        raise invalid(f"Invalid `{structured.param}`: {e}", param=structured.param) from None
    return structured.spec


async def _on_own_thread(fn, arg, timeout_s: float):
    """`fn(arg)` on a new daemon thread, awaited for at most `timeout_s`: a daemon, so one that
    never ends cannot hold up the process's exit, as a pool's thread would."""
    if not _slots.acquire(blocking=False):
        raise unavailable("Every grammar compiler is busy; retry later.")
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error) -> None:
        if done.done():   # cancelled: the awaiting side gave up (timeout, client gone)
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(arg), None
        except BaseException as e:   # handed to the awaiting side
            result, error = None, e
        finally:
            _slots.release()
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:   # the loop has closed meanwhile
            pass

    threading.Thread(target=run, name="grammar-check", daemon=True).start()
    return await asyncio.wait_for(done, timeout_s)


def _requested(req: _Common) -> list[tuple[StructuredOutput, str]]:
    found = []
    if (rf := req.response_format) is not None:
        if rf.type == "json_object":
            found.append((StructuredOutput("json_object"), "response_format"))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise invalid("`response_format` of type json_schema needs `json_schema.schema`.",
                              param="response_format.json_schema")
            found.append((_json_schema(rf.json_schema.schema, "response_format.json_schema.schema"),
                          "response_format.json_schema.schema"))
        elif rf.type != "text":
            raise invalid(f"`response_format.type` must be text, json_object or json_schema, got "
                          f"{rf.type!r}.", param="response_format.type")
    if (so := req.structured_outputs) is not None:
        asked = [(name, value) for name, value in (
            ("json", so.json), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
            ("json_object", so.json_object or None), ("structural_tag", so.structural_tag))
            if value is not None]
        if len(asked) != 1:
            raise invalid("`structured_outputs` must set exactly one of json, regex, choice, grammar, "
                          "json_object or structural_tag.", param="structured_outputs")
        name, value = asked[0]
        param = f"structured_outputs.{name}"
        found.append((_spec(name, value, param), param))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((_spec(name, value, f"guided_{name}"), f"guided_{name}"))
    return found


def _spec(name: str, value, param: str) -> StructuredOutput:
    match name:
        case "json":
            return _json_schema(value, param)
        case "choice":
            if not value or not all(value):
                raise invalid(f"`{param}` must be a list of non-empty strings.", param=param)
            return StructuredOutput("choice", json.dumps(value, ensure_ascii=False))
        case "json_object":
            return StructuredOutput("json_object")
        case _:   # regex, grammar, structural_tag: text the engine reads
            if not value:
                raise invalid(f"`{param}` must not be empty.", param=param)
            return StructuredOutput(name, value)


def _json_schema(schema, param: str) -> StructuredOutput:
    """A schema given as an object or as JSON text, in canonical text (one cache entry per schema)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise invalid(f"`{param}` is not valid JSON: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"`{param}` must be a JSON schema (an object).", param=param)
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))
