"""Every message that crosses an actor boundary in the engine: gateway <-> scheduler, scheduler <->
KV manager, scheduler <-> model worker. msgspec Structs only; array-like structs are positional on
the wire, so new fields go at the end with defaults. No logic beyond validating SamplingParams.
"""

from __future__ import annotations

import msgspec

from runtime import ActorRef, register_messages

# --- gateway / offline front end <-> scheduler ---------------------------------------------------


class StructuredOutput(msgspec.Struct, frozen=True):
    """What the output must match; the worker masks every token that cannot lead there.

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (spec unused), "regex",
    "choice" (spec: a JSON list of strings), "grammar" (GBNF-style EBNF with a `root` rule), or
    "structural_tag" (xgrammar's structural tag as JSON text). See actors/text/grammar.py.
    """

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's names and defaults. temperature 0 means greedy; top_k 0 or -1 means off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None   # None: none; k: the sampled token's logprob plus the top k
    logit_bias: dict[int, float] = {}   # token id -> added to its logit before sampling
    min_tokens: int = 0   # before this many output tokens, EOS and stop_token_ids are masked
    # The EOS ids min_tokens holds off (vLLM's _all_stop_token_ids): the engine's scheduler fills
    # them in with every EOS id it stops on, so a client never needs to know them.
    eos_token_ids: list[int] = []
    skip_special_tokens: bool = True
    # vLLM's extension: the logprob of every prompt token (and the top k at each position), computed
    # at prefill. Such a request reads nothing from the prefix cache: cached positions have no logits.
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None   # constrained decoding; it ends at the grammar's end
    # vLLM's: only these tokens may be sampled (empty: any).
    allowed_token_ids: list[int] = []
    # vLLM's bad_words as token sequences: a sequence's last token is masked wherever the output
    # ends with the rest of it (a one-token word, everywhere).
    bad_words_token_ids: list[list[int]] = []
    include_stop_str_in_output: bool = False   # a matched stop string stays in the text
    # An embedding: the prompt's hidden states pooled as the model pools them (actors/worker/pooling.py)
    # come with the first token. Like prompt logprobs, such a prompt reads nothing from the prefix cache.
    embed: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if any(not w for w in self.bad_words_token_ids):
            raise ValueError("a bad word must be at least one token")
        if self.embed and self.n != 1:
            raise ValueError("an embedding is one sample (n = 1)")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("a structured output ends where its grammar ends: it cannot be combined "
                             "with ignore_eos or min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class SubmitRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    reply_to: ActorRef
    priority: int = 0                 # lower value = more important, as in vLLM
    cache_salt: str | None = None     # separates tenants' prefix caches
    handoff_to: ActorRef | None = None  # a decode engine's KV receiver: prefill here, decode there
    pull_from: ActorRef | None = None   # a peer engine's KV transfer actor that holds more of the prompt's
                                        # prefix: pull its blocks into this engine's KV tier first
    ballast: bool = False             # a batch line: runs only in room interactive requests leave
    lora_name: str | None = None      # the LoRA adapter to generate with (None: the base model)
    lora_key: str | None = None       # its identity (name@contents) as the router last heard it from this
                                      # engine: what a prefix pull hashes with (the scheduler uses its own)


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str
    index: int | None = None          # one of the n samples (its stop string matched); None: all of them


class TokenLogprobs(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None           # the token's place among all, 1 = most likely (prompt logprobs)


class TokenDelta(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    index: int                        # which of the n samples
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None         # "stop" | "length" | "abort" (asked for) | "error" (the engine failed)
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None          # with "error": a short message for the client (no traceback)
    # With SamplingParams.prompt_logprobs, on sample 0's first delta: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None   # with SamplingParams.embed, on the first delta


class TokenDeltas(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One message per reply_to per step."""

    deltas: list[TokenDelta]


class GetStats(msgspec.Struct, tag=True):
    pass


class EngineStats(msgspec.Struct, tag=True):
    requests_running: int
    requests_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    steps: int = 0
    forward_s: float = 0.0            # cumulative time of the model forward alone (no sampling)
    step_s: float = 0.0               # cumulative wall time from planning a step to handling its result
    kv_slots_allocated: int = 0       # slots in blocks held by running sequences, summed over steps
    kv_slots_used: int = 0            # of those, slots holding a token, summed over steps
    spec_decode_draft_tokens: int = 0     # drafted tokens the target verified
    spec_decode_accepted_tokens: int = 0  # of those, the ones it kept
    spec_decode_num_drafts: int = 0       # verifications (one sequence, one step, at least one draft)
    spec_decode_mean_accepted_length: float = 0.0  # tokens emitted per verification (accepted + 1)
    spec_decode_token_cost: float = 0.0   # one drafted token's cost over a batch-1 decode step (learned)
    kv_bytes_per_token: float = 0.0       # K and V of one token over all layers, with an int8/fp8 cache's scales
    kv_token_capacity: int = 0            # tokens the KV pool holds (blocks x block size)
    queue_time_buckets: list[int] = []    # arrival to first scheduled: counts per bucket of
    queue_time_sum: float = 0.0           # actors.stats.engine_metrics.QUEUE_TIME_BUCKETS, then +Inf
    weight_bytes: int = 0                 # model weights resident in memory (WorkerInfo's)
    # Disaggregation: prefill steps and tokens (a decode engine's stay 0 for handed-over requests),
    # KV handed over (sent on a prefill engine, received on a decode engine) and how long it took.
    prefill_steps: int = 0
    prefill_tokens: int = 0
    kv_handoffs_sent: int = 0
    kv_handoffs_received: int = 0
    kv_handoffs_failed: int = 0       # sender side: cut, or refused by a full decode engine
    kv_handoffs_refused: int = 0      # receiver side: no room for the blocks
    kv_transfer_blocks: int = 0
    kv_transfer_blocks_ahead: int = 0 # of those, sent whole while their prompt was still being computed
    kv_transfer_bytes: int = 0
    kv_transfer_bytes_ahead: int = 0  # of those, sent while their prompt was being computed (blocks, layers)
    kv_transfer_s: float = 0.0        # cumulative, the first token (the HandOver) to commit, on the sending side
    ttft_count: int = 0               # first tokens sampled here (the split below sums over them)
    ttft_queue_s: float = 0.0         # arrival to its first scheduled step
    ttft_prefill_s: float = 0.0       # first scheduled step to its first token
    spec_decode_accepted_per_pos: list[int] = []   # accepted drafted tokens by draft position (0 first)
    # The last seconds' latencies measured here (actors/stats/recent.py), for the live dashboard: arrival
    # at the scheduler to first token, and between tokens (per token); None for an empty window.
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    itl_p50: float | None = None
    itl_p90: float | None = None
    ttft_buckets: list[int] = []      # arrival here to first token, and between tokens (per token):
    ttft_sum: float = 0.0             # counts per bucket of actors.stats.engine_metrics.TTFT_BUCKETS and
    itl_buckets: list[int] = []       # ITL_BUCKETS, then +Inf
    itl_sum: float = 0.0
    prefix_cache_tier_hit_tokens: int = 0   # of prefix_cache_hit_tokens, those copied back from the KV tier
    kv_tier: KVStats | None = None    # the KV manager's stats, with its tier's (None without a tier)
    ballast_rows: int = 0             # batch-line (ballast) sequences in a step, summed over steps
    ballast_finished: int = 0         # batch-line requests finished
    max_loras: int = 0                    # LoRA adapter slots (0: the base model alone)
    lora_running: dict[str, int] = {}     # adapter -> its requests running now, and waiting
    lora_waiting: dict[str, int] = {}
    lora_requests: dict[str, int] = {}    # adapter -> requests submitted for it since the start
    lora_keys: dict[str, str] = {}        # adapter -> its identity in the prefix cache's hashes (name@contents)
    # Prefix pulls (actors/scheduler/pull_cost.py): those the measured rates said to compute instead, and
    # the rates (0 until measured).
    prefix_pulls_skipped: int = 0
    prefill_tokens_per_s: float = 0.0
    pull_bytes_per_s: float = 0.0


# --- LoRA adapters: front end -> scheduler -> model worker (vLLM's load_lora_adapter API) ----------


class LoadLoRAAdapter(msgspec.Struct, tag=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(msgspec.Struct, tag=True):
    """New requests may no longer name it; those already running finish with it."""

    lora_name: str


class LoRAOutcome(msgspec.Struct, tag=True):
    """The reply to a load or unload: `status` is the HTTP status the front end answers with."""

    status: int = 200
    error: str = ""
    key: str = ""                       # a loaded adapter's identity in the prefix cache: name@contents


class ListLoRAAdapters(msgspec.Struct, tag=True):
    pass


class LoRAAdapters(msgspec.Struct, tag=True):
    adapters: dict[str, str]          # name -> the folder it was read from
    max_loras: int = 0


# --- scheduler <-> model worker -------------------------------------------------------------------


class NewSequence(msgspec.Struct, array_like=True, gc=False):
    """Sampler state to create on the worker before the step that first runs this sequence."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None                  # the request's seed, offset per sample so n copies differ
    output_token_ids: list[int] = []  # tokens it generated elsewhere (handed over): the penalties see them
    lora_name: str | None = None      # its LoRA adapter (None: the base model)


class ScheduledSeq(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    token_ids: list[int]              # tokens whose KV this step computes (a prefill chunk, or the last sampled one)
    start_pos: int                    # position of token_ids[0] = tokens already in the KV cache
    block_table: list[int]
    sample: bool                      # the chunk reaches the end of the known tokens: sample the next one
    spec_token_ids: list[int] = []    # drafted tokens to verify after token_ids (speculative decoding)
    spec_probs: bytes = b""           # float32 [len(spec_token_ids), vocab]: the draft's distributions;
                                      # empty: a point mass on each drafted token


class StepPlan(msgspec.Struct, tag=True, array_like=True, gc=False):
    step_id: int
    seqs: list[ScheduledSeq]
    new_seqs: list[NewSequence] = []
    finished_seq_ids: list[int] = []  # sampler state to drop
    # A decode burst: up to `burst` more steps of these decodes on the worker's own thread, each
    # from the token the one before sampled, into slots the scheduler reserved as lookahead; every
    # step's tokens but the last's go ahead to `report_to` as a StepProgress. The burst stops early
    # when the scheduler pulls its brake (see actors/worker/decode_burst.py).
    burst: int = 0
    report_to: ActorRef | None = None
    # Each layer's KV, once the step's forward has written it, is announced to this actor as a
    # LayerWritten (the transfer actor: prompts handed over go layer by layer).
    layers_to: ActorRef | None = None


class SeqOutput(msgspec.Struct, array_like=True, gc=False):
    seq_id: int
    token_ids: list[int]              # one token, or several when drafted tokens were accepted
    logprobs: list[TokenLogprobs] | None = None
    num_drafted: int = 0              # drafted tokens verified (token_ids holds the accepted ones + 1)
    error: str | None = None          # this sequence failed (the traceback); token_ids is then empty
    prompt_logprobs: list[TokenLogprobs] | None = None   # with its first token, when params ask for them
    embedding: list[float] | None = None   # with its first token, when params ask for one


class StepResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    step_id: int
    outputs: list[SeqOutput]          # one per scheduled sequence that sampled or failed, in plan order
    forward_s: float = 0.0            # the model forward alone
    compute_s: float = 0.0            # everything the worker thread did: inputs, forward, sampling
    num_steps: int = 1                # forwards run: 1 + the burst steps done (outputs: the last one's)


class StepProgress(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One burst step's tokens, sent while the burst goes on (its last step's come in the StepResult)."""

    step_id: int
    outputs: list[SeqOutput]


class GetWorkerInfo(msgspec.Struct, tag=True):
    pass


class WorkerInfo(msgspec.Struct, tag=True):
    num_blocks: int                   # the KV pool the worker allocated
    block_size: int
    max_model_len: int                # the model's own context length
    vocab_size: int
    eos_token_ids: list[int]
    weight_bytes: int = 0             # the model's weights as they sit in memory (quantized or not)
    kv_bytes_per_token: float = 0.0   # with an int8 or fp8 cache's scales
    kv_cache_dtype: str = ""          # the cache's torch dtype, e.g. "int8"


# --- scheduler <-> KV manager ---------------------------------------------------------------------


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


# ---- cluster: a gateway and an engine node in different processes ------------------------------------


class GetEngineInfo(msgspec.Struct, tag=True):
    """A gateway asks an engine node it found in the registry what it serves."""


class EngineInfo(msgspec.Struct, tag=True):
    engine_id: str                    # the id its prefix-index entries carry
    max_model_len: int
    block_size: int
    model: str                        # the model path as the engine was started with
    draining: bool = False
    priority_scheduling: bool = False # requests' `priority` is honoured (else the gateway refuses it)
    role: str = "engine"              # engine (colocated), prefill or decode
    kv_receiver: ActorRef | None = None  # where a prefill engine hands this engine a request's KV
    kv_layout: str = ""               # KVBlockIO.layout: a handoff goes only between engines that share it


class SubmitRefused(msgspec.Struct, tag=True):
    """A draining engine hands a request it will not admit back to its sender, which routes it elsewhere."""

    request_id: str
    reason: str


# ---- disaggregation: a prefill engine hands a request's KV to a decode engine ---------------------


class KVOffer(msgspec.Struct, tag=True):
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


class KVOfferReply(msgspec.Struct, tag=True):
    accepted: bool
    skip_blocks: int = 0              # leading blocks the decode engine already caches: not sent
    reason: str = ""
    no_room: bool = False             # refused for now: its KV pool is full


class KVChunk(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Blocks [first_block, first_block + num_blocks) of a transfer, as KVBlockIO lays them out: of
    layers [first_layer, first_layer + num_layers), or of every layer (num_layers 0)."""

    transfer_id: str
    first_block: int
    num_blocks: int
    data: bytes
    first_layer: int = 0
    num_layers: int = 0


class KVCommit(msgspec.Struct, tag=True):
    """Every block is written: the decode engine starts decoding the request (ask; True on success)."""

    transfer_id: str
    output_token_ids: list[int] | None = None   # the first token, when the offer came before it


class KVCancel(msgspec.Struct, tag=True):
    """The sender gave the handoff up (an ask timed out, say): the decode engine lets its blocks go."""

    transfer_id: str


class KVHandedOver(msgspec.Struct, tag=True):
    """Decode engine -> front end: the request decodes here now; its next deltas come from here."""

    request_id: str


class KVHandoffFailed(msgspec.Struct, tag=True):
    """Prefill engine -> front end: the KV never reached the decode engine; continue the request
    elsewhere. `refused`: the decode engine had no room (it is alive)."""

    request_id: str
    reason: str
    refused: bool = False


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


class HandOver(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: send this sequence's KV (`offer` says what it is) to `to`."""

    seq_id: int
    block_table: list[int]
    offer: KVOffer
    to: ActorRef


class HandOverAhead(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: the sequence's prompt is still being computed, but its first
    `num_blocks` blocks hold their KV: send them ahead (the first such message offers the handoff;
    `offer` has no output tokens). The HandOver after its last chunk sends the rest and commits."""

    seq_id: int
    block_table: list[int]
    num_blocks: int
    offer: KVOffer
    to: ActorRef


class HandOverLayers(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor, before the step `step_id` runs: the step computes the
    sequence's blocks [first_block, end_block) (the last one partly filled when its prompt ends
    there), so each layer of them may go as soon as the worker has written it (LayerWritten).
    The first message for a sequence offers the handoff, as HandOverAhead does; the step's
    outcome (HandOverAhead, HandOver) says which blocks are whole."""

    seq_id: int
    step_id: int
    block_table: list[int]
    first_block: int
    end_block: int
    offer: KVOffer
    to: ActorRef


class LayerWritten(msgspec.Struct, tag=True):
    """Worker -> the plan's `layers_to`, from the compute thread: step `step_id` wrote layer `layer`'s KV."""

    step_id: int
    layer: int


class HandOverCancel(msgspec.Struct, tag=True):
    """Scheduler -> its transfer actor: the sequence sent ahead will not be handed over from those
    blocks (preempted, ended or failed): the decode engine lets its reservation go."""

    seq_id: int


class HandOverDone(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler: the sequence's blocks may go back to the pool."""

    seq_id: int
    ok: bool
    refused: bool
    num_blocks: int
    num_bytes: int
    seconds: float                    # from the HandOver (the first token out) to the commit
    num_blocks_ahead: int = 0         # of num_blocks, sent whole before the HandOver
    num_bytes_ahead: int = 0          # of num_bytes, sent before the HandOver (whole blocks, and layers)


class AdoptReserve(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler (ask): a sequence and blocks for an offered handoff (KVReserved)."""

    offer: KVOffer


class AdoptCommit(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler (ask): the reserved sequence's KV is written; it decodes now."""

    seq_id: int
    output_token_ids: list[int] | None = None   # its first token, when the offer came before it


class AdoptDrop(msgspec.Struct, tag=True):
    """Transfer actor -> scheduler: the handoff was cut; the reserved blocks go back."""

    seq_id: int


class KVConfirm(msgspec.Struct, tag=True):
    """The reserved positions now hold KV: they count as computed (and their full blocks are cached)."""

    seq_id: int
    num_tokens: int


class KVPull(msgspec.Struct, tag=True):
    """To a peer's KV transfer actor (ask): the bytes of the leading blocks of these hashes it holds."""

    block_hashes: list[bytes]
    block_layout: str                 # the asker's KVBlockIO layout; another gets nothing


class KVPulled(msgspec.Struct, tag=True):
    """The leading run of the asked blocks that could be given, each as KVBlockIO reads one block."""

    blocks: list[bytes]


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


class PrefixPullTimed(msgspec.Struct, tag=True, frozen=True):
    """To the scheduler, from its KV transfer actor: a prefix pull moved `num_bytes` in `seconds` (a
    measurement of the link, for the next pull-or-compute decision)."""

    num_bytes: int
    seconds: float


# What crosses processes between a gateway and an engine; the rest stays inside one engine process.
register_messages(SubmitRequest, AbortRequest, TokenDeltas, GetStats, EngineStats,
                  GetEngineInfo, EngineInfo, SubmitRefused,
                  LoadLoRAAdapter, UnloadLoRAAdapter, LoRAOutcome, ListLoRAAdapters, LoRAAdapters)
register_messages(KVOffer, KVOfferReply, KVChunk, KVCommit, KVCancel, KVHandedOver, KVHandoffFailed)
register_messages(KVPull, KVPulled)
