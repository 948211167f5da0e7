"""POST /v1/chat/completions and /v1/completions: validate, tokenize, generate, respond.

Everything that can fail on bad input is checked before the first byte is written; after that
an error travels inside the stream as `data: {"error": ...}`, followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from aiohttp import web

from gateway import protocol
from gateway.app_keys import STATE
from gateway.engine_client import EngineLost, RequestFailed
from gateway.errors import APIError, internal, invalid, unavailable
from gateway.fill_in_middle import fim_prompt
from gateway.formats import ChatFormat, CompletionFormat
from gateway.generation import Generation
from gateway.params import COMPLETION_DEFAULT_MAX_TOKENS, MaxTokens, sampling_params
from gateway.request_log import CLIENT_REQUEST_ID, request_id
from gateway.responses import Envelope
from gateway.sse import SSEWriter
from gateway.state import GatewayState
from gateway.structured import compiled, structured_output
from gateway.tools import chat_tools, template_message
from runtime import bound, get_logger

_encode = msgspec.json.Encoder().encode
log = get_logger(component="gateway")
# Prompts longer than this (characters) are templated and tokenized in a thread, so one huge
# prompt does not stall every other stream on the event loop.
_THREAD_TOKENIZE_CHARS = 8192


async def read_body(request: web.Request) -> bytes:
    """The whole body, within the size cap and the read timeout (a client that sends half a body
    gets 408 and its connection closed, instead of holding it forever)."""
    config = request.app[STATE].config
    limit = config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"The request body is larger than {limit} bytes.",
                       code="request_too_large")
    try:
        async with asyncio.timeout(config.read_timeout_s):
            return await request.read()   # past client_max_size aiohttp raises 413, shaped by middleware
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {config.read_timeout_s:g} s.",
                       code="request_timeout", headers={"Connection": "close"}) from None


async def _accept(request: web.Request, type_: type, validate):
    """The body decoded and checked, and the engine that will serve it: the generation routes'
    common start, before anything is tokenized."""
    state = request.app[STATE]
    req = protocol.decode(await read_body(request), type_)
    validate(req)
    client, engine = state.require_engine()
    state.check_model(req.model)
    return state, req, client, engine


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state, req, client, engine = await _accept(request, protocol.ChatRequest, protocol.validate_chat)
    # The template sees reasoning_effort; one that has no use for it renders as before.
    kwargs = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {}
    tools = chat_tools(req, state.config.tool_call_parser)
    if tools is not None:
        kwargs["tools"] = tools.template
    prompt = await render_chat(engine.tokenizer, req.messages, True, **kwargs)
    top = (req.top_logprobs or 0) if req.logprobs else None
    config = state.config
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = MaxTokens(getattr(req, param), param, config.max_tokens_default, config.max_tokens_limit)
    structured = structured_output(req, tools and tools.forced, config.max_grammar_chars)
    params = sampling_params(req, [prompt], budget, engine, "messages", top,
                             prompt_logprobs=req.prompt_logprobs,
                             structured=structured and structured.spec)
    state.check_capacity(params.n)   # before compiling: a full queue refuses at once
    await compiled(structured, config.grammar_timeout_s)
    rid = _engine_request_id(request)
    fmt = ChatFormat(Envelope("chatcmpl", rid, state.model_name), state.token_strings, params.n, top,
                     req.prompt_logprobs, tools.parser if tools is not None else None)
    gen = Generation(client, engine.tokenizer, rid, [prompt], params, params.stop,
                     req.priority or 0, state.metrics, arrival)
    return await _respond(request, state, gen, fmt, bool(req.stream), _include_usage(req))


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state, req, client, engine = await _accept(request, protocol.CompletionRequest,
                                               protocol.validate_completion)
    tok = engine.tokenizer
    given = protocol.completion_prompts(req.prompt, tok.vocab_size)
    if req.suffix is not None:
        prompts = [await off_loop(len(p) + len(req.suffix), fim_prompt, tok, p, req.suffix) for p in given]
    else:
        prompts = [p if isinstance(p, list) else await off_loop(len(p), tok.encode, p) for p in given]
    # The engine computes the prompt's logprobs for `prompt_logprobs`, and for `echo` with `logprobs`.
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    config = state.config
    default = COMPLETION_DEFAULT_MAX_TOKENS if config.max_tokens_default is None else config.max_tokens_default
    budget = MaxTokens(req.max_tokens, "max_tokens", default, config.max_tokens_limit)
    structured = structured_output(req, max_chars=config.max_grammar_chars)
    params = sampling_params(req, prompts, budget, engine, "prompt", req.logprobs,
                             prompt_logprobs=max(wanted) if wanted else None,
                             structured=structured and structured.spec)
    state.check_capacity(params.n * len(prompts))   # before compiling: a full queue refuses at once
    await compiled(structured, config.grammar_timeout_s)
    rid = _engine_request_id(request)
    echo = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)
            for p in given for _ in range(params.n)] if req.echo else None
    fmt = CompletionFormat(Envelope("cmpl", rid, state.model_name), state.token_strings,
                           params.n * len(prompts), req.logprobs, echo,
                           [ids for ids in prompts for _ in range(params.n)], req.prompt_logprobs)
    gen = Generation(client, tok, rid, prompts, params, params.stop, req.priority or 0,
                     state.metrics, arrival)
    return await _respond(request, state, gen, fmt, bool(req.stream), _include_usage(req))


async def render_chat(tokenizer, messages: list[protocol.ChatMessage],
                      add_generation_prompt: bool, **template_kwargs) -> list[int]:
    """The conversation through the model's chat template, as token ids (off the loop when long)."""
    msgs = [template_message(m, i) for i, m in enumerate(messages)]
    try:
        return await off_loop(sum(len(m["content"]) for m in msgs),
                              tokenizer.apply_chat_template, msgs, add_generation_prompt,
                              **template_kwargs)
    except Exception as e:   # a template that rejects this conversation (e.g. role order)
        raise invalid(f"The chat template cannot render these messages: {e}", param="messages")


async def off_loop(size: int, fn, *args, **kwargs):
    """`fn` on a worker thread when its input is long, so other streams keep flowing."""
    if size > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _engine_request_id(request: web.Request) -> str:
    """The HTTP request's id, unless the client chose it: the engine's ids must be unique."""
    return uuid.uuid4().hex if request[CLIENT_REQUEST_ID] else request_id(request)


def _include_usage(req: protocol._Common) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _respond(request, state: GatewayState, gen: Generation, fmt, stream: bool,
                   include_usage: bool) -> web.StreamResponse:
    state.generations.add(gen)
    with bound(engine_request_id=gen.request_id):   # beside the HTTP request's id on its log lines
        try:
            gen.start()
            if stream:
                return await _stream(request, state, gen, fmt, include_usage)
            while not gen.done:
                for cd in await gen.next():
                    fmt.add(cd)
            return web.Response(body=_encode(fmt.whole(gen.usage())),
                                content_type="application/json")
        except EngineLost as e:
            raise unavailable(str(e)) from None
        except RequestFailed as e:
            raise internal(str(e)) from None
        finally:
            # Also on cancellation (the client went away): aborts the engine request, frees its KV.
            gen.close()
            state.generations.discard(gen)


async def _stream(request, state: GatewayState, gen: Generation, fmt,
                  include_usage: bool) -> web.StreamResponse:
    sse = SSEWriter()
    await sse.open(request)
    interval = state.config.ping_interval_s
    try:
        if first := fmt.first_events():
            await sse.send(*first)
        while not gen.done:
            batch = await gen.next(timeout=interval)
            if batch is None:
                await sse.ping()
                continue
            events = [c for cd in batch if (c := fmt.chunk(cd)) is not None]
            if events:
                await sse.send(*events)
        if include_usage:
            await sse.send(fmt.usage_event(gen.usage()))
        await sse.done()
    except EngineLost as e:
        await sse.fail(unavailable(str(e)))
    except RequestFailed as e:
        await sse.fail(internal(str(e)))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:   # headers are out: the error can only travel inside the stream
        log.exception("stream failed")
        await sse.fail(internal())
    return sse.response
