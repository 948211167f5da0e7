"""The pure-torch ops (the CPU serving path) against obvious oracles and transformers."""

import pytest
import torch

from kernels import build_cos_sin_cache, get_ops
from tests.kernels.batches import make_batch, naive_attention

OPS = get_ops("torch", "cpu")
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}

ATTENTION_CASES = {
    "decode": [(1, 1), (1, 17), (1, 40), (1, 33)],
    "prefill": [(7, 7), (33, 33), (1, 1), (16, 16)],
    "chunked_prefill": [(5, 37), (16, 48), (3, 19)],
    "mixed": [(1, 29), (9, 9), (1, 1), (6, 50), (1, 64)],
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_paged_attention_matches_naive(case, heads, block_size):
    batch = make_batch(ATTENTION_CASES[case], *heads, head_dim=32, block_size=block_size)
    out = OPS.paged_attention(*batch.args())
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_precision(dtype):
    batch = make_batch(ATTENTION_CASES["mixed"], 8, 2, head_dim=64, block_size=16, dtype=dtype)
    out = OPS.paged_attention(*batch.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_decode_path_equals_chunk_path():
    from kernels.paged_attention import _decode, _prefill

    batch = make_batch([(1, 20), (1, 3), (1, 45)], 4, 2, head_dim=16, block_size=16)
    seq_lens = batch.seq_lens.long()
    fast = _decode(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, 45, batch.scale)
    ones = torch.ones(3, dtype=torch.long)
    general = _prefill(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, seq_lens, ones,
                       torch.arange(3), 1, 45, batch.scale)
    torch.testing.assert_close(fast, general, atol=1e-6, rtol=1e-5)


def test_paged_attention_mixed_batch_does_not_pad_decodes_to_the_chunk(monkeypatch):
    """Padded together, 5 decodes beside a 40-token chunk would each do 40 rows of work: the
    chunk path must see only the chunked sequence."""
    import kernels.paged_attention as module

    seen = []
    real_prefill = module._prefill

    def spy(q, k_cache, v_cache, block_tables, *args):
        seen.append((q.shape[0], block_tables.shape[0]))
        return real_prefill(q, k_cache, v_cache, block_tables, *args)

    monkeypatch.setattr(module, "_prefill", spy)
    batch = make_batch([(1, 30), (1, 9), (40, 50), (1, 1), (1, 64), (1, 17)], 4, 2, head_dim=16, block_size=16)
    out = OPS.paged_attention(*batch.args())
    assert seen == [(40, 1)]
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_and_fused_add_match_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, res = torch.randn(2, 13, 48).to(dtype)
    hf = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    hf.weight.data = torch.randn(48).to(dtype)
    torch.testing.assert_close(OPS.rms_norm(x, hf.weight.data, 1e-6), hf(x), atol=0, rtol=0)
    y, new_res = OPS.fused_add_rms_norm(x, res, hf.weight.data, 1e-6)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    torch.testing.assert_close(y, hf(x + res), atol=0, rtol=0)


def test_silu_and_mul():
    x = torch.randn(5, 22)
    torch.testing.assert_close(OPS.silu_and_mul(x), torch.nn.functional.silu(x[:, :11]) * x[:, 11:])


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    OPS.write_kv(k, v, k_cache, v_cache, torch.tensor([3 * 16 + 5, -1, 17]))
    torch.testing.assert_close(k_cache[3, 5], k[0])
    torch.testing.assert_close(v_cache[1, 1], v[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def _hf_inv_freq(head_dim, theta, rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096,
        rope_parameters=params,
    )
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0
    return rotary.inv_freq


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
    ],
)
def test_cos_sin_cache_matches_transformers(rope_scaling):
    head_dim, theta, max_pos = 64, 500000.0, 300
    inv_freq = _hf_inv_freq(head_dim, theta, rope_scaling)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq.float())
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    torch.testing.assert_close(build_cos_sin_cache(head_dim, max_pos, theta, rope_scaling), expected)


def test_cos_sin_cache_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="yarn"):
        build_cos_sin_cache(64, 16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_rotary_matches_transformers_apply_rotary():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    cache = build_cos_sin_cache(32, 100, 10000.0)
    positions = torch.tensor([0, 5, 99, 3, 41])
    q, k = torch.randn(5, 6, 32), torch.randn(5, 2, 32)
    cos_half, sin_half = cache[positions].chunk(2, dim=-1)
    cos = torch.cat([cos_half, cos_half], -1)[None]
    sin = torch.cat([sin_half, sin_half], -1)[None]
    # transformers wants [batch, heads, seq, dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    out_q, out_k = OPS.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1))


def test_get_ops_dispatch():
    assert get_ops("torch", torch.device("cpu")).backend == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        get_ops("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown kernels backend"):
        get_ops("cuda", "cpu")
