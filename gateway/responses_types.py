"""The Responses API's response bodies as msgspec Structs: what /openapi.json documents for
/v1/responses (gateway/responses_output.py builds them as dicts; the schemathesis test checks
every real one against these)."""
from __future__ import annotations

from typing import Any

import msgspec


class OutputText(msgspec.Struct):
    type: str
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class OutputItem(msgspec.Struct):
    """A `message` (role, content) or a `function_call` (call_id, name, arguments)."""

    id: str
    type: str
    status: str
    role: str | None = None
    content: list[OutputText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct):
    """A whole response (POST without `stream`, GET), or the `response` of a stream's events."""

    id: str
    object: str
    created_at: int
    status: str
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    store: bool
    temperature: float
    top_p: float
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    reasoning: dict[str, Any]
    truncation: str
    metadata: dict[str, str]
    user: str | None
    top_logprobs: int | None


class ResponseDeleted(msgspec.Struct):
    id: str
    object: str
    deleted: bool


class InputItemList(msgspec.Struct):
    """GET /v1/responses/{id}/input_items: a page of the items the response was made from."""

    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
