"""A chat request's tools: checked, handed to the chat template, and forced where it asks.

`tool_choice` auto (the default when there are tools) lets the model choose, and its output is
parsed for calls in the `--tool-call-parser` format; none hides the tools and parses nothing;
required, or a named function, constrains the output through the structured-output engine to
calls in that format (exactly one when `parallel_tool_calls` is false), so it always parses into
valid calls. Under auto, a function with `strict: true` is enforced too: the text stays free, but
once the model opens a call it must be a valid call (to a strict function, with arguments its
`parameters` accept; a function that is not strict gets any JSON object), as OpenAI promises;
vLLM by default ignores `strict` under auto. That constraint is the request's one structured
output, so it cannot be combined with `response_format` or the like. A template that does not
render tools (SmolLM2's) simply leaves them out of the prompt. A message's `name` reaches the
template as the message's `name` key, as in vLLM.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from actors.messages.front_end import StructuredOutput
from gateway.errors import invalid
from gateway.protocol import ChatMessage, ChatRequest, NamedToolChoice, message_text
from gateway.tool_parsers import PARSERS

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class ChatTools:
    parser: object                       # one of tool_parsers.PARSERS, for the output
    template: list[dict]                 # the tools as chat templates read them
    forced: StructuredOutput | None      # required or named: the calls' grammar; auto: a strict one's


def chat_tools(req: ChatRequest, parser_name: str) -> ChatTools | None:
    """The request's tools, or None when it has none or turned them off (tool_choice none)."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise invalid(f"`tool_choice` must be auto, none, required or a named function, got {choice!r}.",
                      param="tool_choice")
    if not req.tools:
        if choice not in ("auto", "none"):
            raise invalid("`tool_choice` names a tool, but the request has no `tools`.", param="tool_choice")
        return None
    tools = {}
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise invalid(f"Only function tools are supported, got {t.type!r}.", param=f"tools[{i}].type")
        if not _NAME.fullmatch(t.function.name):
            raise invalid("A function name is 1-64 letters, digits, '_', '.' or '-'.",
                          param=f"tools[{i}].function.name")
        if t.function.name in tools:
            raise invalid(f"Two tools are named {t.function.name!r}.", param=f"tools[{i}].function.name")
        tools[t.function.name] = {"name": t.function.name, "description": t.function.description or "",
                                  "parameters": t.function.parameters or {"type": "object"}}
    strict = {t.function.name for t in req.tools if t.function.strict}
    if choice == "none":
        return None
    parser = PARSERS[parser_name]()
    forced = None
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or choice.function.name not in tools:
            raise invalid(f"`tool_choice` names {choice.function.name!r}, which is not in `tools`.",
                          param="tool_choice")
        forced = [tools[choice.function.name]]
    elif choice == "required":
        forced = list(tools.values())
    if forced is not None:
        parallel = choice == "required" and req.parallel_tool_calls is not False   # a named choice: one call
        forced = _structural_tag(parser.call_format(forced, parallel))
    elif strict:   # auto: free text, but a call the model opens is a valid one
        callable_ = [t if name in strict else {**t, "parameters": {"type": "object"}} for name, t in tools.items()]
        forced = _structural_tag(parser.triggered_format(callable_, req.parallel_tool_calls is not False))
    return ChatTools(parser, [{"type": "function", "function": t} for t in tools.values()], forced)


def _structural_tag(format_: dict) -> StructuredOutput:
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": format_},
                                                         ensure_ascii=False))


def template_message(m: ChatMessage, i: int) -> dict:
    """A message as chat templates read it: a call's arguments as an object, not JSON text; the
    participant's `name` where the message has one."""
    out = {"role": "system" if m.role == "developer" else m.role, "content": message_text(m)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = []
        for j, call in enumerate(m.tool_calls):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                raise invalid("A tool call's `arguments` must be JSON text.",
                              param=f"messages[{i}].tool_calls[{j}].function.arguments") from None
            out["tool_calls"].append({"id": call.id, "type": "function",
                                      "function": {"name": call.function.name, "arguments": args}})
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out
