"""From a request's structured-output fields to the engine's StructuredOutput, checked into 400s.

OpenAI's `response_format` (`text` asks for nothing, `json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar` (GBNF-style EBNF with a `root` rule): one constraint per request. The grammar is
checked on a thread (the first check imports the engine), and a bad one is a 400 naming the field
and the problem; nothing that fails here reaches the engine.
"""
from __future__ import annotations

import asyncio
import json

from actors.grammar import check
from actors.messages import StructuredOutput
from gateway.errors import invalid
from gateway.protocol import _Common


async def structured_output(req: _Common, tool_calls: StructuredOutput | None = None) -> StructuredOutput | None:
    """The request's constraint, checked; None when it asks for none. `tool_calls`: the grammar
    of the calls a `tool_choice` forces (gateway/tools.py), one constraint like the others."""
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
    await checked(spec, param)
    return spec


async def checked(spec: StructuredOutput, param: str) -> None:
    """A 400 naming `param` when `spec` does not compile."""
    try:
        await asyncio.to_thread(check, spec)
    except ValueError as e:
        raise invalid(f"Invalid `{param}`: {e}", param=param) from None


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
