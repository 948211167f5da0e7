"""The engine's stand-in for a draft worker on a draft node (`speculative={"draft_node": id}`).

The scheduler talks to it exactly as to a local draft worker. It forwards each Propose to the
engine's worker on the node, with a short timeout: when the node is slow, gone or restarting,
the step gets no drafts at once (drafts only save time) and the link attaches again in the
background after a back-off, never holding up a step. A restarted node has lost its sequences'
state; it drafts for the sequences that start after it is back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from actors.draft.messages import AttachDraft, DraftAttached, DraftStats, GetDraftStats, Propose, Proposals
from runtime import Actor, ActorRef

DRAFT_NODE_PREFIX = "drafts/"


class AttachNow:
    """Local only: attach and answer "" (attached), "unreachable" or the node's refusal."""


class DraftLink(Actor):
    def __init__(self, node_id: str, attach: AttachDraft, timeout_s: float = 2.0, retry_s: float = 5.0,
                 attach_timeout_s: float = 120.0):
        self.name = DRAFT_NODE_PREFIX + node_id
        self.attach = attach
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.attach_timeout_s = attach_timeout_s   # a draft model loads its weights before answering
        self.worker: ActorRef | None = None
        self.draft_cost = 0.0
        self.refused = ""
        self._retry_at = 0.0
        self._attaching: asyncio.Task | None = None

    async def on_stop(self) -> None:
        if self._attaching is not None:
            self._attaching.cancel()

    async def receive(self, msg: Any) -> Any:
        match msg:
            case Propose():
                return await self._propose(msg)
            case AttachNow():
                return await self._attach()
            case GetDraftStats():
                if self.worker is not None:
                    try:
                        return await self.worker.ask(msg, timeout=self.timeout_s)
                    except Exception:
                        pass
                return DraftStats(0, 0, 0.0, self.draft_cost)
        return await super().receive(msg)

    async def _attach(self) -> str:
        self._retry_at = time.monotonic() + self.retry_s
        try:
            service = await self.context.system.resolve(self.name)
            if service is None:
                return "unreachable"
            reply: DraftAttached = await service.ask(self.attach, timeout=self.attach_timeout_s)
        except Exception as e:
            self.context.log.warning("draft node unreachable", node=self.name, error=repr(e))
            return "unreachable"
        if reply.worker is None:
            self.refused = reply.error or "refused"
            self.context.log.error("draft node refused this engine; drafting stays off", error=self.refused)
            return self.refused
        self.worker, self.draft_cost = reply.worker, reply.draft_cost
        self.context.log.info("draft node attached", node=self.name)
        return ""

    def _attach_later(self) -> None:
        if self.refused or self._attaching is not None or time.monotonic() < self._retry_at:
            return

        async def attach() -> None:
            try:
                await self._attach()
            finally:
                self._attaching = None

        self._attaching = asyncio.create_task(attach())

    async def _propose(self, msg: Propose) -> Proposals:
        empty = Proposals(msg.step_id, [])
        worker = self.worker
        if worker is None:
            self._attach_later()
            return empty
        if not any(d.num_spec for d in msg.seqs):
            worker.tell(msg)   # only the history moves on (or state to drop)
            return empty
        try:
            return await worker.ask(msg, timeout=self.timeout_s)
        except Exception as e:
            self.context.log.warning("draft node failed a step; drafting paused", error=repr(e), retry_s=self.retry_s)
            if self.worker is worker:
                self.worker, self._retry_at = None, time.monotonic() + self.retry_s
            return empty
