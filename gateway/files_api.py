"""OpenAI's Files API, for batches: POST /v1/files (multipart, `purpose: batch`), GET /v1/files,
GET and DELETE /v1/files/{file_id}, GET /v1/files/{file_id}/content.

Files live in the batch store (gateway/batch_store.py) and expire `--batch-file-ttl` after they
were made, or as the upload's `expires_after` says (gateway/expiry.py). An upload is streamed in and refused past `--batch-max-file-bytes`, whatever the
request body cap; a client sees only its own files (by API key).
"""
from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from gateway import api_types, expiry
from gateway.app_keys import STATE
from gateway.batch_runner import BATCHES, owner_of, save_file
from gateway.batch_store import now
from gateway.errors import APIError, invalid, not_found
from gateway.openapi import Endpoint
from gateway.tenant import api_key_of

_encode = msgspec.json.Encoder().encode
PURPOSES = ("batch",)
_MULTIPART_SLACK = 64 << 10   # a body's multipart framing and its other fields, beyond the file


def json_response(obj) -> web.Response:
    return web.Response(body=_encode(obj), content_type="application/json")


def public(obj: dict) -> dict:
    """A stored object as the API shows it (its owner left out)."""
    return {k: v for k, v in obj.items() if k != "owner"}


def owner(request: web.Request) -> str:
    return owner_of(api_key_of(request))


async def find_file(request: web.Request, file_id: str, param: str | None = None) -> dict:
    """The caller's file, not expired; 404 otherwise (another's file is as unknown as a missing one)."""
    store = request.app[BATCHES].store
    obj = await store.load_file(file_id)
    if obj is not None and obj["expires_at"] is not None and obj["expires_at"] <= now():
        await store.delete_file(file_id)
        obj = None
    if obj is None or obj["owner"] != owner(request):
        raise not_found(f"No such File object: {file_id}", param=param)
    return obj


async def create_file(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    limit = config.batch_max_file_bytes
    if request.content_length is not None and request.content_length > limit + _MULTIPART_SLACK:
        raise _too_large(limit)
    if not request.content_type.startswith("multipart/"):
        raise invalid("Upload a file as multipart/form-data with the fields `file` and `purpose`.")
    fields, filename, data = await _read_form(request, limit, config.read_timeout_s)
    purpose = fields.get("purpose")
    if purpose not in PURPOSES:
        raise invalid(f"`purpose` must be one of {list(PURPOSES)}, got {purpose!r}.", param="purpose")
    if data is None:
        raise invalid("The upload has no `file` field.", param="file")
    ttl_s = expiry.from_form(fields)
    file_id = await save_file(request.app[BATCHES].store, config, data, filename, purpose, owner(request), ttl_s)
    return json_response(public(await request.app[BATCHES].store.load_file(file_id)))


async def _read_form(request: web.Request, limit: int, timeout_s: float) -> tuple[dict[str, str], str, bytes | None]:
    """The form's other fields (small, within the slack), the file's name and its bytes."""
    fields, filename, data, size = {}, "upload.jsonl", None, 0
    try:
        reader = await request.multipart()
        while True:
            async with asyncio.timeout(timeout_s):
                part = await reader.next()
            if part is None:
                return fields, filename, data
            if part.name == "file":
                filename = part.filename or filename
                data = await _read_part(part, limit, timeout_s)
            elif part.name:
                value = await _read_field(part, _MULTIPART_SLACK - size, timeout_s)
                size += len(value)
                fields[part.name] = value.decode(errors="replace").strip()
    except TimeoutError:
        raise APIError(408, f"The upload stalled for {timeout_s:g} s.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ValueError as e:   # a malformed multipart body
        raise invalid(f"The multipart body does not parse: {e}") from None


async def _read_part(part, limit: int, timeout_s: float) -> bytes:
    chunks, size = [], 0
    while True:
        async with asyncio.timeout(timeout_s):
            chunk = await part.read_chunk(1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)


async def _read_field(part, budget: int, timeout_s: float) -> bytes:
    chunks, size = [], 0
    while True:
        async with asyncio.timeout(timeout_s):
            chunk = await part.read_chunk(4096)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > budget:
            raise invalid("The upload's fields besides `file` are too long.")
        chunks.append(chunk)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than {limit} bytes, the most a file may hold "
                         "(--batch-max-file-bytes).", param="file", code="file_too_large")


async def list_files(request: web.Request) -> web.Response:
    store, purpose = request.app[BATCHES].store, request.query.get("purpose")
    files = []
    for file_id in await store.file_ids():
        try:
            obj = await find_file(request, file_id)
        except APIError:
            continue
        if purpose is None or obj["purpose"] == purpose:
            files.append(public(obj))
    files.sort(key=lambda f: f["created_at"], reverse=True)
    return json_response({"object": "list", "data": files, "has_more": False})


async def get_file(request: web.Request) -> web.Response:
    return json_response(public(await find_file(request, request.match_info["file_id"])))


async def file_content(request: web.Request) -> web.Response:
    file_id = (await find_file(request, request.match_info["file_id"]))["id"]
    return web.Response(body=await request.app[BATCHES].store.read_data(file_id),
                        content_type="application/octet-stream")


async def delete_file(request: web.Request) -> web.Response:
    file_id = (await find_file(request, request.match_info["file_id"]))["id"]
    await request.app[BATCHES].store.delete_file(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


ENDPOINTS = [
    Endpoint("POST", "/v1/files", create_file, "Upload a file (multipart: `file`, `purpose: batch`)",
             response=api_types.FileObject),
    Endpoint("GET", "/v1/files", list_files, "Your files", response=api_types.FileList),
    Endpoint("GET", "/v1/files/{file_id}", get_file, "One file", response=api_types.FileObject),
    Endpoint("DELETE", "/v1/files/{file_id}", delete_file, "Delete a file", response=api_types.FileDeleted),
    Endpoint("GET", "/v1/files/{file_id}/content", file_content, "A file's bytes",
             content_type="application/octet-stream"),
]
