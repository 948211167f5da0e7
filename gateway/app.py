"""The aiohttp application factory: routes, middlewares (request id and access log, CORS, errors,
API keys), startup and shutdown.

The actor system and the engine start in a cleanup_ctx; the engine loads in a background task
so /health answers at once and /ready turns 200 when the engine can serve.
"""
from __future__ import annotations

import asyncio
import hmac

from aiohttp import web

from gateway.app_keys import STATE
from gateway.batches_api import batch_lifecycle
from gateway.config import GatewayConfig
from gateway.cors import CorsPolicy
from gateway.errors import APIError, internal
from gateway.messages_api import anthropic_error_response, speaks_anthropic
from gateway.request_log import request_log_middleware, send_request_id
from gateway.responses_api import RESPONSE_STORE, response_store
from gateway.routes import ROUTES, UNPROTECTED
from gateway.state import EngineLauncher, GatewayState
from gateway.tenant import api_key_of, tenant_middleware
from runtime import ActorSystem, get_logger

log = get_logger(component="gateway")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return _error_response(request, e)
    except web.HTTPException as e:   # no route, wrong method, body over client_max_size
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return _error_response(request, APIError(e.status, e.reason, param=None, code=code,
                                                 headers={k: v for k, v in e.headers.items() if k == "Allow"}))
    except (ConnectionResetError, asyncio.CancelledError):
        raise   # the client is gone: nothing to answer
    except Exception:
        log.exception("unhandled error", path=request.path)
        return _error_response(request, internal())


def _error_response(request: web.Request, e: APIError) -> web.Response:
    """OpenAI's error shape, but Anthropic's on its Messages API's paths."""
    return anthropic_error_response(request, e) if speaks_anthropic(request.path) else e.response()


def auth_middleware(api_keys: tuple[str, ...]):
    expected = [k.encode() for k in api_keys]

    @web.middleware
    async def check_key(request: web.Request, handler):
        if request.path not in UNPROTECTED:
            given = api_key_of(request).encode()
            # Every key compared, so the time taken tells nothing about which one came close.
            if sum(hmac.compare_digest(given, e) for e in expected) == 0:
                raise APIError(401, "Incorrect or missing API key.", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_key


def server_options(config: GatewayConfig) -> dict:
    """aiohttp server settings for `web.run_app` and `web.AppRunner`. aiohttp closes a connection
    that has not sent a whole request's headers within keepalive_timeout of connecting (or of its
    last response), which bounds slow headers; `read_body` bounds the body."""
    return {"handler_cancellation": True, "keepalive_timeout": config.read_timeout_s,
            "shutdown_timeout": 30.0}


def create_app(config: GatewayConfig, launcher: EngineLauncher,
               system: ActorSystem | None = None) -> web.Application:
    """`launcher(system)` starts or reaches an engine; `system` defaults to a new one."""
    cors = CorsPolicy(config.allowed_origins)
    middlewares = [request_log_middleware(not config.disable_access_log), cors.middleware(),
                   errors_middleware]
    if config.api_keys:
        middlewares.append(auth_middleware(config.api_keys))
    middlewares.append(tenant_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(send_request_id)
    app.on_response_prepare.append(cors.on_response_prepare)
    app[STATE] = GatewayState(config=config, launcher=launcher, system=system)
    app[RESPONSE_STORE] = response_store(config)
    app.add_routes(ROUTES)
    app.cleanup_ctx.append(_lifecycle)
    app.cleanup_ctx.append(batch_lifecycle)
    app.on_shutdown.append(_drain)
    return app


async def _lifecycle(app: web.Application):
    state = app[STATE]
    own_system = state.system is None
    if own_system:
        state.system = ActorSystem(name="gateway")
        await state.system.start()
    task = asyncio.create_task(_connect(state), name="engine-connect")
    yield
    state.draining = True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if state.engine is not None and state.engine.close is not None:
        await state.engine.close()
    if own_system:
        await state.system.shutdown()


async def _connect(state: GatewayState) -> None:
    try:
        await state.connect()
    except asyncio.CancelledError:
        raise
    except Exception as e:   # keep serving /health and /ready (503, with the reason)
        state.startup_error = f"{type(e).__name__}: {e}"
        log.error("engine failed to start", error=state.startup_error)
        state.ready_event.set()


async def _drain(app: web.Application) -> None:
    app[STATE].draining = True
