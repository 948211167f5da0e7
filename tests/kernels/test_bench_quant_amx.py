"""bench/quant_amx_cpu.py runs at toy sizes: one row per shape and row count, or a clear word without AMX."""

from bench import quant_amx_cpu
from kernels import quant_amx


def test_the_bench_times_each_shape_at_each_row_count(capsys):
    out = quant_amx_cpu.main(["--rows", "16,40", "--repeats", "1", "--shapes", "o,down"])
    if not quant_amx.available():
        assert out == [] and "no AMX" in capsys.readouterr().out
        return
    assert [(r["shape"], r["rows"]) for r in out] == [("o", 16), ("o", 40), ("down", 16), ("down", 40)]
    assert all(r["amx_ms"] > 0 and r["torch_bf16_ms"] > 0 for r in out)
