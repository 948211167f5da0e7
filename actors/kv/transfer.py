"""KV handoff between engines: a prefill engine's blocks, written into a decode engine's cache.

One actor per engine does both ends over the cluster transport. The sender offers the request
(the receiver reserves blocks, or refuses), streams the blocks in chunks of raw cache bytes
(`KVBlockIO`, no per-token messages, sealed like every frame), at most `window_bytes` of them
unacknowledged (a chunk is acknowledged once written, so a slow receiver slows the sender and
nothing piles up), then commits: the receiver's scheduler starts decoding. A prompt of several
prefill chunks is offered after its first: each chunk's full blocks go while the next is computed,
and only the last chunk's are left to send once the first token is out (the commit carries it).
Where the cache is in host memory, a prompt's blocks go layer by layer instead: the scheduler
names the blocks each step fills (HandoffSendLayers) and the worker announces every layer it has
written (LayerWritten), so once the first token is out only what the last layers wrote is left.
Cut before that, the blocks sent ahead are let go and the handoff goes whole as above. Whatever goes wrong
before the commit, the sender tells the request's front end, which continues it elsewhere, and
the receiver, which lets the reserved blocks go (as it does when the sender's node is lost). On a
GPU, NIXL or NCCL would move the bytes behind the same messages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.messages.front_end import SubmitRequest
from actors.messages.handoff import (
    HandoffStart, HandoffRelease, HandoffReserve, HandoffSend, HandoffSendAhead, HandoffWithdraw, HandoffSent,
    HandoffSendLayers, HandoffCancel, HandoffChunk, HandoffCommit, HandoffFailed, HandoffOffer, HandoffOfferReply, KVPull, KVPulled,
)
from actors.messages.kv import KVReserved
from actors.messages.step import LayerWritten
from actors.kv.prefix_pull import PrefixPull
from runtime import Actor, ActorRef, Terminated

if TYPE_CHECKING:
    from actors.worker.kv_blocks import KVBlockIO   # torch: only where an engine runs


@dataclass(frozen=True)
class KVTransferConfig:
    # `metadata={"help": ...}` makes a field a `matinee serve` flag (gateway/flags.py).
    window_bytes: int = field(default=8 << 20, metadata={
        "help": "KV bytes a prefill engine may have sent and not yet seen written (e.g. 8MiB)",
        "type": "bytes", "flag": "kv-transfer-window"})
    by_layer: bool = field(default=True, metadata={
        "help": "send a prompt's KV as the forward writes each layer (a cache in host memory); this flag "
                "sends whole blocks once each chunk is computed", "flag": "no-kv-transfer-by-layer"})
    chunk_bytes: int = field(default=1 << 20, metadata={
        "help": "KV bytes per frame of a handoff or a prefix pull: as many blocks as fit, at least one",
        "type": "bytes", "flag": "kv-transfer-chunk"})
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
class _Outgoing:
    """A handoff this engine sends: offered when its first blocks were ready (or its whole prompt)."""
    offer: HandoffOffer
    to: ActorRef
    block_table: list[int] = field(default_factory=list)
    ready: int = 0                    # leading blocks that hold KV (while the prompt is computed)
    # step id -> [first block, end block, layers the worker wrote]: blocks a step fills, by layer
    filling: dict[int, list[int]] = field(default_factory=dict)
    sent_layers: dict[int, int] = field(default_factory=dict)   # block index -> its layers sent (from 0)
    final: HandoffOffer | None = None      # from the HandoffSend: the prompt is done, its first token out
    final_at: float = 0.0             # when that came: the transfer time counts from there
    failed: bool = False              # cut before its HandoffSend: that starts a whole one
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


@dataclass
class _Incoming:
    seq_id: int
    sender: ActorRef
    block_table: list[int]
    skip_blocks: int
    ahead: bool                       # offered before its first token: the commit brings it
    layers: dict[int, int] = field(default_factory=dict)   # block index -> bit mask of its layers written
    heard: float = field(default_factory=time.monotonic)   # the sender's last offer or chunk


@dataclass(frozen=True)
class _CheckIdle:
    """To itself: has handoff `transfer_id` heard from its sender lately?"""
    transfer_id: str


class KVTransfer(Actor):
    """`kv`: the engine's KV manager, for prefix pulls between engines (actors/kv/prefix_pull.py)."""

    def __init__(self, blocks: KVBlockIO, scheduler: ActorRef, block_size: int,
                 config: KVTransferConfig | None = None, kv: ActorRef | None = None):
        self.blocks = blocks
        self.scheduler = scheduler
        self.block_size = block_size
        self.config = config or KVTransferConfig()
        self.pull = PrefixPull(kv, scheduler, blocks.layout, block_size, blocks.bytes_per_block,
                               self.config.chunk_bytes, self.config.timeout_s) if kv is not None else None
        self._incoming: dict[str, _Incoming] = {}
        self._outgoing: dict[int, _Outgoing] = {}   # by the sending engine's seq_id
        self._watched: set[ActorRef] = set()
        self._sends: set[asyncio.Task] = set()
        self.peak_in_flight_bytes = 0     # the most a handoff ever had unacknowledged (<= the window)

    async def on_stop(self) -> None:
        for task in self._sends:
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)

    async def receive(self, msg: Any) -> Any:
        match msg:
            case HandoffSendAhead():
                self._ahead(msg)
            case HandoffSendLayers():
                self._layers(msg)
            case LayerWritten(step_id=step_id, layer=layer):
                self._layer_written(step_id, layer)
            case HandoffSend():
                self._finish(msg)
            case HandoffWithdraw(seq_id=seq_id):
                self._cancel(seq_id)
            case HandoffOffer():
                return await self._on_offer(msg)
            case HandoffChunk():
                return self._on_chunk(msg)
            case HandoffCommit():
                return await self._on_commit(msg)
            case HandoffCancel(transfer_id=tid):
                self._let_go(tid)
            case SubmitRequest() if self.pull is not None:   # from the scheduler: pull its prefix first
                self._own(self.pull.pull_then_submit(msg))
            case KVPull():
                return await self.pull.serve(msg) if self.pull is not None else KVPulled([])
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
    def _ahead(self, msg: HandoffSendAhead) -> None:
        """More of a prompt's blocks hold KV: the first time, the handoff is offered; then they go."""
        out = self._outgoing.get(msg.seq_id)
        if out is None:
            out = self._outgoing[msg.seq_id] = _Outgoing(msg.offer, msg.to)
            self._start(msg.seq_id, out)
        out.block_table, out.ready = msg.block_table, max(out.ready, msg.num_blocks)
        out.changed.set()

    def _layers(self, msg: HandoffSendLayers) -> None:
        """The coming step fills these blocks: each layer of them goes once written (the first
        time, the handoff is offered)."""
        out = self._outgoing.get(msg.seq_id)
        if out is None:
            out = self._outgoing[msg.seq_id] = _Outgoing(msg.offer, msg.to)
            self._start(msg.seq_id, out)
        out.block_table = msg.block_table
        out.filling[msg.step_id] = [msg.first_block, msg.end_block, 0]

    def _layer_written(self, step_id: int, layer: int) -> None:
        for out in self._outgoing.values():   # a few handoffs at a time: the ones this step fills have its span
            span = out.filling.get(step_id)
            if span is not None and layer + 1 > span[2]:
                span[2] = layer + 1
                out.changed.set()

    def _finish(self, h: HandoffSend) -> None:
        """The prompt is computed and its first token out: the handoff sends the rest and commits.
        One sent ahead goes on from where it is; one that failed, or none, starts from the offer."""
        out = self._outgoing.get(h.seq_id)
        if out is not None and (out.failed or len(h.offer.output_token_ids) != 1):
            self._cancel(h.seq_id)
            out = None
        if out is None:
            out = self._outgoing[h.seq_id] = _Outgoing(h.offer, h.to)
            self._start(h.seq_id, out)
        out.block_table, out.final, out.final_at = h.block_table, h.offer, time.perf_counter()
        out.changed.set()

    def _start(self, seq_id: int, out: _Outgoing) -> None:
        out.task = self._own(self._send(seq_id, out))

    def _own(self, coro) -> asyncio.Task:
        """A task of this actor's, cancelled when it stops."""
        task = asyncio.create_task(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return task

    def _cancel(self, seq_id: int) -> None:
        """A handoff sent ahead ends before its HandoffSend: its decode engine lets the blocks go."""
        out = self._outgoing.pop(seq_id, None)
        if out is not None and out.task is not None:
            out.task.cancel()

    async def _send(self, seq_id: int, out: _Outgoing) -> None:
        """Offer, chunks as their blocks are ready, commit; the scheduler hears the outcome, the front
        end a failure. Cut before its HandoffSend, a handoff sent ahead ends quietly: that HandoffSend
        starts another."""
        offer = out.offer
        tid = offer.transfer_id
        sent_bytes = bytes_ahead = blocks_ahead = 0
        ok, refused, accepted = False, False, False
        try:
            reply: HandoffOfferReply = await out.to.ask(offer, timeout=self.config.timeout_s)
            if not reply.accepted:
                raise HandoffCut(f"the decode engine refused the handoff: {reply.reason}", refused=reply.no_room)
            accepted = True
            while True:
                final = out.final
                if final is not None:   # the first token is out: what went before it
                    blocks_ahead = sum(n == self.blocks.num_layers for n in out.sent_layers.values())
                whole = self._num_blocks(final) if final is not None else out.ready
                for first, count, layers in self._due(out, reply.skip_blocks, whole):
                    size = await self._stream(tid, out.to, out.block_table[first:first + count], first, layers)
                    sent_bytes += size
                    bytes_ahead += size if final is None else 0
                if final is not None:
                    break
                await out.changed.wait()
                out.changed.clear()
            ahead = not offer.output_token_ids   # then the commit brings the first token
            await out.to.ask(HandoffCommit(tid, final.output_token_ids if ahead else None), timeout=self.config.timeout_s)
            ok = True
        except asyncio.CancelledError:   # the offer's answer may be on its way: the cancel follows it
            out.to.tell(HandoffCancel(tid))
            raise
        except Exception as exc:
            refused = isinstance(exc, HandoffCut) and exc.refused
            if accepted or isinstance(exc, TimeoutError):   # it may hold blocks for us: they go back
                out.to.tell(HandoffCancel(tid))
            if out.final is None:   # still prefilling: its HandoffSend starts again
                out.failed = True
                self.context.log.info("KV handoff sent ahead failed; it goes whole once prefilled",
                                      request_id=offer.request_id, error=str(exc) or repr(exc))
                return
            self.context.log.warning("KV handoff failed", request_id=offer.request_id, error=str(exc) or repr(exc))
            offer.reply_to.tell(HandoffFailed(offer.request_id, str(exc) or repr(exc), refused))
        finally:
            if out.final is not None and self._outgoing.get(seq_id) is out:
                del self._outgoing[seq_id]
                self.scheduler.tell(HandoffSent(seq_id, ok, refused, len(out.sent_layers), sent_bytes,
                                                 time.perf_counter() - out.final_at, blocks_ahead, bytes_ahead))

    def _num_blocks(self, offer: HandoffOffer) -> int:
        """Blocks that hold the request's KV: every position but the last sampled token's."""
        return -(-(len(offer.prompt_token_ids) + len(offer.output_token_ids) - 1) // self.block_size)

    def _due(self, out: _Outgoing, skip: int, whole: int) -> list[tuple[int, int, range]]:
        """What to send now, as runs (first block, count, layers): every layer of blocks [skip, whole),
        and of the blocks a step is filling, the layers it has written; less what already went."""
        n = self.blocks.num_layers
        want = dict.fromkeys(range(skip, whole), n)
        for step_id, (first, end, written) in list(out.filling.items()):
            if end <= whole:   # the step is over: its blocks are whole
                del out.filling[step_id]
                continue
            for b in range(max(first, skip), end):
                want[b] = max(want.get(b, 0), written)
        runs: list[list] = []
        for b in sorted(want):
            layers = range(out.sent_layers.get(b, 0), want[b])
            if not layers:
                continue
            out.sent_layers[b] = layers.stop
            if runs and runs[-1][0] + runs[-1][1] == b and runs[-1][2] == layers:
                runs[-1][1] += 1
            else:
                runs.append([b, 1, layers])
        return [(first, count, layers) for first, count, layers in runs]

    async def _stream(self, tid: str, to: ActorRef, block_ids: list[int], first_block: int, layers: range) -> int:
        """These blocks' layers, the handoff's from `first_block` on, in chunks, never more than the
        window unacknowledged; returns the bytes sent."""
        whole = len(layers) == self.blocks.num_layers
        per_block = self.blocks.nbytes(1, layers)
        per_chunk = max(1, self.config.chunk_bytes // per_block)
        in_flight: dict[asyncio.Task, int] = {}
        sent = 0
        try:
            for at in range(0, len(block_ids), per_chunk):
                ids = block_ids[at:at + per_chunk]
                size = len(ids) * per_block
                while in_flight and sum(in_flight.values()) + size > self.config.window_bytes:
                    done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        del in_flight[task]
                        task.result()   # a chunk that failed cuts the handoff
                chunk = HandoffChunk(tid, first_block + at, len(ids), self.blocks.read(ids, None if whole else layers),
                                0 if whole else layers.start, 0 if whole else len(layers))
                in_flight[asyncio.create_task(to.ask(chunk, timeout=self.config.timeout_s))] = size
                self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, sum(in_flight.values()))
                sent += size
            for task in list(in_flight):
                await task
                del in_flight[task]
        finally:
            for task in in_flight:
                task.cancel()
        return sent

    # ---- receiving -----------------------------------------------------------------------------
    async def _on_offer(self, offer: HandoffOffer) -> HandoffOfferReply:
        if offer.block_layout != self.blocks.layout:
            return HandoffOfferReply(False, reason=f"KV layout {offer.block_layout} here is {self.blocks.layout}")
        reserved: KVReserved = await self.scheduler.ask(HandoffReserve(offer))
        if reserved.block_table is None:
            return HandoffOfferReply(False, reason="no room in the KV cache", no_room=True)
        self._incoming[offer.transfer_id] = _Incoming(reserved.seq_id, offer.sender, reserved.block_table,
                                                      reserved.num_hit_blocks, not offer.output_token_ids)
        self.context.schedule_once(self._idle_s, _CheckIdle(offer.transfer_id))
        if offer.sender not in self._watched:   # a sender that dies takes its handoffs with it
            self._watched.add(offer.sender)
            self.context.watch(offer.sender)
        return HandoffOfferReply(True, skip_blocks=reserved.num_hit_blocks)

    def _on_chunk(self, chunk: HandoffChunk) -> int:
        inc = self._incoming.get(chunk.transfer_id)
        if inc is None:
            raise ValueError(f"no handoff {chunk.transfer_id} in progress")
        end = chunk.first_block + chunk.num_blocks
        if chunk.first_block < inc.skip_blocks or end > len(inc.block_table):
            raise ValueError(f"blocks [{chunk.first_block}, {end}) outside the handoff's "
                             f"[{inc.skip_blocks}, {len(inc.block_table)})")
        whole = range(self.blocks.num_layers)
        layers = range(chunk.first_layer, chunk.first_layer + chunk.num_layers) if chunk.num_layers else whole
        self.blocks.write(inc.block_table[chunk.first_block:end], chunk.data, None if layers == whole else layers)
        mask = ((1 << len(layers)) - 1) << layers.start
        for b in range(chunk.first_block, end):
            inc.layers[b] = inc.layers.get(b, 0) | mask
        inc.heard = time.monotonic()
        return chunk.num_blocks

    def _let_go(self, transfer_id: str) -> None:
        """The handoff ends before its commit: its reserved blocks go back to the decode engine's pool."""
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None:
            self.scheduler.tell(HandoffRelease(inc.seq_id))

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

    async def _on_commit(self, commit: HandoffCommit) -> bool:
        transfer_id = commit.transfer_id
        inc = self._incoming.pop(transfer_id, None)
        if inc is None:
            raise ValueError(f"no handoff {transfer_id} in progress")
        problem = None
        every = (1 << self.blocks.num_layers) - 1
        wanted = range(inc.skip_blocks, len(inc.block_table))
        written = sum(inc.layers.get(b, 0) == every for b in wanted)
        if written != len(wanted):
            problem = f"with {written} of {len(wanted)} blocks written"
        elif inc.ahead and len(commit.output_token_ids or ()) != 1:
            problem = "offered before its first token, without exactly one"   # the blocks hold the prompt's KV alone
        elif not inc.ahead and commit.output_token_ids is not None:
            problem = "with tokens its offer already had"
        if problem is not None:
            self.scheduler.tell(HandoffRelease(inc.seq_id))
            raise ValueError(f"handoff {transfer_id} committed {problem}")
        await self.scheduler.ask(HandoffStart(inc.seq_id, commit.output_token_ids))
        return True
