"""What the scheduler counts for the engine's stats: plain numbers and histograms, no decisions.

Each counter is named as the EngineStats field it fills (a histogram `h` fills `h_buckets` and `h_sum`), and
`stats_fields` copies them all: a new counter is declared here and in EngineStats, and copied by itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields

from actors.stats.engine_metrics import ITL_BUCKETS, QUEUE_TIME_BUCKETS, TTFT_BUCKETS
from actors.messages.handoff import HandoffSent
from runtime.histogram import Histogram


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_tier_hit_tokens: int = 0
    steps: int = 0
    kv_slots_allocated: int = 0     # slots in the running sequences' blocks, summed over steps
    kv_slots_used: int = 0          # of those, slots holding a token (KV waste = 1 - used / allocated)
    spec_decode_draft_tokens: int = 0      # drafted tokens verified
    spec_decode_accepted_tokens: int = 0   # of those, the ones kept
    spec_decode_num_drafts: int = 0        # verifications with at least one drafted token
    # Seconds from arrival here to first scheduled (a preempted request's wait again is not counted).
    queue_time: Histogram = field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    ballast_rows: int = 0           # batch-line sequences in a step, summed over steps
    ballast_finished: int = 0       # batch-line requests finished here
    prefill_steps: int = 0          # steps that computed some sequence's prompt (or its recompute)
    prefill_tokens: int = 0
    ttft_count: int = 0             # first tokens sampled, and their time split: queue, then prefill
    ttft_queue_s: float = 0.0
    ttft_prefill_s: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))   # arrival to first token
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))     # per token
    # Accepted drafted tokens by their position in the draft: a draft whose first a tokens were
    # accepted counts one at each of positions 0..a-1 (vLLM's num_accepted_tokens_per_pos).
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
    lora_requests: Counter[str] = field(default_factory=Counter)   # LoRA adapter -> requests submitted


@dataclass
class HandoffCounters:
    """Handoffs this engine sent (with what they moved), and those it took over."""

    kv_handoffs_sent: int = 0
    kv_handoffs_failed: int = 0       # sender side: cut, or refused by a full decode engine
    kv_handoffs_received: int = 0
    kv_handoffs_refused: int = 0      # receiver side: no room for the blocks
    kv_transfer_blocks: int = 0
    kv_transfer_blocks_ahead: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_bytes_ahead: int = 0
    kv_transfer_s: float = 0.0

    def sent(self, done: HandoffSent) -> None:
        if done.ok:
            self.kv_handoffs_sent += 1
            self.kv_transfer_blocks += done.num_blocks
            self.kv_transfer_blocks_ahead += done.num_blocks_ahead
            self.kv_transfer_bytes += done.num_bytes
            self.kv_transfer_bytes_ahead += done.num_bytes_ahead
            self.kv_transfer_s += done.seconds
        else:
            self.kv_handoffs_failed += 1


def stats_fields(counters: Counters | HandoffCounters) -> dict:
    """The counters under the EngineStats fields they fill, copied: a number as it is, a list or Counter as a
    list or dict, a histogram `h` as `h_buckets` (counts per bucket, then +Inf) and `h_sum`."""
    out: dict = {}
    for f in fields(counters):
        value = getattr(counters, f.name)
        if isinstance(value, Histogram):
            out[f"{f.name}_buckets"], out[f"{f.name}_sum"] = list(value.counts), value.sum
        elif isinstance(value, Counter):
            out[f.name] = dict(value)
        elif isinstance(value, list):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out
