"""What the scheduler and the KV manager say: a step's block transaction (grow, trim, admit, fork, free),
its result, reservations for a sequence whose KV arrives from elsewhere, the tier's puts, stats and cache
events.
"""

from __future__ import annotations

import msgspec

from runtime import ActorRef


class KVGrow(msgspec.Struct, array_like=True, gc=False):
    """A running sequence needs slots for `num_new_tokens` more positions. `token_ids` are all its
    tokens so far: the manager records those past the ones it holds (it hashes blocks as they fill)."""

    seq_id: int
    token_ids: list[int]
    num_new_tokens: int
    num_lookahead_tokens: int = 0     # slots for drafted tokens, rolled back by a KVTrim after verification


class KVTrim(msgspec.Struct, array_like=True, gc=False):
    """After verification: keep the KV of the first `num_tokens` positions, return blocks past them."""

    seq_id: int
    num_tokens: int


class KVAdmit(msgspec.Struct, array_like=True, gc=False):
    """A waiting sequence to admit: reuse cached prefix blocks, then allocate its first chunk."""

    seq_id: int
    token_ids: list[int]
    cache_salt: str | None = None
    read_prefix_cache: bool = True    # False: compute every position (its prompt logprobs are wanted)


class KVFork(msgspec.Struct, array_like=True, gc=False):
    """Start a new sequence sharing the parent's full blocks that cover its first `num_tokens`
    tokens (a block boundary); the child computes the rest itself."""

    parent_seq_id: int
    child_seq_id: int
    num_tokens: int


class KVStep(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One transaction per scheduler step, applied in order: trims, forks, frees (after the forks, since a
    finished parent may still be forked), grows (stopping at the first that does not fit), then
    admits while the token budget and the pool allow."""

    frees: list[int]
    forks: list[KVFork]
    grows: list[KVGrow]
    admits: list[KVAdmit]
    token_budget: int                 # tokens left for admitted chunks after the grows
    trims: list[KVTrim] = []          # applied first: rejected drafts' KV rolled back


class KVAdmitted(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    num_cached_tokens: int            # prefix-cache hit, capped so one token is always computed
    num_new_tokens: int
    block_table: list[int]
    reads_from: list[int] = []        # sequences of this step whose blocks the hit maps: hashed, not yet written


class KVStepResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    forked: list[bool]                # per fork: False when the pool had no room (the child starts over)
    grown: list[list[int]]            # the whole block table per successful grow, in order
    grow_failed: bool                 # grows[len(grown)] did not fit; later grows were not tried
    admitted: list[KVAdmitted]        # a prefix of the admits, in order
    num_free_blocks: int
    queried_tokens: int = 0           # prefix-cache lookups done in this transaction
    hit_tokens: int = 0
    num_table_blocks: int = 0         # blocks in every sequence's table after it (a shared one once per table)
    tier_hit_tokens: int = 0          # of hit_tokens, those copied back from the KV tier


class KVUnwritten(msgspec.Struct, array_like=True, gc=False):
    """A sequence whose step failed: only its first `num_tokens` positions hold KV. The blocks it
    hashed past them (at allocation, before the forward) must not serve prefix hits."""

    seq_id: int
    num_tokens: int


class KVFree(msgspec.Struct, tag=True, array_like=True):
    seq_ids: list[int]
    unwritten: list[KVUnwritten] = []  # applied first: failed sequences' blocks leave the prefix cache


class GetKVStats(msgspec.Struct, tag=True):
    pass


class KVReadAhead(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A request came in: read the tier blocks its admission will take from disk while it waits (on a
    thread, the KV manager going on meanwhile), so that its step does not wait for the disk. A tell."""

    admit: KVAdmit


class KVStats(msgspec.Struct, tag=True):
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int = 0
    # The KV tier (actors/kv/tier.py), where the pool's evicted blocks go: what it holds, and what it moved.
    tier: bool = False
    tier_blocks: int = 0              # distinct blocks, in memory or on disk
    tier_memory_bytes: int = 0
    tier_disk_bytes: int = 0
    tier_hits_memory: int = 0         # blocks copied back into the pool, by where they were found
    tier_hits_disk: int = 0
    tier_bytes_saved: int = 0         # copied out of the pool on eviction
    tier_bytes_loaded: int = 0        # copied back into it
    tier_load_s: float = 0.0          # cumulative time reading and copying blocks back
    tier_save_s: float = 0.0          # cumulative time copying evicted blocks out (the disk writes are not in it)
    tier_write_failures: int = 0      # blocks the disk store could not write (a full disk) or had to drop
    tier_discarded: int = 0           # damaged or truncated block files deleted instead of served
    tier_bytes_pulled: int = 0        # pulled from peer engines into the tier (actors/kv/prefix_pull.py)
    tier_pulls: int = 0               # pulls from peer engines, and of those the ones that failed (timed
    tier_pull_failures: int = 0       # out, or the peer was gone: the prompt was computed)
    tier_pull_s: float = 0.0          # cumulative time of the pulls
    tier_hits_read_ahead: int = 0     # of tier_hits_disk, blocks read ahead from their request's arrival


class DrainKVEvents(msgspec.Struct, tag=True):
    """Ask the KV manager for the block stored / removed / cleared events recorded since the last drain."""


class KVEvents(msgspec.Struct, tag=True):
    events: list[object]              # prefix_store.events.KVEvent values, oldest first
    next_seq: int = 0                 # sequence number the next event will carry


class GetKVSnapshot(msgspec.Struct, tag=True):
    """Ask the KV manager for every block hash it caches now (a prefix index that lost the stream)."""


class KVSnapshot(msgspec.Struct, tag=True):
    next_seq: int                     # the first event the snapshot does not cover
    block_hashes: list[bytes]


class SubscribeKVEvents(msgspec.Struct, tag=True):
    """`subscriber` is told KVEventsWaiting after each KV transaction that recorded events; it drains
    them with DrainKVEvents, so they stay in order in the manager's log until then."""

    subscriber: ActorRef


class KVEventsWaiting(msgspec.Struct, tag=True):
    pass


class KVReserve(msgspec.Struct, tag=True):
    """Scheduler -> KV manager: blocks for a handed-over sequence's first `num_tokens` positions,
    from the prefix cache where it can; nothing is hashed until KVConfirm."""

    seq_id: int
    token_ids: list[int]
    num_tokens: int
    cache_salt: str | None = None


class KVReserved(msgspec.Struct, tag=True):
    block_table: list[int] | None     # None: no room
    num_hit_blocks: int = 0           # leading blocks that came from the prefix cache
    seq_id: int = -1                  # the sequence the scheduler made for it


class KVConfirm(msgspec.Struct, tag=True):
    """The reserved positions now hold KV: they count as computed (and their full blocks are cached)."""

    seq_id: int
    num_tokens: int


class KVHeldRun(msgspec.Struct, tag=True):
    """To the KV manager (ask, answered with an int): how many leading blocks of these hashes it can
    serve without computing (its pool's, then its tier's)."""

    block_hashes: list[bytes]


class KVTierPut(msgspec.Struct, tag=True):
    """To the KV manager: a pull from a peer is over; its blocks go to the tier (the next admission
    copies them in) and its outcome to the tier's counters."""

    block_hashes: list[bytes]
    blocks: list[bytes]
    seconds: float = 0.0
    failed: bool = False
