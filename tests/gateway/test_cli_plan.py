"""`matinee plan` end to end, as a process: the chapter's figure, --fit, --json and a bad preset."""
from __future__ import annotations

import json
import subprocess
import sys

CHAPTER = ["--model", "70b-gqa", "--context-len", "131072", "--concurrency", "8", "--weight-dtype", "bf16",
           "--kv-dtype", "bf16", "--gpu-memory", "80GB"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "plan", *args], capture_output=True, text=True,
                          timeout=60)


def test_table_reproduces_the_chapter():
    r = plan(*CHAPTER, "--fit", "--gpus", "7")
    assert r.returncode == 0, r.stderr
    rows = {line[:12].strip(): line[12:].split() for line in r.stdout.splitlines()}
    assert rows["weights"][:2] == ["140.0", "GB"] and rows["KV cache"][:2] == ["343.6", "GB"]
    assert round(float(rows["total"][0])) == 484 and rows["GPUs"] == ["7", "x", "80", "GB"]
    assert int(rows["fits"][0]) >= 8


def test_json_for_machines():
    r = plan(*CHAPTER, "--json", "--fit", "--gpus", "7")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["weight_bytes"] == 140e9 and out["kv_bytes"] == 343_597_383_680 and out["gpus"] == 7
    assert out["kv_bytes_per_token"] == 327680 and out["fit_concurrency"] >= 8


def test_bad_preset_is_one_line_and_exit_2():
    r = plan("--model", "no-such-preset")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("matinee plan: unknown model 'no-such-preset'")
    r = plan("--model", "70b-gqa", "--gpu-memory", "lots")
    assert r.returncode == 2 and r.stderr.startswith("matinee plan: not a size: 'lots'")


def test_gguf_types_and_the_files_own_mix():
    """The default model (Q4_1 layers, a Q8_0 embedding): auto sizes the file's own mix, packed as the CPU
    kernels hold it (96,576,768 bytes with float32 norms; here 16-bit, as on a GPU); q4_k every weight."""
    r = plan("--weight-dtype", "auto", "--kv-dtype", "int8", "--context-len", "1024", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    norms = 30 * 2 * 576 + 576
    assert out["weight_bytes"] == 96_576_768 - 2 * norms
    assert out["kv_bytes_per_token"] == 30 * 3 * 64 * 2 + 30 * 3 * 2 * 4 / 16   # the scales of each block
    r = plan("--weight-dtype", "q4_k", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["weight_bytes"] == out["num_params"] * 148 / 256
    r = plan("--model", "70b-gqa", "--weight-dtype", "auto")
    assert r.returncode == 2 and "GGUF file's own" in r.stderr
