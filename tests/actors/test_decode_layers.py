"""A decode step's layers in one C call (kernels/decode_layers.c) give the layer loop's logits bit for
bit: GGUF weights (the default model's Q4_1/Q8_0 mix, Q8_0 alone, a K-quant mix with two types in one
projection) and packed bf16 ones (either kernel path), float32 and
bf16 activations, biases (Qwen2), per-head norms (Qwen3, packed bf16), int8 and fp8 KV caches, decodes beside short
verification runs; and they fail as the loop fails, with the loop's errors."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from actors.worker.forward_batch import ForwardBatch, SequenceInput, flatten
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native, decode_layers, packed_linear, quant_amx
from kernels.packed_linear import PackedWeight
from tests.actors.test_loader_gguf import hf_folder_to_gguf
from gguf.constants import GGMLQuantizationType as Q

from tests.actors.test_quantized_gguf import MIXES, _k_mix

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no CPU C kernels here")


def _runner(path, dtype, kv_cache_dtype="auto"):
    return ModelRunner(path, dtype=dtype, kernels="cpu", block_size=8, num_blocks=48, num_threads=2,
                       quantization="auto", kv_cache_dtype=kv_cache_dtype)


def _looping(runner: ModelRunner) -> ModelRunner:
    """The same runner with the C layer loop taken out of its ops table."""
    runner.model.ops = replace(runner.model.ops, decode_layers=None)
    return runner


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    real = decode_layers.run

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(decode_layers, "run", counting)
    return calls


def _steps(fused: ModelRunner, looped: ModelRunner, fused_calls: list) -> None:
    """Two prompts prefilled (76 rows), then 12 steps of two greedy decodes beside a 3-token verification run of
    the second prompt's continuation, one of them beside a third prompt's 13 tokens (the prefill
    attention kernel in the same call); the logits equal at every step, and every step went through
    the C loop."""
    prompts = [list(range(3, 69)), [7, 8, 9, 300, 5]]   # 76 rows: the kernels' parallel loops
    tables = [[0, 1, 2, 3, 4, 5, 6, 7, 26, 27, 28, 29], [8, 9, 10, 11, 12], [16, 17, 18, 19, 20, 21]]
    batch = ForwardBatch([SequenceInput(prompts[0], 0, tables[0], 1), SequenceInput(prompts[1], 0, tables[1], 1),
                          SequenceInput(prompts[1], 0, tables[2], 1)])
    got, want = fused.execute(batch), looped.execute(batch)
    assert torch.equal(got, want)
    assert fused_calls == [True]
    seqs = [list(p) for p in prompts + [prompts[1]]]
    for step in range(12):
        tokens = [int(got[i].argmax()) for i in (0, 1)] + [int(got[2].argmax())]
        draft = [(tokens[2] + j) % 50 for j in (1, 2)]   # a verification of 2 drafted tokens
        inputs = [SequenceInput([tokens[0]], len(seqs[0]), tables[0], 1),
                  SequenceInput([tokens[1]], len(seqs[1]), tables[1], 1),
                  SequenceInput([tokens[2]] + draft, len(seqs[2]), tables[2], 3)]
        if step == 6:   # a prompt's chunk beside the decodes
            inputs.append(SequenceInput(list(range(40, 53)), 0, [24, 25], 1))
        seqs[0].append(tokens[0]), seqs[1].append(tokens[1]), seqs[2].extend([tokens[2]] + draft)
        got, want = fused.execute(ForwardBatch(inputs)), looped.execute(ForwardBatch(inputs))
        assert torch.equal(got, want), f"step {step}"
        got = got[[0, 1, 4]]
    assert fused_calls[1:] == [True] * 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mix", ["q4_1+q8_0", "q8_0"])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_gguf_weights_give_the_loops_logits(arch, mix, dtype, tiny_model_dir, tmp_path, fused_calls):
    path = hf_folder_to_gguf(tiny_model_dir(arch), str(tmp_path / "model.gguf"), MIXES[mix])
    _steps(_runner(path, dtype), _looping(_runner(path, dtype)), fused_calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama_wide", "qwen2_wide"])
def test_a_k_quant_mix_of_types_within_one_projection(arch, dtype, tiny_model_dir, tmp_path, fused_calls):
    """A Q4_K_M-like file: q and k Q4_K beside a Q6_K v are one projection of two parts (Qwen2: each
    part with its slice of the bias), side by side in the output as the loop concatenates them."""
    path = hf_folder_to_gguf(tiny_model_dir(arch), str(tmp_path / "model.gguf"), _k_mix(Q.Q6_K))
    fused = _runner(path, dtype)
    assert [p.name for p in fused.model.layers[0].qkv_weight.parts] == ["Q4_K", "Q6_K"]
    _steps(fused, _looping(_runner(path, dtype)), fused_calls)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_kv_cache(dtype, cache, tiny_model_dir, tmp_path, fused_calls):
    path = hf_folder_to_gguf(tiny_model_dir("qwen2"), str(tmp_path / "model.gguf"), MIXES["q4_1+q8_0"])
    _steps(_runner(path, dtype, cache), _looping(_runner(path, dtype, cache)), fused_calls)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_bf16_weights(arch, dot, tiny_model_dir, monkeypatch, fused_calls):
    """A bf16 safetensors model whose projections the packed kernel multiplies (whatever this CPU's
    measurement would choose), through its FMA or its vdpbf16ps path; Qwen3's per-head norms."""
    if dot and not cpu_native.library().matinee_packed_dot():
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("packed", dot))
    monkeypatch.setattr(packed_linear, "amx_rows", lambda n, k, dot: (None, None))
    fused = _runner(tiny_model_dir(arch), "bfloat16")
    assert all(isinstance(w, PackedWeight) and w.dot == dot
               for w in (fused.model.layers[0].qkv_weight, fused.model.layers[0].o_weight))
    assert (fused.model.layers[0].q_norm is not None) == (arch == "qwen3")
    _steps(fused, _looping(_runner(tiny_model_dir(arch), "bfloat16")), fused_calls)


def test_a_replaced_op_runs_the_loop(tiny_model_dir, tmp_path, fused_calls):
    """A table with another linear (a test's torch reference) never takes the C loop, which would not call it."""
    path = hf_folder_to_gguf(tiny_model_dir("qwen2"), str(tmp_path / "model.gguf"), MIXES["q8_0"])
    runner = _runner(path, "float32")
    seen = []
    linear = runner.model.ops.linear
    runner.model.ops = replace(runner.model.ops, linear=lambda *a: seen.append(1) or linear(*a))
    runner.execute(ForwardBatch([SequenceInput([5, 6, 7], 0, [0, 1], 1)]))
    seen.clear()
    runner.execute(ForwardBatch([SequenceInput([8], 3, [0, 1], 1)]))
    assert len(seen) == 4 * runner.model_config.num_layers + 1
    assert True not in fused_calls


@pytest.mark.parametrize("bad", ["slot", "block", "position"])
def test_bad_metadata_fails_as_the_loop_fails(bad, tiny_model_dir, tmp_path):
    path = hf_folder_to_gguf(tiny_model_dir("llama_tied"), str(tmp_path / "model.gguf"), MIXES["q8_0"])
    runners = [_runner(path, "float32"), _looping(_runner(path, "float32"))]
    for runner in runners:
        runner.execute(ForwardBatch([SequenceInput([5, 6, 7], 0, [0, 1], 1)]))
    errors = []
    for runner in runners:
        model = runner.model
        flat = flatten(ForwardBatch([SequenceInput([8], 3, [0, 1], 1)]), runner.block_size, runner.kv_caches[0][0].shape[0],
                       runner.model_config.vocab_size)
        if bad == "slot":
            flat.slot_mapping[0] = runner.kv_caches[0][0].shape[0] * runner.block_size
        elif bad == "block":
            flat.block_tables[0, 0] = runner.kv_caches[0][0].shape[0]
        else:
            flat.positions[0] = model.cos_sin_cache.shape[0]
        with pytest.raises((IndexError, ValueError)) as caught:
            runner.forward(flat, runner.kv_caches)
        errors.append((type(caught.value), str(caught.value).split(":")[0]))
    assert errors[0] == errors[1]


@pytest.mark.skipif(not quant_amx.available(), reason="no AMX on this CPU")
def test_amx_projections_in_the_c_loop(tiny_model_dir, tmp_path, fused_calls):
    """With every GGUF projection on AMX from one row on, the C loop's logits are the loop's bit for bit,
    and differ from the int8 kernel's: the C loop did take quant_amx.c."""
    path = hf_folder_to_gguf(tiny_model_dir("llama_tied"), str(tmp_path / "model.gguf"), MIXES["q4_1+q8_0"])
    amx, looped, int8 = (_runner(path, "bfloat16") for _ in range(3))
    for runner, rows in ((amx, 1), (looped, 1), (int8, None)):
        for layer in runner.model.layers:
            for weight in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
                weight.amx_from = rows
    _steps(amx, _looping(looped), fused_calls)
    decode = ForwardBatch([SequenceInput([5, 6, 7], 0, [0, 1], 1)])
    amx.execute(decode), int8.execute(decode)   # the prompt, then one decode step on each
    step = ForwardBatch([SequenceInput([9], 3, [0, 1], 1)])
    assert not torch.equal(amx.execute(step), int8.execute(step))
    assert fused_calls[-1] is True


@pytest.mark.skipif(not quant_amx.available(), reason="no AMX on this CPU")
def test_packed_bf16_weights_on_amx_in_the_c_loop(tiny_model_dir, monkeypatch, fused_calls):
    """Packed bf16 projections on AMX from one row on: the C loop is handed each weight's threshold, and its logits
    are the loop's bit for bit, whose projections went to quant_amx.c. (AMX and the packed kernel both sum exact
    bf16 products in float32 and round each output to bf16, so their logits agree too: the plan is checked.)"""
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("both", False))
    monkeypatch.setattr(packed_linear, "amx_rows", lambda n, k, dot: (1, None))
    fused, looped = (_runner(tiny_model_dir("llama_tied"), "bfloat16") for _ in range(2))
    weight = fused.model.layers[0].gate_up_weight
    assert isinstance(weight, PackedWeight) and weight.amx_from == 1 and weight.plain is None   # no copy for torch
    on_amx = []
    product = quant_amx.product
    monkeypatch.setattr(quant_amx, "product", lambda x, w, qtype, bias=None: on_amx.append(qtype)
                        or product(x, w, qtype, bias))
    _steps(fused, _looping(looped), fused_calls)
    assert set(on_amx) == {quant_amx.BF16P}   # the loop's projections, each call
    plan = decode_layers._plans[fused.model]
    parts = [getattr(layer, name).part[0] for layer in plan.layers for name in ("qkv", "o", "gate_up", "down")]
    assert {(p.kind, p.amx_from) for p in parts} == {(decode_layers.PACKED, 1)}


def test_each_layer_is_announced_once_its_kv_is_in_the_cache(tiny_model_dir, tmp_path, fused_calls):
    """What a handoff sent layer by layer relies on: each layer is announced in order, once its KV is
    written and before the next layer's is, by the C loop (a prompt's and a decode's steps) as by the
    layer loop."""
    runner = _runner(hf_folder_to_gguf(tiny_model_dir("llama"), str(tmp_path / "model.gguf"), MIXES["q8_0"]),
                     "float32")
    n = runner.model_config.num_layers
    seen = []

    def announcing(block):
        before = [layer[0][block].clone() for layer in runner.kv_caches]   # each layer's K of that block

        def written(i):
            assert not torch.equal(runner.kv_caches[i][0][block], before[i])
            assert i + 1 == n or torch.equal(runner.kv_caches[i + 1][0][block], before[i + 1])
            seen.append(i)
        return written
    runner.layer_written = announcing(0)
    runner.execute(ForwardBatch([SequenceInput(list(range(5, 17)), 0, [0, 1], 1)]))   # a 12-token prompt
    assert seen == list(range(n)) and fused_calls == [True]
    for position, loop in ((12, False), (13, True)):   # decodes into block 1, in the C call, then the loop
        seen.clear()
        if loop:
            _looping(runner)
        runner.layer_written = announcing(1)
        runner.execute(ForwardBatch([SequenceInput([8], position, [0, 1], 1)]))
        assert seen == list(range(n)) and fused_calls == [True, True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_steps_with_lora_adapters_stay_in_the_c_loop(arch, dtype, tiny_model_dir, tmp_path, fused_calls):
    """Three adapters (all seven projections rank 8, attention rank 4 rsLoRA, MLP and k rank 16) and a base-model
    sequence in one batch: the prompts' step and eight decode steps go through the C loop, whose LoRA hook calls
    lora_sgmv.c as the layer loop does, so the logits are the loop's bit for bit; and the adapters change them."""
    from actors.worker.lora_adapter import read_adapter
    from tests.actors.lora_adapters import make_adapter

    base = tiny_model_dir(arch)
    path = hf_folder_to_gguf(base, str(tmp_path / "model.gguf"), MIXES["q4_1+q8_0"])
    fused, looped, plain = (ModelRunner(path, dtype=dtype, kernels="cpu", block_size=8, num_blocks=48, num_threads=2,
                                        quantization="auto", max_loras=3, max_lora_rank=16) for _ in range(3))
    _looping(looped)
    adapters = [read_adapter(name, make_adapter(base, str(tmp_path / name), name, seed=i), fused.model_config, 16)
                for i, name in enumerate(("all", "attn", "mlp"))] + [None]
    tables = [[0, 1, 2, 3, 4], [8, 9, 10, 11, 12], [16, 17, 18, 19, 20], [24, 25, 26, 27, 28]]
    prompts = [list(range(3, 20)), [7, 8, 9, 300, 5], list(range(40, 62)), [11, 12, 13]]
    batch = ForwardBatch([SequenceInput(p, 0, t, 1, adapter=a) for p, t, a in zip(prompts, tables, adapters)])
    got, want = fused.execute(batch), looped.execute(batch)
    assert torch.equal(got, want)
    lengths = [len(p) for p in prompts]
    for step in range(8):
        tokens = [int(row.argmax()) for row in got]
        step_batch = ForwardBatch([SequenceInput([tok], n, t, 1, adapter=a)
                                   for tok, n, t, a in zip(tokens, lengths, tables, adapters)])
        lengths = [n + 1 for n in lengths]
        got, want = fused.execute(step_batch), looped.execute(step_batch)
        assert torch.equal(got, want), f"step {step}"
    assert fused_calls == [True] * 9
    without = ForwardBatch([SequenceInput(p, 0, t, 1) for p, t in zip(prompts, tables)])
    bare = plain.execute(without)
    assert all(not torch.equal(bare[i], fused.execute(batch)[i]) for i in range(3)) and torch.equal(
        bare[3], fused.execute(batch)[3])
