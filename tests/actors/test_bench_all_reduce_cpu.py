"""bench/all_reduce_cpu.py times gloo's and shared memory's all-reduce between two real processes."""
import json

import pytest

from bench import all_reduce_cpu
from kernels import cpu_native


@pytest.mark.slow
@pytest.mark.skipif(not cpu_native.available(), reason="the C kernels do not build here")
def test_all_reduce_bench_times_both(tmp_path, capsys):
    path = tmp_path / "ar.json"
    out = all_reduce_cpu.main(["--width", "256", "--rows", "1", "3", "--dtypes", "bfloat16", "--calls", "10",
                               "--json", str(path)])
    assert set(out) == {"1x256 bfloat16", "3x256 bfloat16"}
    for shape in out.values():
        for name in ("gloo", "shm"):
            assert 0 < shape[name]["median_us"] <= shape[name]["p90_us"]
    assert json.loads(path.read_text())["3x256 bfloat16"] == json.loads(json.dumps(out["3x256 bfloat16"]))
    assert "gloo/shm" in capsys.readouterr().out
