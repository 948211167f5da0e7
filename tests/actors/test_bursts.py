"""The scheduler's share of decode bursts (actors/scheduler/bursts.py), alone: when a plan may burst
and how far, and what each sequence's KV holds after one. The burst end to end, with the real KV
manager, is tests/actors/test_decode_burst_scheduler.py's."""
from __future__ import annotations

from actors.messages.front_end import SamplingParams
from actors.scheduler.bursts import burst_length, burst_trims
from actors.scheduler.sequence import RequestState, Sequence, SeqStatus

MAX_MODEL_LEN = 64


def decoding(seq_id: int, max_tokens: int = 20, generated: int = 1, prompt: int = 4) -> Sequence:
    """A running sequence whose last sampled token is all it has left to compute."""
    req = RequestState(f"r{seq_id}", list(range(prompt)), SamplingParams(max_tokens=max_tokens), "client", 0,
                       seq_id, None, MAX_MODEL_LEN)
    seq = Sequence(seq_id, req, 0)
    seq.token_ids += [7] * generated
    seq.num_computed = seq.num_tokens - 1
    seq.status = SeqStatus.RUNNING
    return seq


def test_a_batch_of_decodes_alone_bursts_as_far_as_allowed_and_its_room_lets_it():
    running = [decoding(0), decoding(1)]
    assert burst_length(running, 8, MAX_MODEL_LEN, others=False) == 7   # 8 steps: 7 after this one
    short = decoding(2, max_tokens=4, generated=1)   # 3 tokens left to generate
    assert burst_length(running + [short], 8, MAX_MODEL_LEN, others=False) == 2
    near_the_end = decoding(3, max_tokens=100, generated=1, prompt=60)   # the context leaves 3 tokens to generate
    assert burst_length([near_the_end], 8, MAX_MODEL_LEN, others=False) == 2


def test_no_burst_when_anything_else_wants_the_next_step():
    running = [decoding(0), decoding(1)]
    assert burst_length(running, 1, MAX_MODEL_LEN, others=False) == 0       # bursts are off
    assert burst_length(running, 8, MAX_MODEL_LEN, others=True) == 0        # a request, a fork or drafts
    assert burst_length([], 8, MAX_MODEL_LEN, others=False) == 0
    prefilling = decoding(2)
    prefilling.num_computed = 2
    assert burst_length(running + [prefilling], 8, MAX_MODEL_LEN, others=False) == 0
    handed = decoding(3)
    handed.request.handoff_to = "decoder"
    assert burst_length(running + [handed], 8, MAX_MODEL_LEN, others=False) == 0
    last = decoding(4, max_tokens=2, generated=1)   # one token left: this step is its last
    assert burst_length([last], 8, MAX_MODEL_LEN, others=False) == 0


def test_after_a_burst_each_running_sequence_has_the_kv_of_every_step_but_the_last_token():
    a, b, gone = decoding(0), decoding(1), decoding(2)
    # The plan computed each one's last token (num_computed += 1); the burst then ran 3 steps more.
    for seq in (a, b, gone):
        seq.num_computed += 1
        seq.token_ids += [8, 9, 10, 11]
    gone.status = SeqStatus.FINISHED
    trims = burst_trims([a, None, gone, b], num_steps=4)
    assert [(t.seq_id, t.num_tokens) for t in trims] == [(0, 8), (1, 8)]
    assert a.num_computed == b.num_computed == a.num_tokens - 1 == 8
    assert gone.num_computed == 5   # untouched: its blocks are freed whole
