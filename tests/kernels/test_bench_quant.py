"""The quantized-matmul benchmarks run: the GPU one refuses in one line without CUDA and runs at
toy sizes under the interpreter with --dry-run; the CPU one over one layer."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.kernels_quant_gpu import FORMATS, ROWS

ROOT = Path(__file__).parents[2]


def test_refuses_in_one_line_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.kernels_quant_gpu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CUDA device" in done.stderr


def test_dry_run_measures_every_format_and_checks_it(tmp_path, capsys):
    from bench import kernels_quant_gpu

    out = tmp_path / "summary.json"
    kernels_quant_gpu.main(["--dry-run", "--json", str(out)])
    summary = json.loads(out.read_text())
    assert summary["correct"], [(r["format"], r["error"]) for r in summary["matmuls"]]
    assert {r["format"] for r in summary["matmuls"]} == set(FORMATS)
    assert len(summary["matmuls"]) == 2 * len(FORMATS) * len(ROWS)
    assert all(r["bw_frac"] > 0 and r["ms"] > 0 for r in summary["matmuls"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


def test_cpu_bench_times_every_format_over_one_layer(capsys):
    from bench import quant_linear_cpu

    quant_linear_cpu.main(["--layers", "1", "--threads", "1", "--repeats", "1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = {r["format"] for r in summary["results"]}
    assert {"float32", "int8", "int4_f32", "int4_bf16"} <= names
    assert len(summary["results"]) == len(names) * len(quant_linear_cpu.ROWS)
    by_name = {r["format"]: r["weight_mb"] for r in summary["results"]}
    assert by_name["int8"] < by_name["float32"] / 3.9 and by_name["int4_f32"] < by_name["float32"] / 6


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("git") is None or not (ROOT / ".git").exists()
                    or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs a C compiler, an AVX2 CPU and the repository's history")
def test_ab_bench_times_this_tree_against_a_commit(capsys, monkeypatch):
    """bench.quant_ab builds quant_gemm.c at a commit and in this tree and times both on the same weights; a commit
    that does not exist is refused in one line."""
    from bench import quant_ab

    rows = quant_ab.main(["--against", "HEAD", "--types", "Q4_0,Q4_K", "--rows", "1,3", "--repeats", "1",
                          "--layers", "1", "--threads", "1", "--json"])
    assert [(r["type"], r["rows"]) for r in rows] == [("Q4_0", 1), ("Q4_0", 3), ("Q4_K", 1), ("Q4_K", 3)]
    assert all(r["HEAD"]["best_ms"] > 0 and r["tree"]["best_ms"] > 0 and r["tree_over_against"] > 0 for r in rows)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == rows
    widths, compile_gemm = [], quant_ab.compile_gemm

    def recorded(*args):
        lib = compile_gemm(*args)
        widths.append(lib.matinee_quant_width())
        return lib
    monkeypatch.setattr(quant_ab, "compile_gemm", recorded)
    avx2 = quant_ab.main(["--against", "HEAD", "--types", "Q6_K", "--rows", "1", "--repeats", "1", "--layers", "1",
                          "--threads", "1", "--avx2"])
    assert widths == [256, 256] and avx2[0]["tree"]["best_ms"] > 0   # both builds as an AVX2-only CPU runs them
    with pytest.raises(SystemExit, match="git archive no-such-commit"):
        quant_ab.main(["--against", "no-such-commit"])
