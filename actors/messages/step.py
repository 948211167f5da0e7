"""What the scheduler and the model worker say: one step's plan (the sequences it runs, the tokens it feeds)
and its result (the tokens sampled), the worker's own description, and the worker's word, mid-step, that a
layer's KV is written. Array-like structs are positional on the wire: new fields go at the end, with defaults.
"""

from __future__ import annotations

import msgspec

from runtime import ActorRef
from actors.messages.front_end import SamplingParams, TokenLogprobs


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
    all_reduce_s: float = 0.0         # tensor parallelism: rank 0's time inside the all-reduces, all forwards
    collective_s: float = 0.0         # and inside every collective (the all-reduces, gathers, plan broadcasts)


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


class LayerWritten(msgspec.Struct, tag=True):
    """Worker -> the plan's `layers_to`, from the compute thread: step `step_id` wrote layer `layer`'s KV."""

    step_id: int
    layer: int
