"""Messages between the scheduler and the draft worker: Propose (one per step) and Proposals.

msgspec Structs, positional on the wire (new fields go at the end, with defaults). The draft worker
shares the target's block tables, so a Propose carries each sequence's table as the step uses it.
"""

from __future__ import annotations

import msgspec

from actors.messages import NewSequence


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


DRAFT_MESSAGES = (Propose, Proposals, GetDraftStats, DraftStats)
