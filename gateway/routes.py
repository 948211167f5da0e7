"""The route table: generation endpoints plus models, health, readiness, metrics, tokenize."""
from __future__ import annotations

import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import dashboard, handlers, planner, protocol
from gateway.app_keys import STATE
from gateway.errors import invalid, unavailable

_encode = msgspec.json.Encoder().encode
_STARTED = int(time.time())


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready:
        return _json({"status": "ready", "model": state.model_name})
    reason = ("draining" if state.draining else
              f"engine failed to start: {state.startup_error}" if state.startup_error else
              "engine not ready")
    return unavailable(f"Not ready: {reason}.").response()


def _model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": _STARTED, "owned_by": "matinee",
            "root": state.engine.model_path, "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_engine()
    return _json({"object": "list", "data": [_model_card(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_engine()
    state.check_model(request.match_info["model"])
    return _json(_model_card(state))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    await state.metrics.refresh(state.client)
    return web.Response(text=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    """Tokenized exactly as the generation routes do, and off the loop for long text as they are."""
    state = request.app[STATE]
    req = protocol.decode(await handlers.read_body(request), protocol.TokenizeRequest)
    _, engine = state.require_engine()
    state.check_model(req.model)
    tok = engine.tokenizer
    if req.messages is not None and req.prompt is None:
        ids = await handlers.render_chat(tok, req.messages, req.add_generation_prompt)
    elif req.prompt is not None and req.messages is None:
        ids = await handlers.off_loop(len(req.prompt), tok.encode, req.prompt,
                                      add_special_tokens=req.add_special_tokens)
    else:
        raise invalid("Give exactly one of `prompt` and `messages`.", param="prompt")
    return _json({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = protocol.decode(await handlers.read_body(request), protocol.DetokenizeRequest)
    _, engine = state.require_engine()
    state.check_model(req.model)
    vocab = engine.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise invalid(f"Token ids must be in [0, {vocab}).", param="tokens")
    text = await handlers.off_loop(len(req.tokens), engine.tokenizer.decode, req.tokens,
                                   skip_special_tokens=False)
    return _json({"prompt": text})


ROUTES = [
    web.post("/v1/chat/completions", handlers.chat_completions),
    web.post("/v1/completions", handlers.completions),
    web.get("/v1/models", list_models),
    web.get("/v1/models/{model:.+}", get_model),
    web.get("/health", health),
    web.get("/ready", ready),
    web.get("/metrics", metrics),
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    *dashboard.ROUTES,
    *planner.ROUTES,
]
UNPROTECTED = frozenset({"/health", "/ready"}) | dashboard.PUBLIC
