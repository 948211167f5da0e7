"""Every Triton kernel compiles for sm_90 (no GPU needed), with vectorised loads where it matters."""

import os
import re
import shutil
import subprocess
import sys

import pytest


def _nvidia_toolchain() -> bool:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
        from triton import knobs

        return bool(knobs.nvidia.ptxas.path) or shutil.which("ptxas") is not None
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_toolchain(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90():
    # A child process: here TRITON_INTERPRET is set, and it makes @triton.jit skip the compiler.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.compile_for_gpu", "--quick"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(lines) == 12 and all(line.startswith("ok") for line in lines), proc.stdout
    # The attention kernel streams K/V: its loads must be 16-byte vectors, not scalar gathers.
    vector, scalar = map(int, re.search(r"(\d+) vector / (\d+) scalar", lines[0]).groups())
    assert vector >= 16 and vector > scalar, lines[0]
    # An int8 or fp8 cache is written bit for bit as torch writes it: no approximate division.
    writers = [line for line in lines if "_write_kv_quantized_kernel" in line]
    assert len(writers) == 2 and all(line.endswith(" 0 approximate divisions") for line in writers), writers
