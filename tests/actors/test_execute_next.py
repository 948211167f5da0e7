"""ModelRunner.execute_next: a decode burst's further steps move the last batch on in place
(forward_batch.DecodeCursor) rather than flattening it anew; the logits must be those of `execute`
on the same batch, across a block boundary (where the step is flattened anew) too."""
from __future__ import annotations

import pytest
import torch

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner


def _runner(path, kernels):
    return ModelRunner(path, dtype="float32", kernels=kernels, block_size=4, num_blocks=32, num_threads=2)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_the_next_step_gives_executes_logits(kernels, tiny_model_dir):
    path = tiny_model_dir("llama")
    moving, flattening = _runner(path, kernels), _runner(path, kernels)
    prompts, tables = [list(range(3, 14)), [7, 8, 9]], [[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14]]
    first = ForwardBatch([SequenceInput(p, 0, t) for p, t in zip(prompts, tables)])
    assert torch.equal(moving.execute(first), flattening.execute(first))
    decode = ForwardBatch([SequenceInput([5], len(p), t) for p, t in zip(prompts, tables)])
    got = moving.execute(decode)
    assert torch.equal(got, flattening.execute(decode))
    for step in range(12):   # crosses three block boundaries of the longer sequence
        tokens = [int(row.argmax()) for row in got]
        decode = ForwardBatch([SequenceInput([t], s.num_computed + 1, s.block_table)
                               for t, s in zip(tokens, decode.seqs)])
        got = moving.execute_next(tokens)
        assert torch.equal(got, flattening.execute(decode)), f"step {step}"


def test_the_next_step_follows_a_step_of_decodes_alone(tiny_model_dir):
    runner = _runner(tiny_model_dir("llama"), "torch")
    with pytest.raises(RuntimeError, match="decodes alone"):
        runner.execute_next([1])
    runner.execute(ForwardBatch([SequenceInput([1, 2, 3], 0, [0])]))   # a prefill chunk
    with pytest.raises(RuntimeError, match="decodes alone"):
        runner.execute_next([1])
    runner.execute(ForwardBatch([SequenceInput([4], 3, [0, 1])]))
    with pytest.raises(ValueError, match="out of range"):
        runner.execute_next([10 ** 9])
    with pytest.raises(RuntimeError, match="decodes alone"):   # a refused step ends the run of steps
        runner.execute_next([1])
