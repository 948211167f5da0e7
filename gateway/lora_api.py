"""vLLM's LoRA adapter routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

Behind the API key like every route, and refused unless the server was started with
--enable-lora-runtime-updates. A folder the engine cannot serve is a 400 naming the problem
(rank, shapes, a missing file) and changes nothing; an unload lets the requests that use the
adapter finish with it, while new ones naming it get 404.
"""
from __future__ import annotations

import msgspec
from aiohttp import web

from actors.messages.front_end import LoadLoRAAdapter, UnloadLoRAAdapter
from gateway import handlers, protocol
from gateway.app_keys import STATE
from gateway.errors import APIError, invalid, not_found


class LoadLoRARequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None   # vLLM's; the name alone picks the adapter here


async def load_lora_adapter(request: web.Request) -> web.Response:
    state, req = await _accept(request, LoadLoRARequest)
    if not req.lora_path:
        raise invalid("`lora_path` must name the adapter's folder.", param="lora_path")
    if req.lora_name in state.model_names:
        raise invalid(f"`{req.lora_name}` is the base model's name.", param="lora_name")
    await _apply(state, LoadLoRAAdapter(req.lora_name, req.lora_path))
    state.loras[req.lora_name] = req.lora_path
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state, req = await _accept(request, UnloadLoRARequest)
    await _apply(state, UnloadLoRAAdapter(req.lora_name))
    state.loras.pop(req.lora_name, None)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _accept(request: web.Request, type_: type):
    state = request.app[STATE]
    if not state.config.enable_lora_runtime_updates:
        raise not_found("Loading and unloading LoRA adapters at run time is off: start the server with "
                        "--enable-lora-runtime-updates.")
    req = protocol.decode(await handlers.read_body(request), type_)
    if not req.lora_name:
        raise invalid("`lora_name` must not be empty.", param="lora_name")
    state.require_engine()
    return state, req


async def _apply(state, msg: LoadLoRAAdapter | UnloadLoRAAdapter) -> None:
    outcome = await state.client.manage_lora(msg)
    if outcome.error:
        raise APIError(outcome.status, outcome.error)
