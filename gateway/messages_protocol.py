"""Anthropic's Messages API request bodies as msgspec Structs, checked and translated into a chat
request (gateway/protocol.py's ChatRequest), so one path renders prompts and samples for both APIs.

As for OpenAI's bodies, an unknown field is a 400 naming it; what Anthropic offers and a local
model cannot honour (extended thinking, images, documents, server tools) is declared here only so
the 400 can say why. Nothing here knows about HTTP or engines.
"""
from __future__ import annotations

import json
from typing import Any, Union

import msgspec

from gateway import protocol
from gateway.errors import invalid

MAX_STOP_SEQUENCES = protocol.MAX_STOP


class CacheControl(protocol._Body):
    """Accepted and unused: the prefix cache keeps every prompt's blocks without being asked."""
    type: str = "ephemeral"
    ttl: str | None = None


class TextBlock(protocol._Body, tag="text"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None   # a reply's own (always none here), sent back with it


class ToolUseBlock(protocol._Body, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(protocol._Body, tag="tool_result"):
    tool_use_id: str
    content: str | list[Block] | None = None   # text blocks only: checked in validate()
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class _Refused(msgspec.Struct, tag_field="type"):
    """A block Anthropic accepts and a text model cannot read: decoded whatever it holds, then a 400."""


class ImageBlock(_Refused, tag="image"):
    pass


class DocumentBlock(_Refused, tag="document"):
    pass


class ThinkingBlock(_Refused, tag="thinking"):
    pass


class RedactedThinkingBlock(_Refused, tag="redacted_thinking"):
    pass


_SERVER_TOOL = "Server tool blocks are not supported: server tools are not available here; declare your own tools."
_REFUSED_BLOCKS = {
    "image": "Image blocks are not supported: only text models are served.",
    "document": "Document blocks are not supported: send the document's text in a text block.",
    "thinking": "Thinking blocks are not supported: extended thinking is not available here.",
    "redacted_thinking": "Thinking blocks are not supported: extended thinking is not available here.",
    "search_result": "Search result blocks are not supported: send the result's text in a text block.",
    "browser_state": "Browser state blocks are not supported: only text models are served.",
    "tool_reference": "Tool reference blocks are not supported: tool search is not available here.",
    "container_upload": "Container upload blocks are not supported: code execution is not available here.",
    **{t: _SERVER_TOOL for t in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                                 "code_execution_tool_result", "bash_code_execution_tool_result",
                                 "text_editor_code_execution_tool_result", "tool_search_tool_result")},
}
# The other blocks Anthropic's SDK sends (in a message, or in a tool_result's content), each its own tag.
_MORE_REFUSED = tuple(msgspec.defstruct(f"Refused_{tag}", [], bases=(_Refused,), tag=tag)
                      for tag in _REFUSED_BLOCKS if tag not in ("image", "document", "thinking", "redacted_thinking"))
Block = Union[(TextBlock, ToolUseBlock, ToolResultBlock, ImageBlock, DocumentBlock, ThinkingBlock,
               RedactedThinkingBlock, *_MORE_REFUSED)]


class MessageParam(protocol._Body):
    role: str
    content: str | list[Block]


class MessagesTool(protocol._Body, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None   # required of custom tools: checked in validate()
    description: str | None = None
    type: str | None = None   # "custom" or absent; Anthropic's server tools are refused
    cache_control: CacheControl | None = None


class MessagesToolChoice(protocol._Body, kw_only=True):
    type: str   # auto, any, tool, none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesMetadata(protocol._Body):
    user_id: str | None = None   # accepted, unused


class OutputFormat(protocol._Body):
    type: str   # json_schema
    schema: dict[str, Any]


class OutputConfig(protocol._Body, kw_only=True):
    effort: str | None = None          # passed to the chat template as reasoning_effort
    format: OutputFormat | None = None   # the reply's text is JSON valid against this schema


class _Conversation(protocol._Body, kw_only=True):
    model: str | None = None   # Anthropic's SDK always sends one; left out, the served model, as on every route
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: dict[str, Any] | None = None   # refused unless disabled
    cache_control: CacheControl | None = None


class MessagesRequest(_Conversation, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(_Conversation, kw_only=True):
    pass


def validate(req: _Conversation) -> None:
    """Anthropic's own rules, before translation; the chat request's checks follow it."""
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise invalid("`thinking` is not supported: extended thinking is not available here.",
                      param="thinking")
    if not req.messages:
        raise invalid("`messages` must hold at least one message.", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role must be user or assistant, got {m.role!r}; the system "
                          "prompt goes in `system`.", param=f"messages[{i}].role")
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            _refuse(block, where)
            if isinstance(block, ToolUseBlock) and m.role != "assistant":
                raise invalid(f"{where} is a tool_use block; only assistant messages make tool calls.",
                              param=where)
            if isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise invalid(f"{where} is a tool_result block; tool results go in user messages.",
                                  param=where)
                for k, part in enumerate(block.content if isinstance(block.content, list) else ()):
                    _refuse(part, f"{where}.content[{k}]")
                    if not isinstance(part, TextBlock):
                        raise invalid("A tool_result's content is a string or text blocks.",
                                      param=f"{where}.content[{k}]")
    for i, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            raise invalid(f"Server tool {t.type!r} is not available here; declare your own tools with "
                          "`name` and `input_schema`.", param=f"tools[{i}].type")
        if t.input_schema is None:
            raise invalid(f"tools[{i}] needs an `input_schema`.", param=f"tools[{i}].input_schema")
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise invalid(f"`max_tokens` must be >= 1, got {req.max_tokens}.", param="max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise invalid(f"`temperature` must be between 0 and 1, got {req.temperature}.", param="temperature")
        if req.top_k is not None and req.top_k < 0:
            raise invalid(f"`top_k` must be >= 0, got {req.top_k}.", param="top_k")
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None and fmt.type != "json_schema":
            raise invalid(f"`output_config.format.type` must be json_schema, got {fmt.type!r}.",
                          param="output_config.format.type")
        if len(req.stop_sequences or ()) > MAX_STOP_SEQUENCES:
            raise invalid(f"At most {MAX_STOP_SEQUENCES} stop_sequences are allowed.", param="stop_sequences")


def _refuse(block, where: str) -> None:
    if isinstance(block, _Refused):
        raise invalid(_REFUSED_BLOCKS[type(block).__struct_config__.tag], param=where)


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(b.text for b in content)


def _messages(req: _Conversation) -> list[protocol.ChatMessage]:
    """Anthropic's turns as chat messages: tool_use blocks become the assistant's `tool_calls`, each
    tool_result a `tool` message (before the user's text, as Anthropic orders them)."""
    out = []
    if req.system:
        out.append(protocol.ChatMessage("system", _text(req.system)))
    for m in req.messages:
        if isinstance(m.content, str):
            out.append(protocol.ChatMessage(m.role, m.content))
            continue
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                text = _text(b.content)
                out.append(protocol.ChatMessage("tool", f"Error: {text}" if b.is_error else text,
                                                tool_call_id=b.tool_use_id))
        calls = [protocol.ToolCall(protocol.FunctionCall(b.name, json.dumps(b.input, ensure_ascii=False)), b.id)
                 for b in m.content if isinstance(b, ToolUseBlock)]
        if texts or calls or not m.content:
            out.append(protocol.ChatMessage(m.role, "".join(texts) if texts or not calls else None,
                                            tool_calls=calls or None))
    return out


def _tool_choice(req: _Conversation) -> tuple[str | protocol.NamedToolChoice | None, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    c = req.tool_choice
    if c is None:
        return None, None
    parallel = False if c.disable_parallel_tool_use else None
    if c.type in ("auto", "none"):
        return c.type, parallel
    if c.type == "any":
        return "required", parallel
    if c.type == "tool":
        if not c.name:
            raise invalid("A `tool_choice` of type tool needs the tool's `name`.", param="tool_choice.name")
        return protocol.NamedToolChoice("function", protocol.NamedFunction(c.name)), False
    raise invalid(f"`tool_choice.type` must be auto, any, tool or none, got {c.type!r}.", param="tool_choice.type")


def _output(config: OutputConfig | None) -> dict:
    """Structured outputs (a JSON schema the text must satisfy) and effort, in the chat request's terms."""
    out = {}
    if config is not None and config.format is not None:
        out["response_format"] = protocol.ResponseFormat(
            "json_schema", protocol.JsonSchemaFormat(schema=config.format.schema))
    if config is not None and config.effort is not None:
        out["reasoning_effort"] = config.effort
    return out


def chat_request(req: _Conversation) -> protocol.ChatRequest:
    """The chat request that asks the engine for what `req` asks. A last assistant message is a
    prefill: the reply continues it (the template leaves it open)."""
    validate(req)
    messages = _messages(req)
    choice, parallel = _tool_choice(req)
    tools = [protocol.Tool("function", protocol.FunctionDef(t.name, t.description, t.input_schema))
             for t in req.tools] if req.tools else None
    prefill = req.messages[-1].role == "assistant"
    if isinstance(req, MessagesRequest):
        sampling = dict(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                        top_k=req.top_k, stop=req.stop_sequences, stream=req.stream, **_output(req.output_config))
    else:   # counting: any budget that leaves the prompt alone
        sampling = dict(max_tokens=1)
    chat = protocol.ChatRequest(model=req.model, messages=messages, tools=tools, tool_choice=choice,
                                parallel_tool_calls=parallel,
                                add_generation_prompt=False if prefill else None,
                                continue_final_message=prefill or None, **sampling)
    protocol.validate_chat(chat)
    return chat
