"""bench/forward_cpu.py runs end to end at toy sizes on the default model and reports both steps."""

import json

from bench import forward_cpu


def test_forward_bench_times_a_prefill_and_a_decode_step(smollm2_gguf, capsys):
    out = forward_cpu.main(["--model", smollm2_gguf, "--prompts", "2", "--prompt-len", "20", "--decodes", "3",
                            "--context", "40", "--repeats", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert out["prefill"]["prompts"] == 2 and out["decode"]["decodes"] == 3
    for step in (out["prefill"], out["decode"]):
        assert 0 < step["best_ms"] <= step["median_ms"]
    assert out["prefill"]["tokens_per_s"] > 0
