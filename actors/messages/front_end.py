"""What a front end (the gateway, or the offline LLM) and an engine say to each other: requests, their
token deltas, stats, LoRA adapters, and what a cluster's gateway asks an engine node. These cross processes
in a cluster (registered on the wire below). SamplingParams and StructuredOutput are what a request asks for.
"""

from __future__ import annotations

import msgspec

from runtime import ActorRef, register_messages
from actors.messages.kv import KVStats


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
    all_reduce_s: float = 0.0         # tensor parallelism: rank 0's cumulative time inside the all-reduces
    collective_s: float = 0.0         # and inside every collective (with the LM head's gather, the plans' broadcasts)
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
    kv_transfer_s: float = 0.0        # cumulative, the first token (the HandoffSend) to commit, on the sending side
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


# Across processes between a gateway and an engine node.
register_messages(SubmitRequest, AbortRequest, TokenDeltas, GetStats, EngineStats,
                  GetEngineInfo, EngineInfo, SubmitRefused,
                  LoadLoRAAdapter, UnloadLoRAAdapter, LoRAOutcome, ListLoRAAdapters, LoRAAdapters)
