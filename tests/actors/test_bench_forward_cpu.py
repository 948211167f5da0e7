"""bench/forward_cpu.py runs end to end at toy sizes on the default model and reports both steps and the
decode step's memory floor."""

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
    memory = out["memory"]   # the floor: the resident weights read once at the measured rate
    assert memory["read_gb_s"] > 0 and memory["weight_bytes"] > 50e6
    floor = memory["weight_bytes"] / (memory["read_gb_s"] * 1e6)   # the rate is printed to 0.1 GB/s
    assert abs(memory["decode_floor_ms"] - floor) < 0.01 * floor
    # the fraction is of the unrounded times; both printed to 0.01 ms, so within 1% and its own rounding
    expect = memory["decode_floor_ms"] / out["decode"]["best_ms"]
    assert abs(memory["floor_frac"] - expect) < 0.01 * expect + 0.001
