"""The real default model: SmolLM2-135M-Instruct from its GGUF, Matinee vs transformers loading
the same GGUF, greedy 32 tokens for several prompts batched together, and a chat answer in English."""
from __future__ import annotations

import pytest

from actors.worker.model_runner import ModelRunner
from tests.actors.conftest import hf_greedy_batch
from tests.actors.test_model_parity import Blocks, Seq, run_greedy

NUM_NEW = 32


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm2_gguf, smollm2_hf):
    runner = ModelRunner(None, dtype="float32", kernels="torch", num_threads=1, block_size=16, num_blocks=64)
    assert runner.source.path == smollm2_gguf
    tok = runner.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [
        chat,
        tok.encode("The history of the Roman Empire"),
        tok.encode("def fibonacci(n):"),
        tok.encode("1, 2, 3, 4,"),
        [tok.encode("Hi")[0]],
    ]
    seqs = [Seq(p) for p in prompts]
    run_greedy(runner, seqs, Blocks(runner.num_blocks), NUM_NEW, chunk=24)  # chunked prefill, mixed steps

    expected = hf_greedy_batch(smollm2_hf, prompts, NUM_NEW)
    for p, s, want in zip(prompts, seqs, expected):
        assert s.output == want, tok.decode(p)

    answer = tok.decode(seqs[0].output)
    assert "Paris" in answer, answer
    assert sum(c.isascii() for c in answer) / len(answer) > 0.95
