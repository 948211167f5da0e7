"""OpenAI's Batches API: POST /v1/batches, GET /v1/batches, GET /v1/batches/{batch_id},
POST /v1/batches/{batch_id}/cancel; and the batch store's life beside the app's.

A batch is checked here (its endpoint, window, metadata and input file) and then run by the
BatchRunner (gateway/batch_runner.py); a client sees only its own batches (by API key).
"""
from __future__ import annotations

import re
import tempfile
from typing import Awaitable, Callable

import msgspec
from aiohttp import web

from gateway import api_types, batch_lines, expiry, protocol
from gateway.app_keys import STATE
from gateway.batch_runner import BATCHES, BatchRunner
from gateway.batch_store import BatchStore, new_id, now
from gateway.errors import APIError, invalid, not_found
from gateway.files_api import find_file, json_response, owner
from gateway.handlers import read_body
from gateway.openapi import Endpoint
_WINDOW = re.compile(r"^([1-9]\d{0,3})h$")
MAX_METADATA = 16        # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512
MAX_LIST = 100


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: expiry.ExpiresAfter | None = None


async def create_batch(request: web.Request) -> web.Response:
    req = protocol.decode(await read_body(request), BatchRequest)
    if req.endpoint not in batch_lines.ENDPOINTS:
        raise invalid(f"`endpoint` must be one of {list(batch_lines.ENDPOINTS)}, got {req.endpoint!r}.",
                      param="endpoint")
    window = _WINDOW.match(req.completion_window)
    if window is None:
        raise invalid(f"`completion_window` must be a number of hours such as '24h', got "
                      f"{req.completion_window!r}.", param="completion_window")
    _check_metadata(req.metadata)
    output_ttl_s = expiry.seconds_of(req.output_expires_after, "output_expires_after")
    if (await find_file(request, req.input_file_id, param="input_file_id"))["purpose"] != "batch":
        raise invalid(f"The file {req.input_file_id} was not uploaded with purpose 'batch'.", param="input_file_id")
    created = now()
    batch = {"id": new_id("batch_"), "object": "batch", "endpoint": req.endpoint, "errors": None,
             "input_file_id": req.input_file_id, "completion_window": req.completion_window,
             "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": created,
             "in_progress_at": None, "expires_at": created + int(window.group(1)) * 3600,
             "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
             "cancelling_at": None, "cancelled_at": None,
             "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": req.metadata}
    runner = request.app[BATCHES]
    record = {"batch": batch, "owner": owner(request), "output_ttl_s": output_ttl_s}
    await runner.store.save_batch(record)
    await runner.start(record)
    return json_response(batch)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise invalid(f"`metadata` holds at most {MAX_METADATA} pairs, keys of up to 64 characters and values "
                      "of up to 512.", param="metadata")


async def _find(request: web.Request) -> dict:
    batch_id = request.match_info["batch_id"]
    record = await request.app[BATCHES].view(batch_id)
    if record is None or record["owner"] != owner(request):
        raise not_found(f"No such Batch object: {batch_id}", param="batch_id")
    return record


async def get_batch(request: web.Request) -> web.Response:
    return json_response((await _find(request))["batch"])


async def list_batches(request: web.Request) -> web.Response:
    """Newest first, `limit` at a time (1 to 100, 20 by default), after the id `after`."""
    try:
        limit = int(request.query.get("limit", 20))
    except ValueError:
        raise invalid("`limit` must be an integer.", param="limit") from None
    if not 1 <= limit <= MAX_LIST:
        raise invalid(f"`limit` must be in [1, {MAX_LIST}].", param="limit")
    runner, me = request.app[BATCHES], owner(request)
    records = [r for i in await runner.store.batch_ids() if (r := await runner.view(i)) is not None
               and r["owner"] == me]
    batches = sorted((r["batch"] for r in records), key=lambda b: (b["created_at"], b["id"]), reverse=True)
    after = request.query.get("after")
    if after is not None:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1:] if after in ids else []
    page = batches[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit})


async def cancel_batch(request: web.Request) -> web.Response:
    record = await _find(request)
    running = await request.app[BATCHES].cancel(record["batch"]["id"])
    if running is None:
        raise APIError(409, f"Cannot cancel a batch with status {record['batch']['status']!r}.",
                       code="batch_not_cancellable")
    return json_response(running["batch"])


StoreOpener = Callable[[], Awaitable[BatchStore]]
# How the app opens its batch store: a cluster's gateway sets one (gateway/cluster.py: Redis);
# without it, the directory --batch-dir, or a temporary one.
BATCH_STORE = web.AppKey("batch_store", StoreOpener)


async def open_directory_store(config) -> BatchStore:
    if config.batch_dir is not None:
        return BatchStore(config.batch_dir)
    return BatchStore(tempfile.mkdtemp(prefix="matinee-batches-"), temporary=True)


async def batch_lifecycle(app: web.Application):
    """cleanup_ctx: the store opened and unfinished batches resumed; at shutdown the runner stops,
    its lines in flight left to run again."""
    opener = app.get(BATCH_STORE)
    store = await opener() if opener is not None else await open_directory_store(app[STATE].config)
    runner = app[BATCHES] = BatchRunner(app[STATE], store)
    runner.open()
    yield
    await runner.stop()
    await store.close()


ENDPOINTS = [
    Endpoint("POST", "/v1/batches", create_batch, "Run a file of requests as a batch", BatchRequest,
             api_types.Batch, example={"input_file_id": "file-...", "endpoint": "/v1/chat/completions",
                                       "completion_window": "24h"}),
    Endpoint("GET", "/v1/batches", list_batches, "Your batches, newest first", response=api_types.BatchList),
    Endpoint("GET", "/v1/batches/{batch_id}", get_batch, "One batch, with its live counts",
             response=api_types.Batch),
    Endpoint("POST", "/v1/batches/{batch_id}/cancel", cancel_batch, "Cancel a batch", response=api_types.Batch),
]
