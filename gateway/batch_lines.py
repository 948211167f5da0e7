"""A batch's input lines and how one is answered, in OpenAI's batch line formats.

In:  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
Out: {"id": "batch_req_...", "custom_id": "a", "response": {"status_code", "request_id", "body"},
      "error": null}, or with "response": null and "error": {"code", "message"} for a line that
      never reached the endpoint (not JSON, a wrong url, too long, a duplicate custom_id).

A line's body goes through the very code its endpoint's HTTP route runs (gateway/handlers.py,
gateway/embeddings.py), so it is validated and answered exactly as a live request, but marked
ballast. A bad line becomes its own error record; it never stops the batch.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import msgspec

from gateway import embeddings, handlers
from gateway.errors import APIError, internal
from gateway.state import GatewayState
from runtime import get_logger

ENDPOINTS = {
    "/v1/chat/completions": lambda call: _generate(handlers.prepare_chat, call),
    "/v1/completions": lambda call: _generate(handlers.prepare_completion, call),
    "/v1/embeddings": embeddings.embed,
}
log = get_logger(component="batch")
# The engine is full or not there yet: the line waits and tries again instead of failing.
RETRIED = (429, 503)
RETRY_S = 1.0


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    method: str
    url: str
    body: dict


@dataclass(frozen=True)
class Line:
    """One input line: its request, or why it cannot be run (`error`)."""

    index: int
    custom_id: str | None
    body: bytes = b""
    error: dict | None = None


def parse_lines(data: bytes, endpoint: str, max_line_bytes: int) -> list[Line]:
    """Every non-blank line of a batch input file, each checked on its own."""
    lines, seen = [], set()
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        line = _parse(len(lines), raw, endpoint, max_line_bytes)
        if line.error is None and line.custom_id in seen:
            line = Line(line.index, line.custom_id, error=_error(
                "duplicate_custom_id", f"The custom_id {line.custom_id!r} is used by an earlier line."))
        seen.add(line.custom_id)
        lines.append(line)
    return lines


def _parse(index: int, raw: bytes, endpoint: str, max_line_bytes: int) -> Line:
    if len(raw) > max_line_bytes:
        return Line(index, None, error=_error(
            "line_too_long", f"Line {index + 1} is {len(raw)} bytes; a line may be at most {max_line_bytes}."))
    try:
        parsed = msgspec.json.decode(raw, type=_Line)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        return Line(index, _custom_id(raw), error=_error("invalid_json_line", f"Line {index + 1}: {e}"))
    if parsed.method.upper() != "POST":
        return Line(index, parsed.custom_id, error=_error(
            "invalid_method", f"Line {index + 1}: method must be POST, got {parsed.method!r}."))
    if parsed.url != endpoint:
        return Line(index, parsed.custom_id, error=_error(
            "invalid_url", f"Line {index + 1}: url {parsed.url!r} is not this batch's endpoint {endpoint!r}."))
    if parsed.body.get("stream"):
        return Line(index, parsed.custom_id, error=_error(
            "invalid_body", f"Line {index + 1}: a batch line cannot stream; leave `stream` out."))
    return Line(index, parsed.custom_id, msgspec.json.encode(parsed.body))


async def answer(state: GatewayState, endpoint: str, line: Line) -> tuple[bool, dict]:
    """(whether it succeeded, its output line). Waits while the engine is full or away."""
    if line.error is not None:
        return False, _out(line, None, line.error)
    rid = uuid.uuid4().hex
    while True:
        call = handlers.Call(state, line.body, handlers.Ids(rid), time.monotonic(), ballast=True)
        try:
            body = await ENDPOINTS[endpoint](call)
        except APIError as e:
            if e.status in RETRIED:
                await asyncio.sleep(RETRY_S)
                continue
            return False, _out(line, {"status_code": e.status, "request_id": rid, "body": e.body()}, None)
        except Exception:   # a fault of ours: this line's 500, and the batch goes on
            log.exception("batch line failed", custom_id=line.custom_id)
            e = internal()
            return False, _out(line, {"status_code": e.status, "request_id": rid, "body": e.body()}, None)
        return True, _out(line, {"status_code": 200, "request_id": rid, "body": body}, None)


def not_run(line: Line, code: str, message: str) -> dict:
    """The output line of one the batch ended before (expired, cancelled)."""
    return _out(line, None, _error(code, message))


async def _generate(prepare, call: handlers.Call) -> dict:
    return await handlers.whole(call.state, await prepare(call))


def _out(line: Line, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response,
            "error": error}


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message}


def _custom_id(raw: bytes) -> str | None:
    """A broken line's custom_id, where it can still be read."""
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None
