"""The bf16 (and float16) packed-weight CPU matmul (packed_gemm.c) against float64 references on odd shapes, in
both its builds (-march=native and AVX2), its layout and embedding, the per-shape choice, and models on it."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native, get_ops, packed_linear, quant_amx

HAS_TOOLCHAIN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("cc") is not None
pytestmark = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no AVX2 CPU or no C compiler")

SHAPES = [(1, 1), (31, 7), (33, 577), (100, 64)]   # (N, K): N off the 32-column blocks, K odd


@pytest.fixture(scope="module", params=["native", "native-dot", "avx2"])
def lib(request):
    """Each build of the kernels and each path of the native one (native-dot: bf16 rows through
    vdpbf16ps, where this CPU has AVX512-BF16); the native one is the library the server loads. A
    test packs its weights with `_pack(lib, w)`, which marks them for the path."""
    if request.param.startswith("native"):
        lib = cpu_native.library()
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            assert lib.matinee_packed_width() == 512   # the AVX-512 path, not a silent AVX2 fallback
        if request.param == "native-dot" and not lib.matinee_packed_dot():
            pytest.skip("this CPU has no AVX512-BF16")
    else:
        lib = request.getfixturevalue("avx2_library")
        assert lib.matinee_packed_width() == 256 and not lib.matinee_packed_dot()
    return Kernel(lib, request.param == "native-dot")


class Kernel:
    def __init__(self, lib, dot: bool) -> None:
        self.lib, self.dot = lib, dot


def _pack(kernel: Kernel, w: torch.Tensor) -> packed_linear.PackedWeight:
    packed = packed_linear.pack(w)
    packed.dot = kernel.dot
    return packed


def _flushed(t: torch.Tensor) -> torch.Tensor:
    """t with float32 subnormals as zero (vdpbf16ps reads and writes them so)."""
    f = t.float()
    return torch.where(f.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(f), f)


def _bf16(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 17, 130])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float64(lib, m, n, k, poisoned_empty):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, bias = _bf16(gen, m, k), _bf16(gen, n, k), torch.randn(n, generator=gen)
    packed = _pack(lib, w)
    expect = x.double() @ w.double().T + bias.double()
    got = packed_linear.matmul(x, packed, bias, lib=lib.lib)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # float32 sums, then one rounding to bf16: half a bf16 unit (2^-8 relative) on top.
    torch.testing.assert_close(got.double(), expect, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
    # float32 rows give float32 outputs, without that rounding (the FMA path on any weight).
    got = packed_linear.matmul(x.float(), packed, lib=lib.lib)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_output_rounds_to_nearest_even_as_torch_does(lib):
    # y = a + b (weights of 1, exact in float32), so each row shows the kernel's float32 -> bf16
    # rounding: ties, overflow to infinity, NaN and subnormals, on the vector path and the tail. The
    # vdpbf16ps path reads subnormal inputs as zero and writes a subnormal sum as zero.
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(400, generator=gen) * 2.0 ** torch.randint(-12, 12, (400,), generator=gen)).to(torch.bfloat16)
    b = (a.float() * 2.0 ** -torch.randint(7, 10, (400,), generator=gen)).to(torch.bfloat16)
    big = torch.finfo(torch.bfloat16).max
    special = torch.tensor([[float("nan"), 1.0], [float("inf"), 1.0], [-float("inf"), 2.0], [big, big],
                            [-big, -big], [1e-39, 3e-40], [0.0, -0.0]], dtype=torch.bfloat16)
    x = torch.cat([torch.stack([a, b], dim=1), special])
    w = _pack(lib, torch.ones(37, 2, dtype=torch.bfloat16))
    got = packed_linear.matmul(x, w, lib=lib.lib)
    read = _flushed(x) if lib.dot else x.float()
    total = read[:, :1] + read[:, 1:]
    want = (_flushed(total) if lib.dot else total).to(torch.bfloat16).expand(-1, 37)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if lib.dot:   # the subnormal row is the one the two paths tell apart
        assert got[-2, 0] == 0 and packed_linear.matmul(x[-2:-1].float(), w, lib=lib.lib)[0, 0] != 0


def test_a_rows_result_does_not_depend_on_the_batch_or_threads(lib):
    gen = torch.Generator().manual_seed(0)
    x, w = _bf16(gen, 37, 579), _pack(lib, _bf16(gen, 75, 579))
    whole = packed_linear.matmul(x, w, lib=lib.lib)
    for i in range(37):
        assert torch.equal(packed_linear.matmul(x[i:i + 1], w, lib=lib.lib)[0], whole[i])
    assert torch.equal(packed_linear.matmul(x[3:20], w, lib=lib.lib), whole[3:20])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed_linear.matmul(x, w, lib=lib.lib)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_round_trip_and_embedding_are_exact(n, k, dtype):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed = packed_linear.pack(w)
    assert packed.packed.shape == (-(-n // 32), k, 32) and packed.shape == (n, k) and packed.numel() == n * k
    assert packed.dtype == dtype and packed.half == (dtype == torch.float16)
    assert torch.equal(packed_linear.unpack(packed), w)
    ids = torch.randint(0, n, (3, 11), generator=gen)
    ids[0, :min(n, 11)] = torch.arange(min(n, 11))
    assert torch.equal(packed_linear.embedding(ids, packed), F.embedding(ids, w))
    with pytest.raises(IndexError):
        packed_linear.embedding(torch.tensor([n]), packed)


def test_cpu_ops_pack_bf16_weights_where_chosen(monkeypatch):
    ops = get_ops("cpu", "cpu")
    w = torch.randn(40, 24).to(torch.bfloat16)
    x = torch.randn(3, 24).to(torch.bfloat16)
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("packed", False))
    packed = ops.prepare_weight(w)
    assert isinstance(packed, packed_linear.PackedWeight) and packed.plain is None
    assert torch.equal(ops.linear(x, packed), packed_linear.matmul(x, packed))
    assert torch.equal(ops.embedding(torch.tensor([5, 39]), packed), w[[5, 39]])
    assert ops.prepare_weight(w.float()).dtype == torch.float32   # float32 keeps cpu_gemm.c and MKL
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("torch", False))
    assert ops.prepare_weight(w) is w
    assert get_ops("torch", "cpu").prepare_weight(w) is w


def test_both_layouts_send_many_rows_to_torch_and_few_to_the_kernel(monkeypatch):
    ops = get_ops("cpu", "cpu")
    w = torch.randn(40, 24).to(torch.bfloat16)
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("both", False))
    both = ops.prepare_weight(w)
    assert both.plain is w
    few, many = (torch.randn(m, 24).to(torch.bfloat16) for m in (3, packed_linear.TORCH_FROM_ROWS))
    assert torch.equal(ops.linear(few, both), packed_linear.matmul(few, both))
    assert torch.equal(ops.linear(many, both), torch.nn.functional.linear(many, w))


def test_the_choice_is_measured_once_and_kept_beside_the_library(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_native, "BUSY_SHARE", 1.0)   # kept however busy the machine (tests/kernels/test_measurements.py)
    lib = cpu_native.load(cpu_native.build(tmp_path, flags=cpu_native.AVX2))
    monkeypatch.setattr(cpu_native, "_library", lib)
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(packed_linear, "_decisions", {})
    threads = torch.get_num_threads()
    packed_linear.layout(40, 24)
    path = lib.path.with_suffix(".bf16-linear.json")
    known = json.loads(path.read_text())
    assert set(known[f"{threads} threads 40x24"]) == {"kernel_1", "torch_1", "kernel_256", "torch_256"}
    # Torch clearly faster at both sizes: plain weights; at one row only: the kernel; at 256 only: both.
    known[f"{threads} threads 8x8"] = {"kernel_1": 2.0, "torch_1": 1.0, "kernel_256": 2.0, "torch_256": 1.0}
    known[f"{threads} threads 16x8"] = {"kernel_1": 1.0, "torch_1": 2.0, "kernel_256": 2.0, "torch_256": 1.0}
    known[f"{threads} threads 24x8"] = {"kernel_1": 1.05, "torch_1": 1.0, "kernel_256": 2.0, "torch_256": 1.0}
    known[f"{threads} threads 32x8"] = {"kernel_1": 2.0, "torch_1": 1.0, "kernel_256": 1.0, "torch_256": 2.0}
    # The vdpbf16ps path where it is clearly faster at 256 rows and no slower at one; then torch is
    # weighed against it, not against the FMA path.
    dot = {"kernel_1": 1.0, "torch_1": 2.0, "kernel_256": 2.0, "torch_256": 1.5}
    known[f"{threads} threads 40x8"] = dot | {"dot_1": 1.05, "dot_256": 1.0}
    known[f"{threads} threads 48x8"] = dot | {"dot_1": 1.3, "dot_256": 1.0}    # slower at one row
    known[f"{threads} threads 56x8"] = dot | {"dot_1": 1.0, "dot_256": 1.9}    # within the margin at 256
    known[f"{threads} threads 64x8"] = dot | {"dot_1": 1.0, "dot_256": 1.7}    # torch faster than it at 256
    path.write_text(json.dumps(known))
    assert packed_linear.layout(8, 8) == ("torch", False)
    assert packed_linear.layout(16, 8) == ("both", False)
    assert packed_linear.layout(24, 8) == ("both", False)    # within the margin at one row
    assert packed_linear.layout(32, 8) == ("packed", False)
    assert packed_linear.layout(40, 8) == ("packed", True)
    assert packed_linear.layout(48, 8) == ("both", False)
    assert packed_linear.layout(56, 8) == ("both", False)
    assert packed_linear.layout(64, 8) == ("both", True)
    assert set(json.loads(path.read_text())) == set(known)   # read, not measured again


def test_the_dot_path_is_measured_where_the_cpu_has_it(monkeypatch):
    lib = cpu_native.library()
    if not lib.matinee_packed_dot():
        pytest.skip("this CPU has no AVX512-BF16")
    ms = packed_linear._measure(40, 64)
    assert set(ms) == {f"{name}_{rows}" for name in ("kernel", "torch", "dot") for rows in (1, 256)}
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("packed", True))
    weight = get_ops("cpu", "cpu").prepare_weight(torch.randn(40, 64).to(torch.bfloat16))
    assert weight.dot


def test_refuses_bad_input():
    w = packed_linear.pack(torch.randn(4, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="shapes"):
        packed_linear.matmul(torch.randn(2, 9), w)
    with pytest.raises(ValueError, match="float16"):
        packed_linear.matmul(torch.randn(2, 8, dtype=torch.float16), w)
    half = packed_linear.pack(torch.randn(4, 32).half())   # AMX's tiles read bf16 only
    with pytest.raises(ValueError, match="packed bf16"):
        quant_amx.product(torch.randn(2, 32).to(torch.bfloat16), half, quant_amx.BF16P)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 9, 130])
@pytest.mark.parametrize("n,k", SHAPES)
def test_float16_weights_match_float64(lib, m, n, k):
    """A float16 weight (columns in order, widened by F16C) by float32 rows, and by bf16 rows widened first."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).half()
    bias = torch.randn(n, generator=gen)
    packed = packed_linear.pack(w)
    assert packed.half and not packed.dot
    got = packed_linear.matmul(x, packed, bias, lib=lib.lib)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T + bias.double(), rtol=1e-5,
                               atol=1e-5 * k ** 0.5)
    xb = x.to(torch.bfloat16)
    got = packed_linear.matmul(xb, packed, lib=lib.lib)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), xb.double() @ w.double().T, rtol=2 ** -8, atol=1e-5 * k ** 0.5)


def _tiny_model(folder, arch: str, dtype: torch.dtype = torch.float32) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2)
    if arch == "llama_tied":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    else:   # untied, q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    model.to(dtype).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_bf16_model_on_packed_weights_gives_torchs_logits(arch, dot, tmp_path, monkeypatch):
    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.model_runner import ModelRunner

    if dot and not cpu_native.library().matinee_packed_dot():
        pytest.skip("this CPU has no AVX512-BF16")
    folder = _tiny_model(tmp_path, arch)
    monkeypatch.setattr(packed_linear, "layout", lambda n, k: ("packed", dot))
    batch = ForwardBatch([SequenceInput(list(range(3, 40)), 0, [0, 1, 2, 3, 4], num_logits=37),
                          SequenceInput([7, 8, 9], 0, [5], num_logits=3)])   # logits at every position
    logits = {}
    for kernels in ("cpu", "torch"):
        runner = ModelRunner(folder, dtype="bfloat16", kernels=kernels, block_size=8, num_blocks=8, num_threads=2)
        model = runner.model
        if kernels == "cpu":
            assert all(isinstance(w, packed_linear.PackedWeight) and w.dot == dot
                       for w in (model.lm_head, model.layers[0].qkv_weight, model.layers[1].down_weight))
            assert (model.embed is model.lm_head) == (arch == "llama_tied")   # one copy when tied
        logits[kernels] = runner.execute(batch)
    scale = logits["torch"].abs().max()
    # Both round every projection to bf16, from sums taken in another order: a few bf16 units apart.
    atol = 0.02 * scale
    torch.testing.assert_close(logits["cpu"], logits["torch"], rtol=0, atol=atol)
    # The same greedy token wherever the top two are further apart than the two may differ (the CPU
    # path also runs bf16 prefill attention in float32, so near-ties can go either way).
    top2 = logits["torch"].topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * atol
    assert clear.sum() >= 10
    assert torch.equal(logits["cpu"].argmax(-1)[clear], logits["torch"].argmax(-1)[clear])


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_16bit_checkpoint_under_float32_activations_keeps_its_weights_in_16_bits(arch, stored, tmp_path):
    """A bf16 or float16 checkpoint served with float32 activations (`--dtype auto` on a CPU without bf16 units)
    keeps its matmul weights and embedding in their 16 bits, and the packed kernel multiplies float32 rows by them,
    in the C layer loop too: the products of the weights widened to float32 (torch's ops), from half the bytes."""
    from actors.worker.forward_batch import ForwardBatch, SequenceInput
    from actors.worker.model_runner import ModelRunner
    from kernels import decode_layers

    folder = _tiny_model(tmp_path, arch, stored)
    batch = ForwardBatch([SequenceInput(list(range(3, 40)), 0, [0, 1, 2, 3, 4], num_logits=37),
                          SequenceInput([7, 8, 9], 0, [5], num_logits=3)])   # logits at every position
    logits = {}
    for kernels in ("cpu", "torch"):
        model = (runner := ModelRunner(folder, dtype="float32", kernels=kernels, block_size=8, num_blocks=8,
                                       num_threads=2)).model
        projections = (model.lm_head, model.layers[0].qkv_weight, model.layers[1].gate_up_weight,
                       model.layers[1].down_weight)
        if kernels == "cpu":
            assert all(isinstance(w, packed_linear.PackedWeight) and w.plain is None and w.dtype == stored
                       for w in projections)
            assert model.embed is model.lm_head if arch == "llama_tied" else model.embed.dtype == stored
            assert decode_layers._plan(model) is not None   # the C loop takes it
            assert model.layers[0].input_norm.dtype == torch.float32
        else:   # torch's ops multiply float32 weights
            assert all(w.dtype == torch.float32 for w in projections)
        logits[kernels] = runner.execute(batch)
    assert logits["cpu"].dtype == torch.float32
    # float32 sums of the same products in another order
    torch.testing.assert_close(logits["cpu"], logits["torch"], rtol=0, atol=1e-5 * logits["torch"].abs().max())
