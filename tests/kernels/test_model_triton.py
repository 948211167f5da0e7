"""End to end: a tiny random-weight Llama run with kernels="triton" (under the interpreter on a
CPU) gives the same greedy tokens as transformers, through chunked prefill mixed with decodes."""

import pytest
import torch

from tests.kernels.conftest import DEVICE

PROMPT_LENS = (1, 6, 19)
NUM_NEW = 4
CHUNK = 8
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm weights, so a kernel ignoring them cannot pass
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, eos_token_id=None, pad_token_id=1)
            expected.append(out[0, len(p):].tolist())
    return str(folder), prompts, expected


@pytest.mark.slow
def test_triton_kernels_give_transformers_greedy_tokens(tiny_llama):
    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.model_runner import ModelRunner

    folder, prompts, expected = tiny_llama
    runner = ModelRunner(folder, dtype="float32", kernels="triton", block_size=BLOCK_SIZE, num_blocks=32,
                         device=DEVICE)
    assert runner.ops.backend == "triton"
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    # Blocks handed out back to front, so tables are not the identity.
    free = list(range(runner.num_blocks))
    tables: list[list[int]] = [[] for _ in prompts]
    while any(len(t) - len(p) < NUM_NEW for t, p in zip(tokens, prompts)):
        items, active = [], []
        for i, (t, p) in enumerate(zip(tokens, prompts)):
            if len(t) - len(p) >= NUM_NEW:
                continue
            new = t[computed[i]:computed[i] + CHUNK]
            while len(tables[i]) * BLOCK_SIZE < computed[i] + len(new):
                tables[i].append(free.pop())
            items.append(SequenceInput(new, computed[i], list(tables[i])))
            active.append(i)
        logits = runner.execute(ForwardBatch(items))
        for i, item, row in zip(active, items, logits):
            computed[i] += len(item.token_ids)
            if computed[i] == len(tokens[i]):
                tokens[i].append(int(row.argmax()))
    assert [t[len(p):] for t, p in zip(tokens, prompts)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_triton_quantized_matmuls_match_their_torch_reference(tiny_llama, quantization):
    """Weights quantized at load go through the Triton kernel, whose math (weight-only: x stays in its
    dtype) is quant_matmul.linear; a greedy token may differ only where the reference's best two tie."""
    from dataclasses import replace

    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.hf_weights import HFWeights
    from actors.worker.model_runner import ModelRunner
    from kernels import quant_matmul
    from kernels.ops import TORCH_OPS
    from kernels.quantize import Int4Weight, Int8Weight

    def weight_only(x, weight, bias=None):
        if isinstance(weight, (Int8Weight, Int4Weight)):
            return quant_matmul.linear(x, weight, bias)
        return TORCH_OPS.linear(x, weight, bias)

    folder, prompts, _ = tiny_llama
    served = ModelRunner(folder, dtype="float32", kernels="triton", block_size=BLOCK_SIZE, num_blocks=32,
                         device=DEVICE, quantization=quantization)
    reference = ModelRunner(folder, dtype="float32", kernels="torch", block_size=BLOCK_SIZE, num_blocks=32,
                            quantization=quantization)
    reference.model.ops = replace(reference.model.ops, linear=weight_only)
    reference.model.load_weights(HFWeights(folder), quantization=quantization)
    assert isinstance(served.model.layers[0].qkv_weight, Int8Weight if quantization == "int8" else Int4Weight)
    seq = list(prompts[1])
    step = ForwardBatch([SequenceInput(seq, 0, [3, 1], 1)])
    for _ in range(NUM_NEW):
        got, want = served.execute(step).cpu(), reference.execute(step)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        token = int(got[-1].argmax())
        assert float(want[-1].max() - want[-1, token]) <= 1e-4
        step = ForwardBatch([SequenceInput([token], len(seq), [3, 1], 1)])
        seq.append(token)
