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


def _greedy(runner, prompts) -> list[list[int]]:
    """NUM_NEW greedy tokens a prompt, prompts in CHUNK-token prefill chunks mixed with the others' decodes."""
    from actors.worker.forward_batch import ForwardBatch, SequenceInput

    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    # Blocks handed out back to front, so tables are not the identity; block 0 is never handed out.
    free = list(range(1, runner.num_blocks))
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
    return [t[len(p):] for t, p in zip(tokens, prompts)]


@pytest.mark.slow
def test_triton_kernels_give_transformers_greedy_tokens(tiny_llama):
    from actors.worker.model_runner import ModelRunner

    folder, prompts, expected = tiny_llama
    runner = ModelRunner(folder, dtype="float32", kernels="triton", block_size=BLOCK_SIZE, num_blocks=32,
                         device=DEVICE)
    assert runner.ops.backend == "triton"
    assert _greedy(runner, prompts) == expected


@pytest.mark.slow
def test_decode_steps_padded_to_a_graph_size_give_the_eager_logits(tiny_llama):
    """A decode batch in the static buffers, padded up to a captured size (replayed from a CUDA graph on a
    GPU, run eagerly on the padded buffers under the interpreter), gives the eager step's logits, and its
    padding rows write no KV: block 0, in no table, stays zero."""
    from actors.worker.decode_graphs import DecodeGraphs
    from actors.worker.forward_batch import ForwardBatch, SequenceInput, flatten
    from actors.worker.model_runner import ModelRunner

    folder, prompts, _ = tiny_llama
    runner = ModelRunner(folder, dtype="float32", kernels="triton", block_size=BLOCK_SIZE, num_blocks=32,
                         device=DEVICE)
    graphs = DecodeGraphs(runner.model, runner.kv_caches, max_batch=5, max_seq_len=runner.num_blocks * BLOCK_SIZE,
                          block_size=BLOCK_SIZE, capture=DEVICE == "cuda")
    assert graphs.sizes == [1, 2, 4, 5]
    assert sorted(graphs.graphs) == ([1, 2, 4, 5] if DEVICE == "cuda" else [])
    # Five sequences: the three prompts, and the first two again in blocks of their own.
    seqs = [list(p) for p in prompts + prompts[:2]]   # 1, 6, 19, 1 and 6 tokens
    tables = [[31, 7], [30, 8, 12], [29, 20, 3], [28], [27, 26]]
    runner.execute(ForwardBatch([SequenceInput(s, 0, t) for s, t in zip(seqs, tables)]))
    # Batches of 5, 3 (padded to 4, its last row left over from the 5), 1, 2 and 3: every size, and rows
    # that a larger batch used going back to padding.
    for step, members in enumerate([(0, 1, 2, 3, 4), (0, 1, 2), (1,), (2, 0), (4, 3, 1)]):
        batch = ForwardBatch([SequenceInput([5 + step + i], len(seqs[i]), tables[i]) for i in members])
        flat = flatten(batch, BLOCK_SIZE, runner.num_blocks, runner.model_config.vocab_size)
        assert graphs.fits(flat, runner.kv_caches)
        eager = runner.forward(flat, runner.kv_caches)
        padded = graphs.run(flat)   # writes the same tokens' K/V again, then attends
        torch.testing.assert_close(padded, eager, atol=1e-4, rtol=0)
        size = next(s for s in graphs.sizes if s >= len(members))
        assert (graphs.slot_mapping[len(members):size] == -1).all() and (graphs.seq_lens[len(members):size] == 1).all()
        for i in members:
            seqs[i].append(5 + step + i)
    k0, v0 = runner.kv_caches[0][0][0], runner.kv_caches[0][1][0]
    assert not k0.any() and not v0.any()
    prefill = flatten(ForwardBatch([SequenceInput([1, 2], 0, [4])]), BLOCK_SIZE, runner.num_blocks, 128)
    assert not graphs.fits(prefill, runner.kv_caches)
    assert not graphs.fits(flat, runner.kv_caches[:1])   # a layer-skip draft's caches run eagerly


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_runner_with_cuda_graphs_gives_transformers_greedy_tokens(tiny_llama):
    from actors.worker.model_runner import ModelRunner

    folder, prompts, expected = tiny_llama
    runner = ModelRunner(folder, dtype="float32", kernels="triton", block_size=BLOCK_SIZE, num_blocks=32,
                         device=DEVICE, cuda_graph_batch=8)
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4, 8]
    replays = []
    run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda flat: replays.append(flat.input_ids.shape[0]) or run(flat)
    assert _greedy(runner, prompts) == expected
    assert replays   # the decodes after the prompts went through the graphs


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
