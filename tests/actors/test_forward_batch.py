"""flatten: a small batch of decodes takes a plain-Python path; it must give the numpy path's
tensors and refuse what the numpy path refuses, with the same message. DecodeCursor moves a
flattened batch of decodes on in place: it must give what flattening the next step gives."""
from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from actors.worker import forward_batch
from actors.worker.forward_batch import DecodeCursor, ForwardBatch, SequenceInput, flatten

BLOCK, NUM_BLOCKS, VOCAB = 4, 64, 100


def _both(batch: ForwardBatch, monkeypatch: pytest.MonkeyPatch):
    fast = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    with monkeypatch.context() as m:
        m.setattr(forward_batch, "SMALL_DECODE_BATCH", 0)   # every batch through numpy
        slow = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    return fast, slow


def _same(a, b) -> None:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


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
        _same(*_both(_decodes(rng, n), monkeypatch))


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



def _roomy_decodes(rng: random.Random, n: int, steps: int) -> ForwardBatch:
    """Decodes whose tables hold `steps` more positions (and at times a block more)."""
    seqs = []
    for _ in range(n):
        start = rng.randrange(0, 40)
        table = rng.sample(range(NUM_BLOCKS), (start + steps) // BLOCK + 1 + rng.randrange(0, 2))
        seqs.append(SequenceInput([rng.randrange(VOCAB)], start, table))
    return ForwardBatch(seqs)


@pytest.mark.parametrize("n", [1, 3, 16, 40])   # both flatten paths
def test_a_cursor_moves_a_decode_batch_on_as_flattening_the_next_step_would(n):
    rng, steps = random.Random(n), 3 * BLOCK
    batch = _roomy_decodes(rng, n, steps)
    cursor = DecodeCursor(flatten(batch, BLOCK, NUM_BLOCKS, VOCAB), [s.block_table for s in batch.seqs], BLOCK, VOCAB)
    moved = flattened = 0
    for _ in range(steps):
        tokens = [rng.randrange(VOCAB) for _ in batch.seqs]
        batch = ForwardBatch([SequenceInput([t], s.num_computed + 1, s.block_table)
                              for t, s in zip(tokens, batch.seqs)])
        expected = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
        if cursor.advance(tokens):
            moved += 1
            _same(cursor.flat, expected)
        else:   # the longest sequence enters a new column of blocks: nothing moved, the step is flattened anew
            flattened += 1
            assert cursor.flat.max_seq_len == max(s.num_computed for s in batch.seqs)
            assert expected.block_tables.shape[1] == cursor.flat.block_tables.shape[1] + 1
            _same(flatten(cursor.batch(tokens), BLOCK, NUM_BLOCKS, VOCAB), expected)
            cursor = DecodeCursor(expected, [s.block_table for s in batch.seqs], BLOCK, VOCAB)
    assert moved >= steps - steps // BLOCK - 1 and flattened >= steps // BLOCK - 1


def test_a_cursor_at_the_end_of_a_table_hands_the_step_to_flatten():
    table = [7, 3]   # room for 2 blocks: positions 0..7
    batch = ForwardBatch([SequenceInput([1], 2 * BLOCK - 2, table), SequenceInput([1], 1, [5, 6, 9])])
    cursor = DecodeCursor(flatten(batch, BLOCK, NUM_BLOCKS, VOCAB), [s.block_table for s in batch.seqs], BLOCK, VOCAB)
    assert cursor.advance([4, 5])   # position 7: the last of the table
    assert not cursor.advance([4, 5])
    with pytest.raises(ValueError, match="cannot hold"):
        flatten(cursor.batch([4, 5]), BLOCK, NUM_BLOCKS, VOCAB)


def test_a_cursor_refuses_tokens_outside_the_vocabulary_and_moves_nothing():
    batch = _decodes(random.Random(0), 3)
    flat = flatten(batch, BLOCK, NUM_BLOCKS, VOCAB)
    before = [t.clone() for t in (flat.input_ids, flat.positions, flat.seq_lens, flat.slot_mapping)]
    cursor = DecodeCursor(flat, [s.block_table for s in batch.seqs], BLOCK, VOCAB)
    for tokens in ([1, 2, VOCAB], [-1, 2, 3], [1, 2]):
        with pytest.raises(ValueError):
            cursor.advance(tokens)
    assert all(torch.equal(a, b) for a, b in zip(before, (flat.input_ids, flat.positions, flat.seq_lens,
                                                          flat.slot_mapping)))


def test_only_batches_of_single_decodes_with_logits_take_a_cursor():
    decodes = flatten(_decodes(random.Random(1), 4), BLOCK, NUM_BLOCKS, VOCAB)
    prefill = flatten(ForwardBatch([SequenceInput([1, 2], 0, [0])]), BLOCK, NUM_BLOCKS, VOCAB)
    silent = flatten(ForwardBatch([SequenceInput([1], 0, [0], 0)]), BLOCK, NUM_BLOCKS, VOCAB)
    assert DecodeCursor.fits(decodes) and not DecodeCursor.fits(prefill) and not DecodeCursor.fits(silent)
