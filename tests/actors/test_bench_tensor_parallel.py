"""bench/tensor_parallel.py runs TP=1 and TP=2 (once through gloo, once through shared memory) end to end
at toy sizes on a tiny model whose heads split in two, and reports for each the prefill, the decode ITL of
one and of a batch of streams, and (TP=2) the all-reduce's share of the step from the timer the engine's
stats carry."""
import json

import pytest

from bench import tensor_parallel


@pytest.mark.slow
def test_tensor_parallel_bench_reports_both_configurations(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "tp.json"
    out = tensor_parallel.main(["--model", tiny_model_dir("llama"), "--dtype", "float32", "--prompt-len", "32",
                                "--decode-tokens", "6", "--batch", "2", "--repeats", "1", "--all-reduce", "gloo", "shm",
                                "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    printed = capsys.readouterr().out
    assert "TP=2 shm/TP=1" in printed and "TP=2 gloo prefill: a step of" in printed
    assert "TP=2 shm decode, 2 stream(s)" in printed and "inside the all-reduces" in printed
    assert out["dtype"] == "float32"
    for key, tp in [("tp1", 1), ("tp2_gloo", 2), ("tp2_shm", 2)]:
        run = out[key]
        assert run["tensor_parallel_size"] == tp and run["threads_per_rank"] >= 1
        assert run["all_reduce"] == (None if tp == 1 else key.removeprefix("tp2_"))
        prefill = run["prefill"]
        assert prefill["prompt_len"] == 32 and prefill["cached_tokens"] == 0   # random prompts: all computed
        assert prefill["ms"] > 0 and prefill["step_ms"] > 0 and prefill["tokens_per_s"] > 0
        assert sorted(run["decode"]) == ["1", "2"]
        for streams, decode in run["decode"].items():
            # every step a decode step: the prompts' first block came from the prefix cache
            assert decode["cached_tokens"] == int(streams) * tensor_parallel.BLOCK
            assert decode["steps"] >= 1 + 6 and decode["itl_ms"] > 0 and decode["step_ms"] > 0
        for step in [prefill, *run["decode"].values()]:
            if tp == 1:   # one process: no collectives
                assert step["all_reduce_share"] == step["collective_share"] == 0.0
            else:
                assert 0 < step["all_reduce_share"] <= step["collective_share"] <= 1
                assert 0 < step["all_reduce_ms"] < step["step_ms"]
    assert set(out["ratios_tp2_over_tp1"]) == {"gloo", "shm"}
    for ratios in out["ratios_tp2_over_tp1"].values():
        assert set(ratios) == {"prefill_ms", "itl_ms_1", "itl_ms_2"} and all(r > 0 for r in ratios.values())
