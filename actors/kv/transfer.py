"""KV handoff between engines: a prefill engine's blocks, written into a decode engine's cache.

One actor per engine does both ends over the cluster transport. The sender offers the request
(the receiver reserves blocks, or refuses), streams the blocks in chunks of raw cache bytes
(`KVBlockIO`, no per-token messages, sealed like every frame), at most `window_bytes` of them
unacknowledged (a chunk is acknowledged once written, so a slow receiver slows the sender and
nothing piles up), then commits: the receiver's scheduler starts decoding. Whatever goes wrong
before the commit, the sender tells the request's front end, which continues it elsewhere, and
the receiver, which lets the reserved blocks go (as it does when the sender's node is lost). On a
GPU, NIXL or NCCL would move the bytes behind the same messages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.messages import (AdoptCommit, AdoptDrop, AdoptReserve, HandOver, HandOverDone, KVCancel, KVChunk,
                             KVCommit, KVHandoffFailed, KVOffer, KVOfferReply, KVReserved)
from runtime import Actor, ActorRef, Terminated

if TYPE_CHECKING:
    from actors.worker.kv_blocks import KVBlockIO   # torch: only where an engine runs


@dataclass(frozen=True)
class KVTransferConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py).
    window_bytes: int = field(default=8 << 20, metadata={
        "help": "KV bytes a prefill engine may have sent and not yet seen written (e.g. 8MiB)",
        "type": "bytes", "flag": "kv-transfer-window"})
    chunk_bytes: int = 1 << 20        # blocks per frame: as many as fit (at least one)
    timeout_s: float = 30.0           # a chunk, an offer or a commit not answered by then cuts the handoff;
                                      # a receiver that hears nothing of a handoff for twice that lets it go

    def __post_init__(self) -> None:
        if self.window_bytes < 1:
            raise ValueError(f"window_bytes must be positive, got {self.window_bytes}")
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


class HandoffCut(Exception):
    """The decode engine refused the handoff, or it failed on the way."""

    def __init__(self, reason: str, refused: bool = False):
        super().__init__(reason)
        self.refused = refused


@dataclass
class _Incoming:
    seq_id: int
    sender: ActorRef
    block_table: list[int]
    skip_blocks: int
    written: int = 0                  # blocks written so far
    heard: float = field(default_factory=time.monotonic)   # the sender's last offer or chunk


@dataclass(frozen=True)
class _CheckIdle:
    """To itself: has handoff `transfer_id` heard from its sender lately?"""
    transfer_id: str


class KVTransfer(Actor):
    def __init__(self, blocks: KVBlockIO, scheduler: ActorRef, block_size: int,
                 config: KVTransferConfig | None = None):
        self.blocks = blocks
        self.scheduler = scheduler
        self.block_size = block_size
        self.config = config or KVTransferConfig()
        self._incoming: dict[str, _Incoming] = {}
        self._watched: set[ActorRef] = set()
        self._sends: set[asyncio.Task] = set()
        self.peak_in_flight_bytes = 0     # the most a handoff ever had unacknowledged (<= the window)

    async def on_stop(self) -> None:
        for task in self._sends:
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)

    async def receive(self, msg: Any) -> Any:
        match msg:
            case HandOver():
                task = asyncio.create_task(self._send(msg))
                self._sends.add(task)
                task.add_done_callback(self._sends.discard)
            case KVOffer():
                return await self._on_offer(msg)
            case KVChunk():
                return self._on_chunk(msg)
            case KVCommit(transfer_id=tid):
                return await self._on_commit(tid)
            case KVCancel(transfer_id=tid):
                self._let_go(tid)
            case _CheckIdle(transfer_id=tid):
                self._check_idle(tid)
            case Terminated(ref=ref):
                self._watched.discard(ref)
                for tid in [tid for tid, inc in self._incoming.items() if inc.sender == ref]:
                    self._let_go(tid)
            case _:
                return await super().receive(msg)
        return None

    # ---- sending -------------------------------------------------------------------------------
    async def _send(self, h: HandOver) -> None:
        """Offer, chunks, commit; the scheduler hears the outcome, the front end a failure."""
        started = time.perf_counter()
        offer = h.offer
        num_blocks = -(-(len(offer.prompt_token_ids) + len(offer.output_token_ids) - 1) // self.block_size)
        sent_blocks = sent_bytes = 0
        ok, refused, accepted = False, False, False
        try:
            reply: KVOfferReply = await h.to.ask(offer, timeout=self.config.timeout_s)
            if not reply.accepted:
                raise HandoffCut(f"the decode engine refused the handoff: {reply.reason}", refused=reply.no_room)
            accepted = True
            sent_blocks, sent_bytes = await self._stream(h, reply.skip_blocks, num_blocks)
            await h.to.ask(KVCommit(offer.transfer_id), timeout=self.config.timeout_s)
            ok = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            refused = isinstance(exc, HandoffCut) and exc.refused
            if accepted or isinstance(exc, TimeoutError):   # it may hold blocks for us: they go back
                h.to.tell(KVCancel(offer.transfer_id))
            self.context.log.warning("KV handoff failed", request_id=offer.request_id, error=str(exc) or repr(exc))
            offer.reply_to.tell(KVHandoffFailed(offer.request_id, str(exc) or repr(exc), refused))
        finally:
            self.scheduler.tell(HandOverDone(h.seq_id, ok, refused, sent_blocks, sent_bytes,
                                             time.perf_counter() - started))

    async def _stream(self, h: HandOver, skip: int, num_blocks: int) -> tuple[int, int]:
        """Blocks [skip, num_blocks) in chunks, never more than the window unacknowledged."""
        per_chunk = max(1, self.config.chunk_bytes // self.blocks.bytes_per_block)
        in_flight: dict[asyncio.Task, int] = {}
        sent = 0
        try:
            for first in range(skip, num_blocks, per_chunk):
                ids = h.block_table[first:min(first + per_chunk, num_blocks)]
                size = len(ids) * self.blocks.bytes_per_block
                while in_flight and sum(in_flight.values()) + size > self.config.window_bytes:
                    done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        del in_flight[task]
                        task.result()   # a chunk that failed cuts the handoff
                chunk = KVChunk(h.offer.transfer_id, first, len(ids), self.blocks.read(ids))
                in_flight[asyncio.create_task(h.to.ask(chunk, timeout=self.config.timeout_s))] = size
                self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, sum(in_flight.values()))
                sent += size
            for task in list(in_flight):
                await task
                del in_flight[task]
        finally:
            for task in in_flight:
                task.cancel()
        return num_blocks - skip, sent

    # ---- receiving -----------------------------------------------------------------------------
    async def _on_offer(self, offer: KVOffer) -> KVOfferReply:
        if offer.block_layout != self.blocks.layout:
            return KVOfferReply(False, reason=f"KV layout {offer.block_layout} here is {self.blocks.layout}")
        reserved: KVReserved = await self.scheduler.ask(AdoptReserve(offer))
        if reserved.block_table is None:
            return KVOfferReply(False, reason="no room in the KV cache", no_room=True)
        self._incoming[offer.transfer_id] = _Incoming(reserved.seq_id, offer.sender, reserved.block_table,
                                                      reserved.num_hit_blocks)
        self.context.schedule_once(self._idle_s, _CheckIdle(offer.transfer_id))
        if offer.sender not in self._watched:   # a sender that dies takes its handoffs with it
            self._watched.add(offer.sender)
            self.context.watch(offer.sender)
        return KVOfferReply(True, skip_blocks=reserved.num_hit_blocks)

    def _on_chunk(self, chunk: KVChunk) -> int:
        inc = self._incoming.get(chunk.transfer_id)
        if inc is None:
            raise ValueError(f"no handoff {chunk.transfer_id} in progress")
        end = chunk.first_block + chunk.num_blocks
        if chunk.first_block < inc.skip_blocks or end > len(inc.block_table):
            raise ValueError(f"blocks [{chunk.first_block}, {end}) outside the handoff's "
                             f"[{inc.skip_blocks}, {len(inc.block_table)})")
        self.blocks.write(inc.block_table[chunk.first_block:end], chunk.data)
        inc.written += chunk.num_blocks
        inc.heard = time.monotonic()
        return chunk.num_blocks

    def _let_go(self, transfer_id: str) -> None:
        """The handoff ends before its commit: its reserved blocks go back to the decode engine's pool."""
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None:
            self.scheduler.tell(AdoptDrop(inc.seq_id))

    @property
    def _idle_s(self) -> float:
        return 2 * self.config.timeout_s   # past the sender's own timeout: it has given up, or hangs

    def _check_idle(self, transfer_id: str) -> None:
        """A sender that hangs without dying (its node stays up) would hold the reserved blocks for good:
        past the idle time they go back, and a late chunk or commit fails its handoff, which the front
        end continues elsewhere."""
        inc = self._incoming.get(transfer_id)
        if inc is None:
            return
        quiet = time.monotonic() - inc.heard
        if quiet < self._idle_s:
            self.context.schedule_once(self._idle_s - quiet, _CheckIdle(transfer_id))
            return
        self._let_go(transfer_id)
        self.context.log.warning("KV handoff dropped: its sender went quiet", transfer_id=transfer_id,
                                 quiet_s=round(quiet, 3))

    async def _on_commit(self, transfer_id: str) -> bool:
        inc = self._incoming.pop(transfer_id, None)
        if inc is None:
            raise ValueError(f"no handoff {transfer_id} in progress")
        if inc.written != len(inc.block_table) - inc.skip_blocks:
            self.scheduler.tell(AdoptDrop(inc.seq_id))
            raise ValueError(f"handoff {transfer_id} committed with {inc.written} of "
                             f"{len(inc.block_table) - inc.skip_blocks} blocks written")
        await self.scheduler.ask(AdoptCommit(inc.seq_id))
        return True
