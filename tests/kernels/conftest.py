"""Kernel tests run the Triton kernels under Triton's interpreter when there is no GPU.

The interpreter is chosen when a kernel is decorated, at the import of its module, so the
variable is set here, before any test module imports a Triton kernel. It stays set for the
rest of the pytest process, which lets end-to-end tests elsewhere use kernels="triton" too.
"""

import os

import pytest
import torch

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
