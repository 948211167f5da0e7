"""Requests whose prompt prefix is pulled from a peer engine before they are scheduled.

The gateway names the peer (`SubmitRequest.pull_from`); the scheduler hands such a request to its KV
transfer actor (actors/kv/prefix_pull.py), which sends it back, without the peer, once the blocks are
in the KV tier. An abort that comes meanwhile finds nothing to abort in the scheduler: it is kept here,
and the request is dropped when it comes back.
"""

from __future__ import annotations

from actors.messages import SubmitRequest


class PullGate:
    def __init__(self) -> None:
        self.enabled = False          # the engine has a KV tier and a transfer actor
        self._pulling: set[str] = set()
        self._aborted: set[str] = set()

    def hold(self, msg: SubmitRequest) -> bool:
        """True when the request is not for the scheduler now: it goes to be pulled for first (the
        caller sends it), or it came back from its pull aborted."""
        if msg.pull_from is not None:
            if self.enabled and msg.handoff_to is None:
                self._pulling.add(msg.request_id)
                return True
            return False
        if msg.request_id in self._pulling:
            self._pulling.discard(msg.request_id)
            if msg.request_id in self._aborted:
                self._aborted.discard(msg.request_id)
                return True
        return False

    def abort(self, request_id: str) -> None:
        if request_id in self._pulling:
            self._aborted.add(request_id)
