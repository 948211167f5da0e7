"""Model-worker figures, each a ratio of two things run side by side in the same process.

Run from the repository root: python -m bench.worker
"""
import time

import torch

import gguf

from actors.worker.dequant import dequantize
from actors.worker.forward_batch import ForwardBatch, SequenceInput, flatten
from actors.model.gguf_file import GGUFFile
from actors.worker.model_runner import ModelRunner
from actors.model.source import default_model_path


def clock(f, n=1):
    f()
    s = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - s) / n


path = default_model_path()
lean = clock(lambda: GGUFFile(path), 3)
reader = clock(lambda: gguf.GGUFReader(path), 1)
print(f"open GGUF: lean reader {lean*1e3:.0f} ms vs gguf.GGUFReader {reader*1e3:.0f} ms ({reader/lean:.0f}x)")
f = GGUFFile(path)
items = [(f.raw(n), gguf.GGMLQuantizationType(i.qtype)) for n, i in f.tensors.items()]
ours = clock(lambda: [dequantize(r, q) for r, q in items])
theirs = clock(lambda: [gguf.quants.dequantize(r, q) for r, q in items])
print(f"dequantize all tensors: ours {ours:.2f} s vs gguf.quants {theirs:.2f} s ({theirs/ours:.1f}x)")

torch.set_num_threads(1)
a32, w32 = torch.randn(64, 576), torch.randn(3072, 576)
a16, w16 = a32.bfloat16(), w32.bfloat16()
r32 = 2 * 64 * 576 * 3072 / clock(lambda: torch.nn.functional.linear(a32, w32), 30) / 1e9
r16 = 2 * 64 * 576 * 3072 / clock(lambda: torch.nn.functional.linear(a16, w16), 30) / 1e9
print(f"matmul [64,576]x[576,3072], 1 thread: float32 {r32:.1f} GFLOP/s, bfloat16 {r16:.1f} GFLOP/s ({r16/r32:.2f}x)")

runner = ModelRunner(None, dtype="float32", kernels="torch", num_blocks=64 * 14 + 8, num_threads=1)
seqs = [SequenceInput([5], 200, list(range(i * 14, i * 14 + 14))) for i in range(64)]
batch = ForwardBatch(seqs)
prep = clock(lambda: flatten(batch, 16, runner.num_blocks, runner.model_config.vocab_size), 200)
steps = []
for _ in range(5):
    runner.execute(batch)
    steps.append(runner.last_forward_s)
step = sorted(steps)[2]
params = sum(p.numel() for layer in runner.model.layers
             for p in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight))
params += runner.model.lm_head.numel()
print(f"SmolLM2 fp32 decode, batch 64, context 200, 1 thread: forward {step*1e3:.0f} ms, "
      f"batch flattening {prep*1e3:.2f} ms ({prep/step:.2%} of the forward); "
      f"model FLOP rate / matmul rate = {2*params*64/step/1e9/r32:.2f}")
