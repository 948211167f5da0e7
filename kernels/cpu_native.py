"""The CPU serving path's C kernels (cpu_gemm.c, paged_attention_cpu.c, packed_gemm.c, cpu_layer_ops.c,
quant_gemm.c, int8_gemm.c, int8_amx.c, int8_rows.c, quant_amx.c, token_mask.c, decode_layers.c,
shm_all_reduce.c, lora_sgmv.c):
built once, loaded once.

The sources are compiled together with the system's C compiler on first use, for this CPU
(-march=native, else AVX2 + FMA), into a shared library cached under ~/.cache/matinee, named by
the sources, the flags and the CPU's identity: an edit rebuilds it, and a cache shared by two
kinds of CPU never loads one built for the other. Without a compiler, or on a CPU without AVX2
and FMA, `library()` is None and every caller keeps its pure-torch path: the kernels only make
the CPU faster, never change what it computes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import structlog
import torch

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemm.c", "paged_attention_cpu.c", "packed_gemm.c",
                                                             "cpu_layer_ops.c", "quant_gemm.c", "int8_gemm.c",
                                                             "int8_amx.c", "int8_rows.c", "quant_amx.c", "token_mask.c", "decode_layers.c",
                                                             "shm_all_reduce.c", "lora_sgmv.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx.h", "bf16.h", "e4m3.h", "quant_layout.h", "vexp.h")]   # included by the sources: part of the library's name
NATIVE = ["-march=native"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]   # every AVX2 + FMA CPU has F16C (quant_gemm.c reads float16 scales)
X86 = ("x86_64", "amd64", "i386", "i686")   # the sources use x86 vector intrinsics (immintrin.h)
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "matinee" / "kernels"


def _cpu_identity() -> bytes:
    """What -march=native compiles for: the "flags" and "model name" lines of /proc/cpuinfo, where there is one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.split(":")[0].strip() in ("flags", "model name")]
    return "\n".join(sorted(set(wanted)) or [platform.machine(), platform.processor(),
                                                torch.backends.cpu.get_cpu_capability()]).encode()


def _target(directory: Path, isa: list[str]) -> Path:
    parts = [s.read_bytes() for s in SOURCES + HEADERS] + [" ".join(_FLAGS + isa).encode(), _cpu_identity()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return directory / f"matinee-cpu-{digest[:16]}.so"


def build(directory: Path | None = None, flags: list[str] | None = None) -> Path:
    """Compiles the kernels (unless already cached) and returns the shared library's path.

    `flags` are the instruction-set flags (say AVX2, to test that variant); by default this CPU's
    (NATIVE), or AVX2 where the compiler does not take them. Raises RuntimeError when there is
    no C compiler or it fails."""
    directory = directory or cache_dir()
    if platform.machine().lower() not in X86:   # an arm64 host: no x86 flags, no build; torch's ops serve
        raise RuntimeError(f"the CPU C kernels are written for x86-64; this machine is {platform.machine()}")
    choices = [NATIVE, AVX2] if flags is None else [flags]
    for isa in choices:   # a cached build needs no compiler (a container may have none)
        if _target(directory, isa).exists():
            return _target(directory, isa)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    errors = []
    for isa in choices:
        try:
            return _compile(compiler, isa, _target(directory, isa))
        except RuntimeError as e:
            errors.append(str(e))
            if isa is not choices[-1]:
                structlog.get_logger().warning("CPU C kernels: falling back to AVX2", error=str(e))
    raise RuntimeError("; ".join(errors))


def _compile(compiler: str, isa: list[str], target: Path) -> Path:
    # Compile beside the target and rename: a process building at the same time never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *_FLAGS, *isa, *map(str, SOURCES), "-o", tmp, "-lm"],
                                  capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C compiler {compiler}: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} {' '.join(isa)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.matinee_sgemm_nt.restype = None
    lib.matinee_sgemm_nt.argtypes = [ptr] * 3 + [long_] * 3 + [int_]
    lib.matinee_paged_attention.restype = int_
    lib.matinee_paged_attention.argtypes = [ptr] * 9 + [long_] * 8 + [ctypes.c_float] + [int_] * 3 + [long_]
    lib.matinee_attention_prefetch_to.restype = int_
    lib.matinee_attention_prefetch_to.argtypes = [int_]
    lib.matinee_packed_gemm.restype = int_
    lib.matinee_packed_gemm.argtypes = [ptr, int_, ptr, int_, ptr, ptr, int_] + [long_] * 3 + [int_] * 2
    lib.matinee_packed_dot.restype = int_
    lib.matinee_packed_dot.argtypes = []
    lib.matinee_packed_width.restype = int_
    lib.matinee_packed_width.argtypes = []
    lib.matinee_quant_gemm.restype = int_
    lib.matinee_quant_gemm.argtypes = [ptr, int_, int_, ptr, ptr, ptr, int_] + [long_] * 3 + [int_]
    lib.matinee_quant_rows.restype = int_
    lib.matinee_quant_rows.argtypes = [int_, ptr, long_, long_, ptr, long_, ptr, int_]
    lib.matinee_quant_width.restype = int_
    lib.matinee_quant_width.argtypes = []
    lib.matinee_int8_gemm.restype = int_
    lib.matinee_int8_gemm.argtypes = [ptr] * 7 + [int_] + [long_] * 3 + [int_]
    lib.matinee_int8_vnni.restype = int_
    lib.matinee_int8_vnni.argtypes = []
    lib.matinee_int8_amx.restype = int_
    lib.matinee_int8_amx.argtypes = [ptr] * 6 + [int_] + [long_] * 3 + [int_]
    lib.matinee_quantize_rows.restype = int_
    lib.matinee_quantize_rows.argtypes = [ptr, int_, ptr, ptr, long_, long_, int_]
    lib.matinee_quant_amx.restype = int_
    lib.matinee_quant_amx.argtypes = [ptr, int_, ptr, ptr, ptr] + [long_] * 3 + [int_]
    lib.matinee_lora_add.restype = int_
    lib.matinee_lora_add.argtypes = [ptr, long_, ptr, long_, int_, ptr, ptr, int_] + [long_] * 3 + [ptr, long_] * 2 + [int_]
    lib.matinee_apply_token_bitmask.restype = None
    lib.matinee_apply_token_bitmask.argtypes = [ptr, long_, long_, ptr, long_, ptr, long_]
    for dtype in ("f32", "bf16"):   # cpu_layer_ops.c
        for name, restype, args in (("rms_norm", None, [ptr] * 5 + [long_] * 2 + [ctypes.c_float, int_]),
                                    ("rope", int_, [ptr] * 4 + [long_] * 7 + [int_]),
                                    ("write_kv", int_, [ptr] * 5 + [long_] * 5 + [int_]),
                                    ("silu_and_mul", None, [ptr] * 2 + [long_] * 2 + [int_])):
            fn = getattr(lib, f"matinee_{name}_{dtype}")
            fn.restype, fn.argtypes = restype, args
        fn = getattr(lib, f"matinee_write_kv_quant_{dtype}")
        fn.restype, fn.argtypes = int_, [ptr] * 7 + [long_] * 7 + [int_]
    from kernels import decode_layers, shm_all_reduce   # their argument structs live beside their Python side
    decode_layers.declare(lib)
    shm_all_reduce.declare(lib)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` (from build()) with its functions declared."""
    lib = _declare(ctypes.CDLL(str(path)))
    lib.path = path
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run (logged once)."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            structlog.get_logger().info("CPU C kernels off: no AVX2", cpu_capability=capability)
            return None
        try:
            # torch has loaded its OpenMP runtime already; the library's libgomp.so.1 resolves to
            # it, so both share one thread pool. ctypes releases the GIL during each call.
            _library = load(build())
        except (OSError, RuntimeError) as e:
            structlog.get_logger().warning("CPU C kernels unavailable; using torch's ops", error=str(e))
            return None
        from kernels import paged_attention_cpu   # measures where its prefetches go, once per machine
        paged_attention_cpu.choose_prefetch(_library)
        return _library


def read_measurements(path: Path) -> dict:
    """Timings kept beside the built library (its name is its digest), or {} where there are none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def keep_measurements(path: Path, known: dict) -> None:
    """Written beside and renamed, so a reader never sees half a file; a read-only cache only costs
    measuring again at the next start."""
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        structlog.get_logger().warning("CPU kernels: cannot keep the measurements", path=str(path), error=str(e))


# Other work's share of the CPUs above which a measurement is used but not kept: timed beside a package
# install, the AMX kernels measured 10-50x slower at some row counts and the choices they made were kept
# for every later start.
BUSY_SHARE = 0.25
# Timings taken beside other work serve, for this long, every process that starts meanwhile (engines
# started together must agree: two that chose different dtypes could not share KV), then the next
# start measures again.
PROVISIONAL_S = 300.0


def kept_measurement(suffix: str, name: str, measure, lib: ctypes.CDLL | None = None) -> dict:
    """The timings `name` from the file beside the built library (whose name is its digest; `lib`, by
    default the loaded one) with this suffix; where they are not there yet, `measure()` gives them and they
    are kept for the next start, unless other work took more than BUSY_SHARE of the CPUs meanwhile: then
    they are kept apart, provisionally, serving only the processes that start in the next PROVISIONAL_S
    seconds, and a start after that measures again. Processes measure one at a time (an flock in the
    cache folder), so engines started together take the first one's timings rather than each timing its
    kernels beside the others' (and choosing differently)."""
    path = (lib or library()).path.with_suffix(suffix)
    known = read_measurements(path)
    if name not in known:
        with _one_at_a_time(path.parent):
            known = read_measurements(path)   # kept by another process while this one waited
            if name in known:
                return known[name]
            provisional = path.with_suffix(path.suffix + ".provisional")
            recent = _recent_measurements(provisional)
            if name in recent:
                return recent[name]
            timings, share = measured_alone(measure)
            if share > BUSY_SHARE:
                structlog.get_logger().warning("CPU kernels: measured beside other work, kept provisionally",
                                               measurement=name, path=path.name, others_share=round(share, 2),
                                               for_s=PROVISIONAL_S)
                keep_measurements(provisional, recent | {name: timings})
                return timings
            known = read_measurements(path) | {name: timings}   # re-read: another process may have added some
            keep_measurements(path, known)
    return known[name]


def _recent_measurements(path: Path) -> dict:
    """The provisional timings at `path` while they are recent, else {}."""
    try:
        if time.time() - path.stat().st_mtime > PROVISIONAL_S:
            return {}
    except OSError:
        return {}
    return read_measurements(path)


class _MeasuringLock:
    """Held by one process of the machine at a time (an flock on a file in the cache folder), and
    re-entered freely by its holder, whose measurement may run code that measures in turn. Where the
    file cannot be opened (a read-only cache), the process measures without it."""

    def __init__(self) -> None:
        self._held = threading.RLock()
        self._depth = 0
        self._fd: int | None = None

    @contextlib.contextmanager
    def __call__(self, folder: Path):
        with self._held:
            if self._depth == 0:
                self._fd = _flock(folder / "measuring.lock")
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0 and self._fd is not None:
                    os.close(self._fd)   # closing it releases the flock
                    self._fd = None


def _flock(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


_one_at_a_time = _MeasuringLock()


def measured_alone(measure):
    """(measure(), the share of all CPUs' time that went to other processes or the hypervisor while it ran),
    from /proc/stat; the share is 0 where that cannot tell."""
    before, own = _cpu_seconds(), time.process_time()
    result = measure()
    after, own = _cpu_seconds(), time.process_time() - own
    if before is None or after is None or after[1] <= before[1]:
        return result, 0.0
    others = (after[0] - before[0]) - own
    return result, max(others, 0.0) / (after[1] - before[1])


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, all) CPU seconds of every CPU since boot: /proc/stat's first line, busy being all but idle and
    iowait (steal counts: time the hypervisor gave to others), or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    hz, total = os.sysconf("SC_CLK_TCK"), sum(fields)
    return (total - fields[3] - fields[4]) / hz, total / hz


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs lists (32 MiB where it lists none): what a measurement of memory-bound
    work must exceed to time memory and not the cache."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def best_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Best-of milliseconds of each of `runs` (name -> a call), over `repeats` rounds after a warm-up one; the
    runs alternate within a round, so a neighbour's load on the cores slows them all alike."""
    best = dict.fromkeys(runs, float("inf"))
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(t * 1e3, 4) for name, t in best.items()}


def best_ms_at_rows(rows, runs_at, repeats: int) -> dict[str, float]:
    """best_ms of every run at every row count at once, `{name}_{rows}`: runs_at(rows) gives a row count's runs
    (name -> a call). Each round passes through all of them, so other work that takes the cores for part of a
    probe slows some rounds of every entry rather than every round of a few. (Timed a row count at a time, an
    engine's start once kept 5-13 ms for calls of 0.1-0.7 ms at a run of row counts, and the shape's choice
    with them.)"""
    return best_ms({f"{name}_{r}": run for r in rows for name, run in runs_at(r).items()}, repeats)


def projection(x: torch.Tensor, weight, bias: torch.Tensor | None, lib, what: str, scratch: str, launch) -> torch.Tensor:
    """x[M, K] (bf16 or float32 CPU rows) @ weight.T (+ bias) -> [M, N] in x's dtype, through a kernel of
    this library that reads a weight prepared at load (`weight` has out_features and in_features).
    `launch(lib, x, bias, out, bf16)` calls the kernel and returns its status: non-zero when it had no
    memory for its `scratch` copy of x. `lib` defaults to the loaded library (a test passes another)."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the CPU C kernels are not available")
    if x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        raise ValueError(f"the {what} takes bf16 or float32 CPU rows, not {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"{what} shapes do not match: {tuple(x.shape)} @ {tuple(weight.shape)}.T")
    x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    if out.numel() and launch(lib, x, bias, out, int(x.dtype == torch.bfloat16)) != 0:
        raise MemoryError(f"{what}: no memory for the {scratch} copy of x")
    return out


def available() -> bool:
    return library() is not None


if __name__ == "__main__":   # `python -m kernels.cpu_native`: build ahead of time (the Docker image does)
    print(build())
