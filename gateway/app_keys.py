"""Typed application state keys, apart from the app factory so handlers can import them."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from gateway.state import GatewayState

if TYPE_CHECKING:   # the batch runner runs lines through the handlers, which import this
    from gateway.batch_runner import BatchRunner

STATE = web.AppKey("state", GatewayState)
BATCHES: web.AppKey[BatchRunner] = web.AppKey("batches")   # the Files and Batches API's store and runner
