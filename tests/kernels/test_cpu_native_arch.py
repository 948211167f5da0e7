"""The CPU kernels are x86-64 code: on another machine (an arm64 host or container) nothing is
compiled with x86 flags, and the serving path falls back to torch's ops instead of failing."""
from __future__ import annotations

import platform

import pytest

from kernels import cpu_native


def test_no_x86_build_on_arm64(monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setenv("CC", str(tmp_path / "a-compiler-that-must-not-run"))
    with pytest.raises(RuntimeError, match="written for x86-64; this machine is aarch64"):
        cpu_native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []   # nothing compiled, nothing cached
