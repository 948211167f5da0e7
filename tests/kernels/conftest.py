"""Kernel tests run the Triton kernels under Triton's interpreter when there is no GPU.

The interpreter is chosen when a kernel is decorated, at the import of its module, so the
variable is set here, before any test module imports a Triton kernel. It stays set for the
rest of the pytest process, which lets end-to-end tests elsewhere use kernels="triton" too.
"""

import os

import pytest
import torch

from kernels import cpu_native

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Make torch.empty / empty_like return NaN (floats) or a huge value (ints), so an output
    element a kernel forgets to write cannot pass for a correct one by luck."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


@pytest.fixture(scope="session")
def avx2_library(tmp_path_factory):
    """The C kernels built for AVX2 alone: the path a CPU without AVX-512 takes."""
    return cpu_native.load(cpu_native.build(tmp_path_factory.mktemp("avx2"), flags=cpu_native.AVX2))


@pytest.fixture(params=["native", "avx2"])
def each_build(request, monkeypatch):
    """Runs a test on the library the server loads (-march=native: AVX-512 where the CPU has it) and
    on its AVX2 build."""
    if request.param == "avx2":
        monkeypatch.setattr(cpu_native, "_library", request.getfixturevalue("avx2_library"))
        monkeypatch.setattr(cpu_native, "_tried", True)
