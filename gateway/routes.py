"""The route table: generation endpoints plus models, health, readiness, metrics, tokenize, and
the OpenAPI document of them all."""
from __future__ import annotations

import importlib.metadata
import time

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import api_types, batches_api, dashboard, embeddings, files_api, handlers, lora_api, messages_api
from gateway import openapi, planner, protocol
from gateway import responses_api, responses_protocol, responses_types
from gateway.app_keys import STATE
from gateway.errors import invalid, unavailable
from gateway.openapi import Endpoint

_encode = msgspec.json.Encoder().encode
_STARTED = int(time.time())
_VERSION = importlib.metadata.version("matinee")


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


def _model_card(state, name: str) -> dict:
    """The base model's card, or a LoRA adapter's: its folder as `root`, the base model as `parent`."""
    lora = state.loras.get(name)
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": "matinee",
            "root": lora or state.engine.model_path, "parent": state.model_name if lora else None,
            "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_engine()
    await state.refresh_loras()
    names = state.model_names + sorted(state.loras)
    return _json({"object": "list", "data": [_model_card(state, name) for name in names]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.require_engine()
    name = request.match_info["model"]
    state.check_model(name)
    return _json(_model_card(state, name))


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


async def openapi_json(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _json(openapi.document(ENDPOINTS, "Matinee", _VERSION, with_keys=bool(state.config.api_keys)))


ENDPOINTS = [
    Endpoint("POST", "/v1/chat/completions", handlers.chat_completions, "A chat completion",
             protocol.ChatRequest, api_types.ChatCompletion, streams=True,
             example={"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16}),
    Endpoint("POST", "/v1/completions", handlers.completions, "A text completion",
             protocol.CompletionRequest, api_types.Completion, streams=True,
             example={"prompt": "The capital of France is", "max_tokens": 8}),
    Endpoint("POST", "/v1/embeddings", embeddings.embeddings, "Embeddings of texts or token ids",
             protocol.EmbeddingRequest, api_types.EmbeddingList,
             example={"input": ["The capital of France is Paris."]}),
    Endpoint("POST", "/v1/responses", responses_api.create_response, "A response (OpenAI's Responses API)",
             responses_protocol.ResponsesRequest, responses_types.ResponseObject, streams=True,
             example={"input": "Name three colours.", "max_output_tokens": 16}),
    Endpoint("GET", "/v1/responses/{response_id}", responses_api.get_response, "A stored response",
             response=responses_types.ResponseObject),
    Endpoint("GET", "/v1/responses/{response_id}/input_items", responses_api.list_input_items,
             "The input items of a stored response", response=responses_types.InputItemList),
    Endpoint("DELETE", "/v1/responses/{response_id}", responses_api.delete_response, "Forget a stored response",
             response=responses_types.ResponseDeleted),
    Endpoint("GET", "/v1/models", list_models, "The models served", response=api_types.ModelList),
    Endpoint("GET", "/v1/models/{model:.+}", get_model, "One model", response=api_types.ModelCard),
    Endpoint("POST", "/v1/load_lora_adapter", lora_api.load_lora_adapter,
             "Load a LoRA adapter (with --enable-lora-runtime-updates)", lora_api.LoadLoRARequest,
             content_type="text/plain"),
    Endpoint("POST", "/v1/unload_lora_adapter", lora_api.unload_lora_adapter,
             "Unload a LoRA adapter (with --enable-lora-runtime-updates)", lora_api.UnloadLoRARequest,
             content_type="text/plain"),
    Endpoint("GET", "/health", health, "Whether the process is up", response=api_types.Status,
             protected=False),
    Endpoint("GET", "/ready", ready, "Whether the engine can serve (503 until then)",
             response=api_types.Status, protected=False),
    Endpoint("GET", "/metrics", metrics, "Prometheus metrics", content_type="text/plain"),
    Endpoint("POST", "/tokenize", tokenize, "Token ids of a prompt or a conversation",
             protocol.TokenizeRequest, api_types.TokenizeResponse, example={"prompt": "Hello world"}),
    Endpoint("POST", "/detokenize", detokenize, "The text of token ids",
             protocol.DetokenizeRequest, api_types.DetokenizeResponse, example={"tokens": [5, 6]}),
    Endpoint("GET", "/openapi.json", openapi_json, "This document", content_type="application/json",
             protected=False),
]


def _dashboard(route: web.RouteDef) -> Endpoint:
    """A route of the dashboard (gateway/dashboard.py, gateway/planner.py): a page, a script or
    style sheet, or the data the pages draw; the planner's body is its PlanRequest."""
    plans = route.handler is planner.compute
    return Endpoint(route.method, route.path, route.handler, "The dashboard: a page, an asset or its data",
                    planner.PlanRequest if plans else None, content_type="*/*",
                    protected=route.path not in dashboard.PUBLIC, endless=route.handler is dashboard.stream,
                    example={"model": "llama-3-8b", "context_len": 8192, "concurrency": 4} if plans else None)


ENDPOINTS += messages_api.ENDPOINTS
ENDPOINTS += files_api.ENDPOINTS + batches_api.ENDPOINTS
ENDPOINTS += [_dashboard(r) for r in dashboard.ROUTES + planner.ROUTES]
ROUTES = [web.route(e.method, e.path, e.handler) for e in ENDPOINTS]
UNPROTECTED = frozenset(e.path for e in ENDPOINTS if not e.protected)
