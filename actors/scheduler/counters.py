"""What the scheduler counts for the engine's stats: plain numbers and histograms, no decisions."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from actors.stats.engine_metrics import ITL_BUCKETS, QUEUE_TIME_BUCKETS, TTFT_BUCKETS
from prefix_store.metrics import Histogram


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_tier_hit_tokens: int = 0
    steps: int = 0
    kv_slots_allocated: int = 0     # slots in the running sequences' blocks, summed over steps
    kv_slots_used: int = 0          # of those, slots holding a token (KV waste = 1 - used / allocated)
    spec_draft_tokens: int = 0      # drafted tokens verified
    spec_accepted_tokens: int = 0   # of those, the ones kept
    spec_num_drafts: int = 0        # verifications with at least one drafted token
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
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    lora_requests: Counter[str] = field(default_factory=Counter)   # LoRA adapter -> requests submitted
