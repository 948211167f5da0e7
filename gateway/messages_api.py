"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same engine.

A Messages request is translated into a chat request (gateway/messages_protocol.py) and served by
the chat route's own generation (gateway/handlers.py), so prompts and sampling are built in one
place; only the output's shape is Anthropic's (gateway/messages_output.py). Errors on these paths
take Anthropic's shape too (`anthropic_error_response`, called by the app's error middleware).
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import time

import msgspec
from aiohttp import web

from gateway import handlers, protocol
from gateway.app_keys import STATE
from gateway.engine_client import EngineLost, RequestFailed
from gateway.errors import APIError, internal, unavailable
from gateway.messages_output import AnthropicError, AnthropicMessage, MessageEvents, TokenCount, error_body, message
from gateway.messages_protocol import CountTokensRequest, MessagesRequest, chat_request
from gateway.openapi import Endpoint
from gateway.request_log import REQUEST_ID
from gateway.sse import SSEWriter
from gateway.tools import chat_tools
from runtime import get_logger

PATH = "/v1/messages"
_encode = msgspec.json.Encoder().encode
log = get_logger(component="gateway")


def speaks_anthropic(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def anthropic_error_response(request: web.Request, e: APIError) -> web.Response:
    rid = request.get(REQUEST_ID)
    return web.Response(status=e.status, body=_encode(error_body(e, rid)), content_type="application/json",
                        headers={**e.headers, **({"request-id": rid} if rid else {})})


# The chat request's fields that a Messages request names otherwise, for the errors that name them.
_NAMES = [(re.compile(r"response_format\.json_schema\.schema"), "output_config.format.schema"),
          (re.compile(r"^stop$"), "stop_sequences"), (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1].")]


@contextlib.contextmanager
def _anthropic_names():
    try:
        yield
    except APIError as e:
        for pattern, name in _NAMES if e.param is not None else ():
            if pattern.search(e.param):
                param = pattern.sub(name, e.param)
                e.message, e.param = e.message.replace(f"`{e.param}`", f"`{param}`"), param
                break
        raise


def _json(request: web.Request, body: dict) -> web.Response:
    # Anthropic's SDK reads the request id from `request-id` (X-Request-Id is sent as on every route).
    return web.Response(body=_encode(body), content_type="application/json",
                        headers={"request-id": request[REQUEST_ID]})


async def _accept(request: web.Request, type_: type):
    """The body decoded, as a chat request, and the engine that will serve it: both routes' start."""
    state = request.app[STATE]
    req = protocol.decode(await handlers.read_body(request), type_)
    chat = chat_request(req)
    client, engine = state.require_engine()
    await state.resolve_model(chat.model)
    return state, req, chat, client, engine


async def messages(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state, req, chat, client, engine = await _accept(request, MessagesRequest)
    with _anthropic_names():
        gen, fmt = await handlers.chat_generation(handlers.ids_of(request), state, chat, client, engine, arrival,
                                                  id_prefix="msg")
    with handlers.running(state, gen):
        if req.stream:
            return await _stream(request, state, gen, fmt)
        stop_string = None
        while not gen.done:
            for cd in await gen.next():
                fmt.add(cd)
                stop_string = cd.stop_string or stop_string
        return _json(request, message(fmt.whole(gen.usage()), stop_string))


async def _stream(request: web.Request, state, gen, fmt) -> web.StreamResponse:
    sse = SSEWriter()
    sse.response.headers["request-id"] = request[REQUEST_ID]
    await sse.open(request)
    events = MessageEvents(fmt.env.id, fmt.env.model)
    interval = state.config.ping_interval_s
    started, finish, stop_string = False, None, None
    try:
        while not gen.done:
            batch = await gen.next(timeout=interval)
            if batch is None:
                await sse.send_named(("ping", {"type": "ping"}))
                continue
            out = [] if started else events.start(gen.usage())   # after the first delta: cached tokens known
            started = True
            for cd in batch:
                if (chunk := fmt.chunk(cd)) is not None:
                    out += events.chunk(chunk)
                    finish = chunk["choices"][0]["finish_reason"] or finish
                stop_string = cd.stop_string or stop_string
            await sse.send_named(*out)
        await sse.send_named(*events.finish(finish, stop_string, gen.usage()))
        await sse.end()
    except EngineLost as e:
        await _fail(request, sse, unavailable(str(e)))
    except RequestFailed as e:
        await _fail(request, sse, internal(str(e)))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:   # headers are out: the error can only travel inside the stream
        log.exception("stream failed")
        await _fail(request, sse, internal())
    return sse.response


async def _fail(request: web.Request, sse: SSEWriter, e: APIError) -> None:
    """An error after the headers went out: Anthropic's `error` event ends the stream."""
    await sse.send_named(("error", error_body(e, request[REQUEST_ID])))
    await sse.end()


async def count_tokens(request: web.Request) -> web.Response:
    """The rendered prompt's tokens: what `usage` of the same request counts as input (cached or not)."""
    state, _, chat, _, engine = await _accept(request, CountTokensRequest)
    with _anthropic_names():
        ids = await handlers.chat_prompt(engine, chat, chat_tools(chat, state.config.tool_call_parser))
    return _json(request, {"input_tokens": len(ids)})


_EXAMPLE = {"messages": [{"role": "user", "content": "Name three colours."}]}
ENDPOINTS = [
    Endpoint("POST", PATH, messages, "A message (Anthropic's Messages API)", MessagesRequest, AnthropicMessage,
             streams=True, example={**_EXAMPLE, "max_tokens": 16}, error=AnthropicError),
    Endpoint("POST", PATH + "/count_tokens", count_tokens, "The input tokens of a Messages request",
             CountTokensRequest, TokenCount, example=_EXAMPLE, error=AnthropicError),
]
