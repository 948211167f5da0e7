"""The GPU benchmark script runs end to end at toy sizes on the CPU (under the interpreter)."""

import json
import sys

import pytest


@pytest.mark.slow
def test_kernels_gpu_bench_dry_run(monkeypatch, capsys, tmp_path):
    from bench import kernels_gpu

    out = tmp_path / "summary.json"
    monkeypatch.setattr(sys, "argv", ["kernels_gpu", "--dry-run", "--json", str(out)])
    kernels_gpu.main()
    summary = json.loads(out.read_text())
    assert summary["correct"], summary["max_error"]
    assert set(summary["max_error"]) >= {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                                         "write_kv", "paged_attention", "paged_attention_split_kv"}
    assert len(summary["decode_attention"]) == 2 and len(summary["model_decode_step"]) == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
