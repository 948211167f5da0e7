"""Disaggregation's share of the scheduler: which prompts computed here go to a decode engine and
when their blocks may leave, and which requests another engine prefilled are arriving here.

On a prefill engine a prompt for a decode engine is sent in pieces: after each chunk its full blocks
go ahead (or, layer by layer, the blocks each planned step fills), and the handover after its first
token sends the rest. A sequence sent ahead that is preempted or ends first cancels what went. On a
decode engine a handed-over request's blocks are reserved before its KV arrives, and once it has, the
request joins the request table, decoding (adoption).

A plain synchronous class the scheduler owns. It keeps no queue of its own: it only notes sequences
and hands out what the scheduler actor sends; the scheduler moves sequences between its queues.
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.messages.handoff import HandoffOffer
from actors.messages.kv import KVReserve
from actors.scheduler.requests import RequestTable
from actors.scheduler.sequence import Sequence, SeqStatus


class HandoffTracker:
    def __init__(self, block_size: int, requests: RequestTable):
        self.block_size = block_size
        self.requests = requests               # where adopted requests go
        self._handoffs: list[Sequence] = []    # prefilled, their KV to send to a decode engine
        self._ahead: dict[int, int] = {}       # still prefilling, their full blocks sent ahead: how many
        self._ready_ahead: list[Sequence] = [] # those with more blocks to send since the last step
        self._cancelled_ahead: list[int] = []  # sent ahead, then preempted or ended: not handed over
        self._layered: list[tuple[Sequence, int, int]] = []   # the planned step's prompt blocks, by layer
        self._adopting: dict[int, Sequence] = {}   # handed to us, blocks reserved, KV arriving

    # --- a prefill engine: handing prompts over -------------------------------------------------

    def take_handoffs(self) -> list[Sequence]:
        """Sequences whose prompt this engine computed for a decode engine: their first token is
        out; their blocks stay held until the scheduler's `handoff_done`."""
        out, self._handoffs = self._handoffs, []
        return out

    def take_ready_ahead(self) -> list[tuple[Sequence, int]]:
        """Sequences whose prompt is still being computed for a decode engine, with how many of
        their leading blocks hold KV after the last step: those go ahead while the rest is computed."""
        ready, self._ready_ahead = self._ready_ahead, []
        return [(seq, self._ahead[seq.seq_id]) for seq in ready if seq.seq_id in self._ahead]

    def take_layered(self) -> list[tuple[Sequence, int, int]]:
        """Sequences the planned step computes for a decode engine, with the blocks [first, end) it
        fills (the last one partly, where the prompt ends in it): each layer of them may go as soon
        as the worker has written it. Taking them counts the sequences as sent ahead, so that one
        preempted or ended before its handover cancels what went."""
        out, self._layered = self._layered, []
        for seq, _, _ in out:
            self._ahead.setdefault(seq.seq_id, 0)
        return out

    def take_cancelled_ahead(self) -> list[int]:
        """Sequences sent ahead that will not be handed over from those blocks (preempted, ended)."""
        out, self._cancelled_ahead = self._cancelled_ahead, []
        return out

    def planning(self) -> None:
        """A new plan: the blocks named by the last one are no longer to come."""
        self._layered = []

    def planned(self, seq: Sequence, start: int, end: int) -> None:
        """The planned step computes positions [start, end) of a prompt for a decode engine."""
        bs = self.block_size
        last = -(-end // bs) if end == seq.num_tokens else end // bs   # the prompt's partial block with its end
        if last > start // bs:
            self._layered.append((seq, start // bs, last))

    def computed(self, seqs: Iterable[Sequence | None]) -> None:
        """After a step: a prompt computed for a decode engine that has more full blocks after this
        step's chunk (and no token yet) sends them ahead."""
        bs = self.block_size
        for seq in seqs:
            if (seq is None or seq.status is not SeqStatus.RUNNING or seq.request.handoff_to is None
                    or seq.num_computed >= seq.num_tokens):
                continue
            full = seq.num_computed // bs
            if full > self._ahead.get(seq.seq_id, 0):
                self._ahead[seq.seq_id] = full
                self._ready_ahead.append(seq)

    def hand_over(self, seq: Sequence) -> None:
        """Its first token is out: the whole KV goes (a handoff sent ahead goes on with the rest)."""
        self._ahead.pop(seq.seq_id, None)
        self._handoffs.append(seq)

    def drop_ahead(self, seq: Sequence) -> None:
        """The sequence's blocks sent ahead will not be handed over as they are (preempted, ended)."""
        if self._ahead.pop(seq.seq_id, None) is not None:
            self._cancelled_ahead.append(seq.seq_id)

    # --- a decode engine: adopting requests another engine prefilled -------------------------------

    def adopting(self) -> bool:
        """Whether blocks are reserved for handoffs whose KV is still arriving (they come back, or
        decode, once each handoff ends)."""
        return bool(self._adopting)

    def reserve_adoption(self, offer: HandoffOffer) -> KVReserve | None:
        """A new sequence for a request another engine prefilled, with the tokens sampled so far, not
        yet in the request table; the KV manager transaction that reserves its blocks. None when the
        request is here already."""
        if offer.request_id in self.requests or self._is_adopting(offer.request_id):
            return None
        seq = self.requests.offered(offer)
        seq.token_ids += offer.output_token_ids
        self._adopting[seq.seq_id] = seq
        # Every prompt position has KV; so does every sampled token but the last (none is, when
        # the offer comes ahead of the first token).
        num_kv = seq.num_tokens - 1 if offer.output_token_ids else seq.num_tokens
        return KVReserve(seq.seq_id, seq.token_ids, num_kv, seq.request.cache_salt)

    def adopt(self, seq_id: int, output_token_ids: list[int] | None) -> Sequence:
        """The reserved sequence's KV is in the cache (all but its last token's): it joins the request
        table, running (for the scheduler to queue), and decodes, from `output_token_ids` when its offer
        came ahead of them."""
        seq = self._adopting.pop(seq_id)
        if output_token_ids:
            seq.token_ids += output_token_ids
        seq.num_computed = seq.num_tokens - 1
        seq.status = SeqStatus.RUNNING
        self.requests.enter(seq)
        return seq

    def drop_adoption(self, seq_id: int, reserved: bool = True) -> None:
        """The handoff was cut (or found no room): the blocks the KV manager `reserved` for it go back."""
        if self._adopting.pop(seq_id, None) is not None and reserved:
            self.requests.free(seq_id)

    def _is_adopting(self, request_id: str) -> bool:
        return any(s.request.request_id == request_id for s in self._adopting.values())
