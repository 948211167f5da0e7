"""What engines say to each other, through each engine's KV transfer actor: a prefill engine handing a
request's KV to a decode engine (offer, chunks, commit or cancel), what each side's scheduler says to its
transfer actor meanwhile, and one engine pulling a cached prefix's blocks from another.
"""

from __future__ import annotations

import msgspec

from runtime import ActorRef, register_messages
from actors.messages.front_end import SamplingParams


# ---- engine to engine: a request's KV, prefill -> decode, and where its deltas now come from -----


class HandoffOffer(msgspec.Struct, tag=True):
    """Prefill -> decode (ask): room for this request? The first `len(prompt_token_ids)` positions
    have KV; `output_token_ids` were sampled on the prefill engine (the last one has no KV yet).
    No `output_token_ids`: the prompt is still being computed, its blocks come as its chunks are
    done, and the commit brings the first token."""

    transfer_id: str
    sender: ActorRef                  # the prefill engine's transfer actor (watched for its death)
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    reply_to: ActorRef                # the request's front end
    priority: int
    cache_salt: str | None
    num_cached_tokens: int            # the prefill engine's prefix hit, as the client is told
    block_layout: str                 # KVBlockIO.layout: both caches must agree on it
    ballast: bool = False             # a batch line (SubmitRequest.ballast)


class HandoffOfferReply(msgspec.Struct, tag=True):
    accepted: bool
    skip_blocks: int = 0              # leading blocks the decode engine already caches: not sent
    reason: str = ""
    no_room: bool = False             # refused for now: its KV pool is full


class HandoffChunk(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Blocks [first_block, first_block + num_blocks) of a transfer, as KVBlockIO lays them out: of
    layers [first_layer, first_layer + num_layers), or of every layer (num_layers 0)."""

    transfer_id: str
    first_block: int
    num_blocks: int
    data: bytes
    first_layer: int = 0
    num_layers: int = 0


class HandoffCommit(msgspec.Struct, tag=True):
    """Every block is written: the decode engine starts decoding the request (ask; True on success)."""

    transfer_id: str
    output_token_ids: list[int] | None = None   # the first token, when the offer came before it


class HandoffCancel(msgspec.Struct, tag=True):
    """The sender gave the handoff up (an ask timed out, say): the decode engine lets its blocks go."""

    transfer_id: str


class HandoffDone(msgspec.Struct, tag=True):
    """Decode engine -> front end: the request decodes here now; its next deltas come from here."""

    request_id: str


class HandoffFailed(msgspec.Struct, tag=True):
    """Prefill engine -> front end: the KV never reached the decode engine; continue the request
    elsewhere. `refused`: the decode engine had no room (it is alive)."""

    request_id: str
    reason: str
    refused: bool = False


# ---- the sending engine: its scheduler and its transfer actor ------------------------------------


class HandoffSend(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: send this sequence's KV (`offer` says what it is) to `to`."""

    seq_id: int
    block_table: list[int]
    offer: HandoffOffer
    to: ActorRef


class HandoffSendAhead(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: the sequence's prompt is still being computed, but its first
    `num_blocks` blocks hold their KV: send them ahead (the first such message offers the handoff;
    `offer` has no output tokens). The HandoffSend after its last chunk sends the rest and commits."""

    seq_id: int
    block_table: list[int]
    num_blocks: int
    offer: HandoffOffer
    to: ActorRef


class HandoffSendLayers(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor, before the step `step_id` runs: the step computes the
    sequence's blocks [first_block, end_block) (the last one partly filled when its prompt ends
    there), so each layer of them may go as soon as the worker has written it (LayerWritten).
    The first message for a sequence offers the handoff, as HandoffSendAhead does; the step's
    outcome (HandoffSendAhead, HandoffSend) says which blocks are whole."""

    seq_id: int
    step_id: int
    block_table: list[int]
    first_block: int
    end_block: int
    offer: HandoffOffer
    to: ActorRef


class HandoffWithdraw(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: the sequence sent ahead will not be handed over from those
    blocks (preempted, ended or failed): the decode engine lets its reservation go."""

    seq_id: int


class HandoffSent(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler: the sequence's blocks may go back to the pool."""

    seq_id: int
    ok: bool
    refused: bool
    num_blocks: int
    num_bytes: int
    seconds: float                    # from the HandoffSend (the first token out) to the commit
    num_blocks_ahead: int = 0         # of num_blocks, sent whole before the HandoffSend
    num_bytes_ahead: int = 0          # of num_bytes, sent before the HandoffSend (whole blocks, and layers)


# ---- the receiving engine: its transfer actor and its scheduler ----------------------------------


class HandoffReserve(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler (ask): a sequence and blocks for an offered handoff (KVReserved)."""

    offer: HandoffOffer


class HandoffStart(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler (ask): the reserved sequence's KV is written; it decodes now."""

    seq_id: int
    output_token_ids: list[int] | None = None   # its first token, when the offer came before it


class HandoffRelease(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler: the handoff was cut; the reserved blocks go back."""

    seq_id: int


# ---- a cached prefix pulled from a peer engine ---------------------------------------------------


class KVPull(msgspec.Struct, tag=True):
    """To a peer's KV transfer actor (ask): the bytes of the leading blocks of these hashes it holds."""

    block_hashes: list[bytes]
    block_layout: str                 # the asker's KVBlockIO layout; another gets nothing


class KVPulled(msgspec.Struct, tag=True):
    """The leading run of the asked blocks that could be given, each as KVBlockIO reads one block."""

    blocks: list[bytes]


class PrefixPullTimed(msgspec.Struct, tag=True, frozen=True):
    """To the scheduler, from its KV transfer actor: a prefix pull from `peer` (its node) moved
    `num_bytes` in `seconds` (a measurement of that link, for the next pull-or-compute decision)."""

    num_bytes: int
    seconds: float
    peer: str = ""


# Across processes between engines and gateways; the rest stays inside one engine process.
register_messages(HandoffOffer, HandoffOfferReply, HandoffChunk, HandoffCommit, HandoffCancel, HandoffDone,
                  HandoffFailed)
register_messages(KVPull, KVPulled)
