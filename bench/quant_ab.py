"""quant_gemm.c against itself at another commit: both builds multiply the same packed weights, their calls
alternated in one process, so a kernel change is measured against the code before it on a VM whose memory rate
moves 20-40% from one minute to the next (two runs one after the other measure the minute, not the change).

The weights are bench.kquant_cpu's: Llama-3.2-1B's seven projections over LAYERS layers (random blocks, so each
call streams its weight from memory as a decode step does), packed by this tree's kernels/quant_linear.py: both
builds must read that layout. Each build is quant_gemm.c alone, compiled as kernels/cpu_native.py compiles the
library. Prints, per type and row count, each build's best and median ms per pass and this tree's time over the
other's; asserts nothing about speed.

    python -m bench.quant_ab --against REV [--types Q4_K,Q6_K] [--rows 1,4,64] [--repeats 15] [--layers 2] [--avx2]
"""
from __future__ import annotations

import argparse
import ctypes
import io
import json
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as Q

from bench.kquant_cpu import HIDDEN, INTER, PROJECTIONS
from kernels import cpu_native, quant_linear
from kernels.quant_linear import QuantTensor

REPO = Path(__file__).resolve().parents[1]


def compile_gemm(kernels: Path, out: Path, isa: list[str] = cpu_native.NATIVE) -> ctypes.CDLL:
    """quant_gemm.c of the kernels folder `kernels`, built with the library's flags for `isa` (this CPU's, or
    cpu_native.AVX2's), with its entry declared."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc or gcc) on PATH")
    done = subprocess.run([compiler, *cpu_native._FLAGS, *isa, f"-I{kernels}",
                           str(kernels / "quant_gemm.c"), "-o", str(out), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{kernels / 'quant_gemm.c'} did not compile: {done.stderr.strip()[-500:]}")
    lib = ctypes.CDLL(str(out))
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.matinee_quant_gemm.restype = i
    lib.matinee_quant_gemm.argtypes = [p, i, i, p, p, p, i, n, n, n, i]
    return lib


def kernels_at(rev: str, into: Path) -> Path:
    """The kernels folder as commit `rev` has it, written under `into`."""
    done = subprocess.run(["git", "-C", str(REPO), "archive", rev, "kernels"], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"git archive {rev} kernels: {done.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):   # Python 3.11.4 on
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into / "kernels"


def one_pass(lib: ctypes.CDLL, weights: list, xs: dict, out: torch.Tensor, threads: int) -> float:
    start = time.perf_counter()
    for w in weights:
        x = xs[w.in_features]
        status = lib.matinee_quant_gemm(x.data_ptr(), 0, int(w.qtype), w.packed.data_ptr(), None, out.data_ptr(), 0,
                                        x.shape[0], w.out_features, w.in_features, threads)
        if status:
            raise SystemExit(f"matinee_quant_gemm returned {status} for {Q(w.qtype).name}")
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the commit whose quant_gemm.c this tree's is timed against")
    parser.add_argument("--types", default="Q4_0,Q4_K,Q6_K", help="GGUF types, comma-separated")
    parser.add_argument("--rows", default="1,4,64", help="row counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="alternated passes per build")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--avx2", action="store_true", help="both builds for AVX2 + FMA (as a CPU without AVX-512 "
                        "runs them), not -march=native")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON list at the end")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in PROJECTIONS]
    results = []
    with tempfile.TemporaryDirectory(prefix="quant-ab-") as tmp:
        isa = cpu_native.AVX2 if args.avx2 else cpu_native.NATIVE
        builds = {args.against: compile_gemm(kernels_at(args.against, Path(tmp)), Path(tmp) / "against.so", isa),
                  "tree": compile_gemm(REPO / "kernels", Path(tmp) / "tree.so", isa)}
        for name in args.types.split(","):
            qtype = Q[name]
            weights = [quant_linear.pack(QuantTensor(int(qtype), quant_linear.random_blocks(qtype, n, k, seed), k),
                                         torch.float32) for seed, (n, k) in enumerate(shapes)]
            for m in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(m, k, generator=gen) for k in (HIDDEN, INTER)}
                out = torch.empty(m * max(n for n, _ in shapes))
                times = {label: [] for label in builds}
                for _ in range(args.repeats + 1):   # the first pass of each warms up
                    for label, lib in builds.items():
                        times[label].append(one_pass(lib, weights, xs, out, args.threads))
                row = {"type": name, "rows": m}
                for label, ts in times.items():
                    row[label] = {"best_ms": round(min(ts[1:]), 3), "median_ms": round(statistics.median(ts[1:]), 3)}
                row["tree_over_against"] = round(row["tree"]["median_ms"] / row[args.against]["median_ms"], 3)
                results.append(row)
                print(f"{name:>5} rows {m:3d}: {args.against} {row[args.against]['median_ms']:8.3f} ms, this tree "
                      f"{row['tree']['median_ms']:8.3f} ms (medians): {row['tree_over_against']:.3f}x", flush=True)
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
