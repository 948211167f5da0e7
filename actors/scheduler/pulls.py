"""Requests whose prompt prefix is pulled from a peer engine before they are scheduled.

The gateway names the peer (`SubmitRequest.pull_from`); the scheduler hands such a request to its KV
transfer actor (actors/kv/prefix_pull.py), which sends it back, without the peer, once the blocks are
in the KV tier, unless the measured rates say computing the prefix here is quicker (pull_cost.py). An
abort that comes meanwhile finds nothing to abort in the scheduler: it is kept here, and the request is
dropped when it comes back.
"""

from __future__ import annotations

from actors.messages.front_end import SubmitRequest
from actors.scheduler.pull_cost import PullCost


class PullGate:
    def __init__(self) -> None:
        self.enabled = False          # the engine has a KV tier and a transfer actor
        self.cost: PullCost | None = None   # with the transfer actor: what a pull costs against a prefill
        self._pulling: set[str] = set()
        self._aborted: set[str] = set()

    def hold(self, msg: SubmitRequest) -> bool:
        """True when the request is not for the scheduler now: it goes to be pulled for first (the
        caller sends it), or it came back from its pull aborted. A request not held for a pull is
        computed here whatever peer it names."""
        if msg.pull_from is not None:
            if self.enabled and msg.handoff_to is None and (self.cost is None
                                                              or self.cost.should_pull(msg.pull_from.node)):
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
