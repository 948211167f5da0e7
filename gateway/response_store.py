"""Stored responses of /v1/responses: what `previous_response_id` continues and what
GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items reach.

In this gateway process's memory only: bounded in entries and in bytes (the least recently used
goes first) and in age (an entry expires `ttl_s` after it was stored, used or not). Gateways do
not share it, so a cluster of several needs sticky routing for conversations to continue. The
clock is a parameter, so bounds and expiry are tested without sleeping.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import msgspec

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class StoredResponse:
    body: dict          # the Response object, as it was returned
    history: list       # the conversation after it, as chat messages (instructions left out)
    inputs: list        # the request's own input items, with ids (GET /v1/responses/{id}/input_items)
    stored_at: float
    size: int           # bytes counted against the store's bound


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s <= 0:
            raise ValueError("a response store needs max_entries >= 0, max_bytes >= 0 and ttl_s > 0")
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()   # least recently used first
        self._born: OrderedDict[str, float] = OrderedDict()               # oldest first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, history: list, inputs: list | None = None) -> bool:
        """Store a response; False when it alone is larger than the store (it is not kept)."""
        inputs = inputs or []
        size = len(_encode(body)) + len(_encode(history)) + len(_encode(inputs))
        self.delete(response_id)
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        now = self.clock()
        self._expire(now)
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + size > self.max_bytes):
            self.delete(next(iter(self._entries)))
        self._entries[response_id] = StoredResponse(body, history, inputs, now, size)
        self._born[response_id] = now
        self.nbytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown, evicted or expired."""
        self._expire(self.clock())
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._born[response_id]
        self.nbytes -= entry.size
        return True

    def _expire(self, now: float) -> None:
        while self._born:
            oldest, born = next(iter(self._born.items()))
            if now - born < self.ttl_s:
                return
            self.delete(oldest)
