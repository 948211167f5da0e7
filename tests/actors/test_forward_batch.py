"""flatten: a small batch of decodes takes a plain-Python path; it must give the numpy path's
tensors and refuse what the numpy path refuses, with the same message."""
from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from actors.worker import forward_batch
from actors.worker.forward_batch import ForwardBatch, SequenceInput, flatten

BLOCK, NUM_BLOCKS, VOCAB = 4, 64, 100


def _both(batch: ForwardBatch, monkeypatch: pytest.MonkeyPatch):
    fast = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    with monkeypatch.context() as m:
        m.setattr(forward_batch, "SMALL_DECODE_BATCH", 0)   # every batch through numpy
        slow = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    return fast, slow


def _decodes(rng: random.Random, n: int) -> ForwardBatch:
    seqs = []
    for _ in range(n):
        start = rng.randrange(0, 40)
        table = rng.sample(range(NUM_BLOCKS), start // BLOCK + 1 + rng.randrange(0, 3))   # room to spare, at times
        seqs.append(SequenceInput([rng.randrange(VOCAB)], start, table))
    return ForwardBatch(seqs)


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_small_decode_batches_flatten_to_the_numpy_paths_tensors(n, monkeypatch):
    rng = random.Random(n)
    for _ in range(20):
        fast, slow = _both(_decodes(rng, n), monkeypatch)
        for f in fields(fast):
            a, b = getattr(fast, f.name), getattr(slow, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), f.name
            else:
                assert a == b, f.name


def test_the_python_path_is_taken_for_small_decode_batches_only(monkeypatch):
    taken = []
    real = forward_batch._flatten_decodes
    monkeypatch.setattr(forward_batch, "_flatten_decodes", lambda *a: taken.append(1) or real(*a))
    rng = random.Random(0)
    flatten(_decodes(rng, 3), BLOCK, NUM_BLOCKS, VOCAB)
    flatten(_decodes(rng, forward_batch.SMALL_DECODE_BATCH + 1), BLOCK, NUM_BLOCKS, VOCAB)
    flatten(ForwardBatch([SequenceInput([1, 2], 0, [0])]), BLOCK, NUM_BLOCKS, VOCAB)        # a prefill chunk
    flatten(ForwardBatch([SequenceInput([1], 0, [0], 0)]), BLOCK, NUM_BLOCKS, VOCAB)        # no logits wanted
    assert taken == [1]


@pytest.mark.parametrize("seq", [
    SequenceInput([5], -1, [0]),                 # negative position
    SequenceInput([5], 4, [0]),                  # the table holds 4 tokens, not 5
    SequenceInput([5], 2, [NUM_BLOCKS]),         # block id out of range
    SequenceInput([5], 2, [-1]),
    SequenceInput([VOCAB], 2, [0]),              # token id out of range
    SequenceInput([-1], 2, [0]),
])
def test_bad_decodes_are_refused_as_the_numpy_path_refuses_them(seq, monkeypatch):
    batch = ForwardBatch([SequenceInput([1], 0, [1]), seq])
    with pytest.raises(ValueError) as fast:
        flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    monkeypatch.setattr(forward_batch, "SMALL_DECODE_BATCH", 0)
    with pytest.raises(ValueError) as slow:
        flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    assert str(fast.value) == str(slow.value)
