"""The API's response bodies as msgspec Structs: what /openapi.json documents.

The handlers build these bodies as dicts (gateway/responses.py); these structs are their schema.
The schemathesis test (tests/gateway/test_openapi.py) checks every whole response against it, and
tests/gateway/test_live_api.py every streamed event (ChatCompletionChunk, Completion), so the two
cannot drift apart.
"""
from __future__ import annotations

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class PromptLogprob(msgspec.Struct):
    """vLLM's shape: one of these per token id, in a dict per prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None
    reasoning_content: str | None = None   # with --reasoning-parser: the model's thinking


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's extension: the prompt's tokens, each with its logprob and the top ones (the first is null).
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatDelta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None   # with --reasoning-parser: the model's thinking


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One `data:` event of a streamed chat completion (text/event-stream)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct):
    """The whole completion, or one `data:` event of a streamed one."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Embedding(msgspec.Struct):
    object: str
    index: int
    embedding: list[float] | str   # floats, or base64 of little-endian float32 with encoding_format base64


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None            # a LoRA adapter's base model


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Status(msgspec.Struct):
    status: str
    model: str | None = None


class FileObject(msgspec.Struct):
    id: str
    object: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None
    status_details: str | None


class FileList(msgspec.Struct):
    object: str
    data: list[FileObject]
    has_more: bool


class FileDeleted(msgspec.Struct):
    id: str
    object: str
    deleted: bool


class BatchError(msgspec.Struct):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(msgspec.Struct):
    object: str
    data: list[BatchError]


class BatchRequestCounts(msgspec.Struct):
    total: int
    completed: int
    failed: int


class Batch(msgspec.Struct):
    id: str
    object: str
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None


class BatchList(msgspec.Struct):
    object: str
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
