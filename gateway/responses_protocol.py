"""The body of POST /v1/responses (OpenAI's Responses API) and its translation into a chat request.

A response is generated as a chat completion: `instructions` become a system message first, the
input items messages (a `function_call` an assistant's tool call, a `function_call_output` a tool
message), `text.format` the response_format and the tools chat tools. Nothing here samples or
renders a prompt; every check that the chat path makes is left to it. An unknown field is a 400
naming it, as elsewhere (protocol._Body).
"""
from __future__ import annotations

import re
from typing import Any

from gateway import protocol
from gateway.errors import invalid
from gateway.protocol import _Body

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
MAX_METADATA = 16
LOGPROBS = "message.output_text.logprobs"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class InputPart(_Body, kw_only=True):
    type: str                       # input_text, or output_text in an assistant's message
    text: str | None = None
    annotations: list[Any] | None = None   # an earlier output part sent back: accepted, unused
    logprobs: list[Any] | None = None


class InputItem(_Body, kw_only=True):
    """A message ({role, content}, `type` optional), a `function_call` or a `function_call_output`:
    one struct, so each kind's missing field is a 400 naming it rather than a union's puzzle."""
    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    id: str | None = None           # an earlier output item sent back: accepted, unused
    status: str | None = None


class FunctionTool(_Body, kw_only=True):
    type: str
    name: str | None = None   # required of a function; optional here so another tool's 400 names its type
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Body):
    type: str
    name: str


class TextFormat(_Body, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(_Body, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None    # accepted: our models have no verbosity setting


class Reasoning(_Body, kw_only=True):
    effort: str | None = None       # to the chat template as `reasoning_effort`, as chat does
    summary: str | None = None      # accepted: no reasoning items are produced
    generate_summary: str | None = None


class ResponsesRequest(_Body, kw_only=True):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None       # default true
    metadata: dict[str, str] | None = None
    user: str | None = None               # accepted: an end-user id, not used
    safety_identifier: str | None = None  # accepted, not used
    truncation: str | None = None   # "disabled" only
    reasoning: Reasoning | None = None
    top_logprobs: int | None = None  # alternatives per token, with include's message.output_text.logprobs
    include: list[str] | None = None  # message.output_text.logprobs only
    # vLLM's extensions of this API, as the chat path has them (VLLM_FIELDS); `vllm bench serve
    # --backend openai-responses` sends ignore_eos and its sampling flags.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# Passed to the chat request under the same names, where the chat path checks and honours them.
VLLM_FIELDS = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "ignore_eos", "logit_bias", "include_stop_str_in_output",
               "skip_special_tokens", "priority", "cache_salt", "chat_template_kwargs")


def validate(req: ResponsesRequest) -> None:
    """What the chat path cannot check for us, each 400 naming this API's field."""
    if req.truncation not in (None, "disabled"):
        raise invalid("`truncation` must be \"disabled\": a conversation longer than the context is a 400 "
                      "here, never silently cut.", param="truncation")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= protocol.MAX_LOGPROBS:
        raise invalid(f"`top_logprobs` must be in [0, {protocol.MAX_LOGPROBS}], got {req.top_logprobs}.",
                      param="top_logprobs")
    for i, name in enumerate(req.include or ()):
        if name != LOGPROBS:
            raise invalid(f"`include` {name!r} is not supported: the one extra a response carries here is "
                          f"{LOGPROBS!r} (no reasoning, no tool results).", param=f"include[{i}]")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid(f"`max_output_tokens` must be >= 1, got {req.max_output_tokens}.", param="max_output_tokens")
    if req.reasoning is not None and req.reasoning.effort not in (None, *protocol.REASONING_EFFORTS):
        raise invalid(f"`reasoning.effort` must be one of {', '.join(protocol.REASONING_EFFORTS)}.",
                      param="reasoning.effort")
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA:
            raise invalid(f"At most {MAX_METADATA} `metadata` pairs are allowed.", param="metadata")
        for k, v in req.metadata.items():
            if len(k) > 64 or len(v) > 512:
                raise invalid("`metadata` keys are at most 64 characters, values at most 512.",
                              param=f"metadata.{k[:64]}")
    if isinstance(req.input, list) and not req.input:
        raise invalid("`input` must not be empty.", param="input")
    for i, t in enumerate(req.tools or ()):
        if t.type != "function":
            raise invalid(f"Only function tools are supported, got {t.type!r}.", param=f"tools[{i}].type")
        if t.name is None or not _NAME.fullmatch(t.name):
            raise invalid("A function name is 1-64 letters, digits, '_', '.' or '-'.", param=f"tools[{i}].name")
    if isinstance(req.tool_choice, ToolChoiceFunction) and req.tool_choice.type != "function":
        raise invalid("A named `tool_choice` has type \"function\".", param="tool_choice.type")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        if fmt.type not in ("text", "json_object", "json_schema"):
            raise invalid(f"`text.format.type` must be text, json_object or json_schema, got {fmt.type!r}.",
                          param="text.format.type")
        if fmt.type == "json_schema" and (fmt.schema is None or not fmt.name):
            raise invalid("`text.format` of type json_schema needs `name` and `schema`.", param="text.format")


def input_messages(req: ResponsesRequest, history: list[protocol.ChatMessage]) -> list[protocol.ChatMessage]:
    """The request's input as chat messages, after `history` (the previous response's); a
    function_call_output must answer a call made in either."""
    if isinstance(req.input, str):
        return [protocol.ChatMessage(role="user", content=req.input)]
    calls = {c.id for m in history for c in m.tool_calls or ()}
    out: list[protocol.ChatMessage] = []
    for i, item in enumerate(req.input):
        at = f"input[{i}]"
        if item.type == "message":
            out.append(_message(item, at))
        elif item.type == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(item, name) is None:
                    raise invalid(f"{at} is a function_call without `{name}`.", param=f"{at}.{name}")
            call = protocol.ToolCall(function=protocol.FunctionCall(item.name, item.arguments), id=item.call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":   # one assistant turn: its text, its calls
                last.tool_calls = (last.tool_calls or []) + [call]
            else:
                out.append(protocol.ChatMessage(role="assistant", tool_calls=[call]))
            calls.add(item.call_id)
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise invalid(f"{at} is a function_call_output without `call_id` and `output`.",
                              param=f"{at}.{'output' if item.call_id else 'call_id'}")
            if item.call_id not in calls:
                raise invalid(f"No function call found with call_id {item.call_id!r} for {at}.",
                              param=f"{at}.call_id")
            out.append(protocol.ChatMessage(role="tool", tool_call_id=item.call_id,
                                            content=_text(item.output, f"{at}.output")))
        else:
            raise invalid(f"Input items are messages, function_call and function_call_output; {at} is "
                          f"{item.type!r}.", param=f"{at}.type")
    return out


def _message(item: InputItem, at: str) -> protocol.ChatMessage:
    if item.role not in MESSAGE_ROLES:
        raise invalid(f"{at} has role {item.role!r}; expected one of {', '.join(MESSAGE_ROLES)}.",
                      param=f"{at}.role")
    if item.content is None:
        raise invalid(f"{at} has no content.", param=f"{at}.content")
    return protocol.ChatMessage(role=item.role, content=_text(item.content, f"{at}.content"))


def _text(content: str | list[InputPart], at: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise invalid(f"Only text content parts (input_text, output_text) are supported, got {part.type!r}.",
                          param=f"{at}[{j}]")
    return "".join(p.text for p in content)


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Logprobs come with `include`'s message.output_text.logprobs; `top_logprobs` alone adds none, as
    in OpenAI's API."""
    return LOGPROBS in (req.include or ())


def chat_request(req: ResponsesRequest, conversation: list[protocol.ChatMessage]) -> protocol.ChatRequest:
    """The chat request that generates this response: `conversation` is the history and the
    input as messages; the instructions go first."""
    messages = ([protocol.ChatMessage(role="system", content=req.instructions)] if req.instructions else []) \
        + conversation
    tools = [protocol.Tool(type="function", function=protocol.FunctionDef(
        t.name, t.description, t.parameters, t.strict)) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = protocol.NamedToolChoice(type="function", function=protocol.NamedFunction(choice.name))
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        schema = protocol.JsonSchemaFormat(fmt.name, fmt.description, fmt.schema, fmt.strict) \
            if fmt.type == "json_schema" else None
        response_format = protocol.ResponseFormat(fmt.type, schema)
    return protocol.ChatRequest(
        model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None, user=req.user,
        logprobs=True if wants_logprobs(req) else None,
        top_logprobs=(req.top_logprobs or 0) if wants_logprobs(req) else None,
        **{name: getattr(req, name) for name in VLLM_FIELDS})
