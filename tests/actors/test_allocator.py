"""The CPU forward keeps freed activation memory in the process instead of returning it to the OS."""
import ctypes
import subprocess
import sys

import pytest

from actors.worker.allocator import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# Allocates and frees 16 MB through malloc, then prints the bytes glibc kept free in its heap.
PROBE = """
import ctypes, sys
from actors.worker.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
p = libc.malloc(16 << 20)
ctypes.memset(p, 1, 16 << 20)
libc.free(p)
print(libc.mallinfo2().fordblks)
"""


def kept_free_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_glibc_accepts_the_settings():
    assert keep_freed_memory() is True


def test_freed_activation_stays_in_the_heap():
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc older than 2.33")
    assert kept_free_bytes("default") < 16 << 20     # served by mmap, unmapped on free
    assert kept_free_bytes("tuned") >= 16 << 20      # kept for the next step


def test_model_runner_applies_it(monkeypatch):
    from actors.worker import model_runner

    calls = []
    monkeypatch.setattr(model_runner, "keep_freed_memory", lambda: calls.append(1) or True)
    with pytest.raises(Exception):
        model_runner.ModelRunner("/nonexistent/model", num_threads=1)
    assert calls == [1]
