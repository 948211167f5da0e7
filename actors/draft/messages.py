"""Messages between the scheduler and the draft worker: Propose (one per step) and Proposals.

msgspec Structs, positional on the wire (new fields go at the end, with defaults). The draft worker
shares the target's block tables, so a Propose carries each sequence's table as the step uses it.
"""

from __future__ import annotations

import msgspec

from actors.messages.step import NewSequence
from runtime import ActorRef, register_messages


class DraftInput(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    token_ids: list[int]              # the tokens the target computes this step (as in ScheduledSeq)
    start_pos: int                    # position of token_ids[0]
    block_table: list[int]            # covers start_pos + len(token_ids) + num_spec positions
    num_spec: int                     # tokens to draft after them; 0: only keep the draft in step


class Propose(msgspec.Struct, tag=True, array_like=True, gc=False):
    step_id: int
    seqs: list[DraftInput]
    new_seqs: list[NewSequence] = []  # sampler state to create (prompt, params, seed)
    finished_seq_ids: list[int] = []  # state to drop


class Proposal(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    token_ids: list[int]              # the drafted tokens (possibly fewer than asked, or none)
    probs: bytes = b""                # float32 [len(token_ids), vocab]: the distributions they were
                                      # drawn from; empty: a point mass on each (greedy or n-gram)


class Proposals(msgspec.Struct, tag=True, array_like=True, gc=False):
    step_id: int
    proposals: list[Proposal]         # one per DraftInput with num_spec > 0, in order
    draft_s: float = 0.0              # time the draft spent on this step


class GetDraftStats(msgspec.Struct, tag=True):
    pass


class DraftStats(msgspec.Struct, tag=True):
    num_seqs: int                     # sequences the draft holds state for
    steps: int
    draft_s: float
    draft_cost: float = 0.0           # one drafted token's cost relative to one target decode step


class AttachDraft(msgspec.Struct, tag=True):
    """An engine asks a draft node (`matinee serve --role draft`) for a draft worker of its own."""
    engine_id: str
    block_size: int
    num_blocks: int                   # the target's pool: the draft's KV is addressed by its block tables
    vocab_size: int
    vocab_digest: str                 # sha256 of the target tokenizer's vocabulary (token -> id)
    num_layers: int = 0               # the target's size, for the draft's cost prior
    num_params: int = 0


class DraftAttached(msgspec.Struct, tag=True):
    worker: ActorRef | None           # the engine's own draft worker on that node; None: refused
    draft_cost: float = 0.0
    error: str = ""                   # why it was refused


DRAFT_MESSAGES = (Propose, Proposals, GetDraftStats, DraftStats, AttachDraft, DraftAttached)

# An engine and a separate draft node exchange these over the runtime's TCP transport.
register_messages(*DRAFT_MESSAGES)
