"""Typed application state keys, apart from the app factory so handlers can import them."""
from aiohttp import web

from gateway.state import GatewayState

STATE = web.AppKey("state", GatewayState)
