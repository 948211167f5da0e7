"""bench.perplexity scores the second half of each chunk through the engine's runner, its flags passed through."""
from __future__ import annotations

import math

import torch

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from bench import perplexity


def test_perplexity_is_the_mean_loss_of_each_chunks_second_half(tiny_model_dir, tmp_path, capsys):
    folder = tiny_model_dir("llama")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    out = perplexity.main(["--model", folder, "--kernels", "torch", "--dtype", "float32", "--context", "16",
                           "--text", str(text), "--num-blocks", "8", "--quantization", "none"])
    assert out["quantization"] == "none" and out["dtype"] == "float32" and out["context"] == 16
    assert out["tokens_scored"] == out["chunks"] * 8 and out["chunks"] >= 2
    # The same from one forward per chunk, by hand.
    runner = ModelRunner(folder, dtype="float32", kernels="torch", num_blocks=8, num_threads=1)
    ids = runner.tokenizer.encode(text.read_text())
    nll = 0.0
    for start in range(0, out["chunks"] * 16, 16):
        chunk = ids[start:start + 16]
        logits = runner.execute(ForwardBatch([SequenceInput(chunk, 0, [0, 1], num_logits=16)]))
        for pos in range(8, 16):
            nll -= torch.log_softmax(logits[pos - 1].double(), -1)[chunk[pos]].item()
    assert math.isclose(out["perplexity"], math.exp(nll / out["tokens_scored"]), rel_tol=1e-3)
    assert '"perplexity"' in capsys.readouterr().out


def test_the_kv_cache_format_is_selected_and_reported(tiny_model_dir, tmp_path):
    """An int8 cache is what the chunks' attention reads: the score moves, a little."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    common = ["--model", tiny_model_dir("llama"), "--kernels", "torch", "--dtype", "float32", "--context", "16",
              "--text", str(text), "--num-blocks", "8", "--quantization", "none"]
    plain, int8 = perplexity.main(common), perplexity.main(common + ["--kv-cache-dtype", "int8"])
    assert plain["kv_cache_dtype"] == "auto" and int8["kv_cache_dtype"] == "int8"
    assert int8["perplexity"] != plain["perplexity"]
    assert math.isclose(int8["perplexity"], plain["perplexity"], rel_tol=0.05)
