"""POST /v1/chat/completions and /v1/completions: validate, tokenize, generate, respond.

Everything that can fail on bad input is checked before the first byte is written; after that
an error travels inside the stream as `data: {"error": ...}`, followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
from aiohttp import web

from gateway import protocol, reasoning
from gateway.app_keys import STATE
from gateway.engine_client import EngineLost, RequestFailed
from gateway.errors import APIError, internal, invalid, unavailable
from gateway.fill_in_middle import fim_prompt
from gateway.formats import ChatFormat, CompletionFormat
from gateway.generation import Generation
from gateway.params import COMPLETION_DEFAULT_MAX_TOKENS, MaxTokens, sampling_params, truncated
from gateway.request_log import CLIENT_REQUEST_ID, request_id
from gateway.responses import Envelope, token_id_strings
from gateway.sse import SSEWriter
from gateway.state import GatewayState
from gateway.structured import Structured, compiled, structured_output
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


class Ids(NamedTuple):
    """Who asks: the id of the HTTP request (or of a batch line) and whether its client chose it."""

    given: str
    client_chose: bool = False


def ids_of(request: web.Request) -> Ids:
    return Ids(request_id(request), request[CLIENT_REQUEST_ID])


@dataclass(frozen=True)
class Call:
    """One generation call as the routes take it: an HTTP request's body, or a batch line's."""

    state: GatewayState
    body: bytes
    ids: Ids
    arrival: float
    ballast: bool = False   # a batch line: the engine runs it only in room interactive requests leave


@dataclass
class Prepared:
    """A validated call's Generation (not started) and how its output is shaped."""

    gen: Generation
    fmt: ChatFormat | CompletionFormat
    stream: bool
    usage: tuple[bool, bool]   # see _stream_usage


async def http_call(request: web.Request) -> Call:
    return Call(request.app[STATE], await read_body(request), ids_of(request), time.monotonic())


async def accept_body(state: GatewayState, body: bytes, type_: type, validate):
    """The body decoded and checked, and the engine that will serve it: the generation routes'
    common start, before anything is tokenized."""
    req = protocol.decode(body, type_)
    validate(req)
    client, engine = state.require_engine()
    await state.resolve_model(req.model)
    return req, client, engine


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _respond(request, await prepare_chat(await http_call(request)))


async def prepare_chat(call: Call) -> Prepared:
    req, client, engine = await accept_body(call.state, call.body, protocol.ChatRequest, protocol.validate_chat)
    gen, fmt = await chat_generation(call.ids, call.state, req, client, engine, call.arrival,
                                     ballast=call.ballast)
    return Prepared(gen, fmt, bool(req.stream), _stream_usage(req))


async def chat_generation(ids: Ids, state: GatewayState, req: protocol.ChatRequest, client, engine,
                          arrival: float, id_prefix: str = "chatcmpl",
                          ballast: bool = False) -> tuple[Generation, ChatFormat]:
    """A validated chat request's Generation (not started) and the ChatFormat of its output, every
    check that needs the engine done. Chat Completions and the APIs translated into a chat request
    share it, so a conversation becomes tokens and sampling parameters in one place."""
    tools = chat_tools(req, state.config.tool_call_parser)
    prompt = await chat_prompt(engine, req, tools)
    top = (req.top_logprobs or 0) if req.logprobs else None
    config = state.config
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = MaxTokens(getattr(req, param), param, config.max_tokens_default, config.max_tokens_limit)
    thinking = _thinking(state, req, engine.tokenizer, prompt)
    structured = structured_output(req, tools and tools.forced, config.max_grammar_chars)
    if structured is not None and thinking:   # the grammar is the answer's, after the thinking
        structured = Structured(reasoning.after_thinking(structured.spec, structured.param), structured.param)
    params = sampling_params(req, [prompt], budget, engine, "messages", top,
                             prompt_logprobs=req.prompt_logprobs,
                             structured=structured and structured.spec)
    state.check_capacity(params.n)   # before compiling: a full queue refuses at once
    await compiled(structured, config.grammar_timeout_s)
    rid, shown = request_ids(ids, req)
    lora = state.check_model(req.model)
    fmt = ChatFormat(Envelope(id_prefix, shown, lora or state.model_name), _token_strings(state, req), params.n,
                     top, req.prompt_logprobs, tools.parser if tools is not None else None, _echo(req),
                     thinking)
    gen = Generation(client, engine.tokenizer, rid, [prompt], params, params.stop,
                     req.priority or 0, state.metrics.of(ballast), arrival, req.cache_salt, ballast, lora)
    return gen, fmt


def _thinking(state: GatewayState, req: protocol.ChatRequest, tokenizer, prompt: list[int]) -> bool | None:
    """Whether the output starts inside the model's thinking; None without a reasoning parser."""
    if state.config.reasoning_parser is None:
        return None
    parser = reasoning.PARSERS[state.config.reasoning_parser]
    return parser.thinks(req.chat_template_kwargs, reasoning.prompt_tail(tokenizer, prompt))


async def chat_prompt(engine, req: protocol.ChatRequest, tools) -> list[int]:
    """The prompt's token ids, as the engine will get them (also what a token count counts)."""
    prompt = await render_chat(engine.tokenizer, req.messages, add_special_tokens=bool(req.add_special_tokens),
                               **_template_kwargs(req, tools))
    return truncated(prompt, req.truncate_prompt_tokens, engine.max_model_len)


def _echo(req: protocol.ChatRequest) -> str | None:
    """vLLM's chat `echo`: the last message's text, when it is the assistant's the reply continues."""
    last = req.messages[-1]
    return protocol.message_text(last) if req.echo and last.role == "assistant" else None


def _template_kwargs(req: protocol.ChatRequest, tools) -> dict:
    """What the chat template sees beside the messages; vLLM's `chat_template_kwargs` last, so
    they may set any of them (enable_thinking, say) as vLLM lets them."""
    kwargs = {"add_generation_prompt": req.add_generation_prompt is not False,
              "continue_final_message": bool(req.continue_final_message)}
    if req.reasoning_effort:   # a template that has no use for it renders as before
        kwargs["reasoning_effort"] = req.reasoning_effort
    if tools is not None:
        kwargs["tools"] = tools.template
    if req.documents is not None:
        kwargs["documents"] = req.documents
    kwargs.update(req.chat_template_kwargs or {})
    return kwargs


async def completions(request: web.Request) -> web.StreamResponse:
    return await _respond(request, await prepare_completion(await http_call(request)))


async def prepare_completion(call: Call) -> Prepared:
    state = call.state
    req, client, engine = await accept_body(state, call.body, protocol.CompletionRequest, protocol.validate_completion)
    tok = engine.tokenizer
    given = protocol.completion_prompts(req.prompt, tok.vocab_size)
    if req.suffix is not None:
        prompts = [await off_loop(len(p) + len(req.suffix), fim_prompt, tok, p, req.suffix) for p in given]
    else:
        special = req.add_special_tokens is not False
        prompts = [p if isinstance(p, list) else await off_loop(len(p), tok.encode, p, special) for p in given]
    prompts = [truncated(p, req.truncate_prompt_tokens, engine.max_model_len) for p in prompts]
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
    rid, shown = request_ids(call.ids, req)
    echo = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)
            for p in given for _ in range(params.n)] if req.echo else None
    lora = state.check_model(req.model)
    fmt = CompletionFormat(Envelope("cmpl", shown, lora or state.model_name), _token_strings(state, req),
                           params.n * len(prompts), req.logprobs, echo,
                           [ids for ids in prompts for _ in range(params.n)], req.prompt_logprobs)
    gen = Generation(client, tok, rid, prompts, params, params.stop, req.priority or 0,
                     state.metrics.of(call.ballast), call.arrival, req.cache_salt, call.ballast, lora)
    return Prepared(gen, fmt, bool(req.stream), _stream_usage(req))


async def render_chat(tokenizer, messages: list[protocol.ChatMessage], add_generation_prompt: bool = True,
                      add_special_tokens: bool = False, **template_kwargs) -> list[int]:
    """The conversation through the model's chat template, as token ids (off the loop when long).
    `add_special_tokens` (vLLM's, off by default: templates write their own BOS) tokenizes the
    rendered text with the tokenizer's special tokens added as well."""
    msgs = [template_message(m, i) for i, m in enumerate(messages)]

    def render() -> list[int]:
        if add_special_tokens:
            return tokenizer.encode(tokenizer.render_chat(msgs, add_generation_prompt, **template_kwargs))
        return tokenizer.apply_chat_template(msgs, add_generation_prompt, **template_kwargs)

    try:
        return await off_loop(sum(len(m["content"]) for m in msgs), render)
    except Exception as e:   # a template that rejects this conversation (e.g. role order)
        raise invalid(f"The chat template cannot render these messages: {e}", param="messages")


async def off_loop(size: int, fn, *args, **kwargs):
    """`fn` on a worker thread when its input is long, so other streams keep flowing."""
    if size > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def request_ids(ids: Ids, req: protocol._Common) -> tuple[str, str]:
    """The engine's id for this request and the id its response shows. The engine's is the HTTP
    request's unless the client chose that (its `X-Request-Id`, or vLLM's `request_id` field):
    engine ids must be unique. The response shows the client's choice, the header first as vLLM."""
    if ids.client_chose:
        return uuid.uuid4().hex, ids.given
    if req.request_id is not None:
        return uuid.uuid4().hex, req.request_id
    return ids.given, ids.given


def _token_strings(state: GatewayState, req: protocol._Common):
    """How logprobs name tokens: their text, or (vLLM's `return_tokens_as_token_ids`) their ids."""
    return token_id_strings if req.return_tokens_as_token_ids else state.token_strings


def _stream_usage(req: protocol._Common) -> tuple[bool, bool]:
    """(usage in a last chunk, usage so far in every chunk). As vLLM: `stream_options` given means
    usage unless `include_usage` is false; `continuous_usage_stats` adds it to every chunk."""
    options = req.stream_options
    if options is None or options.include_usage is False:
        return False, False
    return True, bool(options.continuous_usage_stats)


@contextlib.contextmanager
def running(state: GatewayState, gen: Generation):
    """`gen` started and tracked while the block runs; always closed after it (also when the
    client went away: the engine request is aborted and its KV freed). An engine lost or a failed
    request before the response starts becomes a 503 or a 500."""
    state.generations.add(gen)
    with bound(engine_request_id=gen.request_id):   # beside the HTTP request's id on its log lines
        try:
            gen.start()
            yield gen
        except EngineLost as e:
            raise unavailable(str(e)) from None
        except RequestFailed as e:
            raise internal(str(e)) from None
        finally:
            gen.close()
            state.generations.discard(gen)


async def _respond(request, prepared: Prepared) -> web.StreamResponse:
    state = request.app[STATE]
    if prepared.stream:
        with running(state, prepared.gen):
            return await _stream(request, state, prepared.gen, prepared.fmt, *prepared.usage)
    return web.Response(body=_encode(await whole(state, prepared)), content_type="application/json")


async def whole(state: GatewayState, prepared: Prepared) -> dict:
    """The call run to its end, as the one JSON body a non-streamed response is."""
    gen, fmt = prepared.gen, prepared.fmt
    with running(state, gen):
        while not gen.done:
            for cd in await gen.next():
                fmt.add(cd)
        return fmt.whole(gen.usage())


async def _stream(request, state: GatewayState, gen: Generation, fmt, include_usage: bool,
                  continuous_usage: bool) -> web.StreamResponse:
    sse = SSEWriter()
    await sse.open(request)
    interval = state.config.ping_interval_s
    try:
        if first := fmt.first_events():
            if continuous_usage:
                for event in first:
                    event["usage"] = gen.usage(0)
            await sse.send(*first)
        while not gen.done:
            batch = await gen.next(timeout=interval)
            if batch is None:
                await sse.ping()
                continue
            events = [c for cd in batch if (c := fmt.chunk(cd)) is not None]
            if continuous_usage:   # each chunk carries one choice: that choice's usage so far
                for event in events:
                    event["usage"] = gen.usage(event["choices"][0]["index"])
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
