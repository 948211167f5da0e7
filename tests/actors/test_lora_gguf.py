"""A LoRA adapter on a quantized GGUF base served packed (Q8_0 and Q4_1 blocks on the CPU kernels): the
adapter's delta is added to the quantized projection's output, so its logits stay within the
quantization's own error of the same GGUF dequantized to float32 with the same adapter (the packed
path also rounds activations to int8), while the adapter moves them far more than that.

The stated tolerance: the mean |difference| of the logits over their standard deviation is under 8%,
and at most 1.5x what the base model alone shows between the two (measured on these models: 3-4% with
the adapter and without); the adapter moves some logits by over 5 standard deviations (checked: over 2)."""
from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.lora_adapter import read_adapter
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native
from kernels.quant_linear import QuantWeight
from tests.actors.lora_adapters import make_adapter
from tests.actors.test_loader_gguf import hf_folder_to_gguf

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no CPU C kernels here")
TOLERANCE = 0.08


def _logits(runner: ModelRunner, adapter) -> torch.Tensor:
    prompts = [list(range(3, 40)), [7, 8, 9, 300, 5]]
    return runner.execute(ForwardBatch([SequenceInput(prompts[0], 0, [0, 1, 2, 3, 4], 37, adapter=adapter),
                                        SequenceInput(prompts[1], 0, [5], 5)]))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_adapter_on_packed_gguf_within_tolerance_of_dequantized(arch, qtype, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(arch)
    path = hf_folder_to_gguf(folder, str(tmp_path / "model.gguf"), lambda name: qtype)
    packed, plain = (ModelRunner(path, dtype="float32", kernels="cpu", block_size=8, num_blocks=32, num_threads=1,
                                 quantization=q, max_loras=1, max_lora_rank=16) for q in ("auto", "none"))
    assert isinstance(packed.model.layers[0].qkv_weight, QuantWeight)
    adapter = read_adapter("all", make_adapter(folder, str(tmp_path / "lora"), "all"), packed.model_config, 16)
    want, got = _logits(plain, adapter), _logits(packed, adapter)
    base, packed_base = _logits(plain, None), _logits(packed, None)
    spread = want.std()
    error = (got - want).abs().mean() / spread
    assert error < TOLERANCE and error <= 1.5 * (packed_base - base).abs().mean() / spread
    # The adapter's rows moved by far more than that; the base model's rows (the second prompt) not at all.
    assert (want[:37] - base[:37]).abs().max() / spread > 2
    assert torch.equal(want[37:], base[37:])
