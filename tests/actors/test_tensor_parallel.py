"""Tensor parallelism on the CPU: two processes give the tokens one process gives, all-reducing through
shared memory or gloo (each forced in some of the tests below; test_shm_all_reduce.py tests the choice).

Through the whole engine (scheduler, KV manager, worker), `tensor_parallel_size=2` against 1 on tiny random
Llama and Qwen2 models whose heads split evenly, whose single KV head is replicated, and whose heads split
unevenly (3 KV heads over 2 ranks); with a token budget that chunks the prompts, shared prefixes that hit
the cache and a pool small enough to preempt. In float32 and with GGUF Q8_0 blocks the greedy tokens are
equal; in bfloat16 the ranks' partial sums round differently, so tokens may part only at a near tie. A rank
killed mid-stream stops the engine at once (exit status 1), never hangs it.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from actors import LLM, SamplingParams
from actors.config import EngineConfig
from actors.nodes.engine_ranks import free_port, serve_ranks
from actors.worker.dequant import dequantize
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.gguf_weights import GGUFWeights
from actors.model.config import ModelLoadError, read_hf_config
from actors.worker.model_runner import ModelRunner
from actors.worker.rank_processes import RankProcesses
from actors.worker.shard_plan import plan_shards
from actors.worker.sharded_weights import ShardedWeights
from actors.worker.tensor_parallel import RankSpec
from kernels.quant_linear import QuantWeight
from tests.actors.conftest import TINY_VOCAB, build_tiny_tokenizer
from tests.actors.test_loader_gguf import hf_folder_to_gguf

NUM_NEW = 16
# A shared 40-token prefix (cache hits), prompts long enough to be chunked at 32 tokens a step.
PREFIX = [random.Random(3).randrange(4, TINY_VOCAB) for _ in range(40)]
BLOCK_SIZE = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    tails = [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (1, 9, 23, 30)]
    return [PREFIX + t for t in tails] + [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (3, 50)]


def _engine_run(model: str, tp: int, dtype: str = "float32", logprobs: int | None = None, **config):
    """Every prompt's CompletionOutput and the engine's stats. The pool of 10 blocks holds about two of the
    prompts at once: the scheduler preempts; the prefix prompt goes first and alone, so the others hit it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs)
    prompts = _prompts()
    with LLM(model, dtype=dtype, num_threads=1, block_size=BLOCK_SIZE, num_blocks=10,
             max_num_batched_tokens=32, tensor_parallel_size=tp, **config) as llm:
        first = llm.generate(prompts[:1], greedy)
        outs = first + llm.generate(prompts[1:], greedy)
        stats = llm.stats()
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0] for o in outs], stats


def _uneven_model(folder: str) -> str:
    """Llama with 6 query heads over 3 KV heads: 2 ranks hold 2 and 1 KV heads (4 and 2 query heads)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=0, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    build_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    def make(name: str) -> str:
        if name == "uneven":
            return _uneven_model(str(tmp_path_factory.mktemp("tiny-uneven")))
        return tiny_model_dir(name)
    return make


# ---- the split ------------------------------------------------------------------------------------------

def _config(folder: str):
    return read_hf_config(folder)


@pytest.mark.parametrize("heads, kv, size, want_heads, want_kv", [
    (4, 2, 2, [(0, 2), (2, 4)], [(0, 1), (1, 2)]),              # even
    (4, 1, 2, [(0, 2), (2, 4)], [(0, 1), (0, 1)]),              # one KV head, replicated
    (6, 3, 2, [(0, 4), (4, 6)], [(0, 2), (2, 3)]),              # KV heads do not divide
    (8, 2, 3, [(0, 2), (2, 4), (4, 8)], [(0, 1), (0, 1), (1, 2)]),   # fewer KV heads than ranks, unevenly
])
def test_query_heads_go_with_their_kv_head(heads, kv, size, want_heads, want_kv, tiny_model_dir):
    import dataclasses

    cfg = dataclasses.replace(_config(tiny_model_dir("llama")), num_heads=heads, num_kv_heads=kv)
    plans = plan_shards(cfg, size)
    assert [(p.heads.start, p.heads.stop) for p in plans] == want_heads
    assert [(p.kv_heads.start, p.kv_heads.stop) for p in plans] == want_kv
    group = heads // kv
    for p in plans:   # every query head a rank computes reads a KV head the rank holds
        assert all(h // group in p.kv_heads for h in p.heads)
    assert sum(len(p.vocab) for p in plans) == cfg.vocab_size and plans[-1].vocab.stop == cfg.vocab_size
    # The MLP splits between whole 32-value blocks (160 = 96 + 64), so a Q8_0 down projection splits packed.
    assert all(p.intermediate.start % 32 == 0 for p in plans) and plans[-1].intermediate.stop == 160


def test_more_ranks_than_heads_is_refused(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="exceeds the model's 4 attention heads"):
        plan_shards(_config(tiny_model_dir("llama")), 5)


def test_gguf_blocks_are_sharded_in_their_stored_form(tiny_model_dir, tmp_path):
    """Each rank's Q8_0 blocks are the whole file's, cut: rows of q/k/v, gate/up and the vocabulary, whole
    blocks of o's and down's columns; dequantized they are the slices of the dequantized tensor."""
    from gguf.constants import GGMLQuantizationType as Q

    folder = tiny_model_dir("llama")
    path = hf_folder_to_gguf(folder, str(tmp_path / "q8.gguf"), quantize=_q8)
    whole = GGUFWeights(path)
    cfg = whole.config
    plans = plan_shards(cfg, 2)
    for plan in plans:
        shard = ShardedWeights(GGUFWeights(path), plan, cfg)
        for name, rows, cols in [
            ("model.layers.1.self_attn.q_proj.weight", _times(plan.heads, cfg.head_dim), None),
            ("model.layers.1.self_attn.k_proj.weight", _times(plan.kv_heads, cfg.head_dim), None),
            ("model.layers.1.self_attn.o_proj.weight", None, _times(plan.heads, cfg.head_dim)),
            ("model.layers.1.mlp.up_proj.weight", plan.intermediate, None),
            ("model.layers.1.mlp.down_proj.weight", None, plan.intermediate),
            ("lm_head.weight", plan.vocab, None),
        ]:
            q = shard.quantized(name)
            assert q is not None and q.qtype == Q.Q8_0, name   # stayed packed
            full = whole.get(name, torch.float32)
            want = full[rows.start:rows.stop] if rows is not None else full[:, cols.start:cols.stop]
            got = torch.from_numpy(dequantize(q.raw.numpy(), Q(q.qtype)).reshape(want.shape))
            assert torch.equal(got, want), name
        shard.close()
    whole.close()


def test_a_cut_inside_k_quant_blocks_dequantizes_that_tensor_alone(tiny_model_dir, tmp_path):
    """Q4_K blocks hold 256 values: o's columns split at 128 (two heads of 64) fall inside them, so that
    shard is read dequantized; down's split at 256 cuts between blocks and stays packed."""
    from gguf.constants import GGMLQuantizationType as Q

    path = hf_folder_to_gguf(tiny_model_dir("llama_wide"), str(tmp_path / "q4k.gguf"),
                             quantize=lambda n: Q.Q4_K if n.endswith(".weight") and "norm" not in n else None)
    whole = GGUFWeights(path)
    cfg = whole.config
    plan = plan_shards(cfg, 2)[1]
    shard = ShardedWeights(GGUFWeights(path), plan, cfg)
    o, down = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"
    assert shard.quantized(o) is None
    assert torch.equal(shard.get(o, torch.float32), whole.get(o, torch.float32)[:, 128:])
    assert plan.intermediate == range(256, 512) and shard.quantized(down).qtype == Q.Q4_K
    shard.close()
    whole.close()


def _q8(name: str):
    from gguf.constants import GGMLQuantizationType as Q

    return Q.Q8_0 if name.endswith(".weight") and "norm" not in name else None


def _times(r: range, k: int) -> range:
    return range(r.start * k, r.stop * k)


# ---- one forward, two processes ---------------------------------------------------------------------

def test_a_rank_pair_gives_the_logits_of_one_process(tiny_model_dir, tmp_path):
    """Rank 0 here, rank 1 a child process: the logits of a mixed batch (a prompt, a decode) equal one
    process's to float32 rounding, and the GGUF blocks stay packed on rank 0."""
    path = hf_folder_to_gguf(tiny_model_dir("qwen2"), str(tmp_path / "q8.gguf"), quantize=_q8)
    kwargs = dict(model=path, dtype="float32", kernels="auto", block_size=BLOCK_SIZE, num_blocks=8, num_threads=1,
                  quantization="auto")
    port = free_port("127.0.0.1")
    specs = [RankSpec(r, 2, "127.0.0.1", port, 60.0) for r in range(2)]
    ranks = RankProcesses(specs[1:], kwargs, "cpu", 2)
    try:
        tp = ModelRunner(**kwargs, tensor_parallel=specs[0])
        try:
            assert isinstance(tp.model.layers[0].o_weight, QuantWeight)
            assert tp.model.config.num_kv_heads == 1 and tp.model.config.num_heads == 2
            one = ModelRunner(**kwargs)
            batch = ForwardBatch([SequenceInput(list(range(5, 40)), 0, [0, 1, 2], num_logits=2),
                                  SequenceInput([7], 0, [3])])
            assert torch.allclose(tp.execute(batch), one.execute(batch), atol=1e-4, rtol=1e-4)
        finally:
            tp.close()
        ranks.stop(timeout_s=30)
        assert [p.returncode for p in ranks.procs.values()] == [0]   # stopped by rank 0, not killed
    finally:
        ranks.kill()


# ---- the engine, one process against two ------------------------------------------------------------

@pytest.mark.parametrize("arch, all_reduce", [("llama", "gloo"), ("llama", "shm"), ("qwen2", "shm"), ("uneven", "shm")])
def test_greedy_parity_float32(arch, all_reduce, models):
    model = models(arch)
    one, _ = _engine_run(model, 1)
    two, stats = _engine_run(model, 2, tp_all_reduce=all_reduce)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens >= 32
    assert stats.steps >= sum(map(len, _prompts())) // 32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_gguf_q8_0(arch, models, tmp_path):
    folder = models(arch)
    path = hf_folder_to_gguf(folder, str(tmp_path / "q8.gguf"), quantize=_q8)
    one, _ = _engine_run(path, 1, tokenizer=folder)
    two, stats = _engine_run(path, 2, tokenizer=folder)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert stats.preemptions > 0


@pytest.mark.parametrize("arch, all_reduce", [("llama", "shm"), ("qwen2", "gloo"), ("uneven", "shm")])
def test_bfloat16_tokens_part_only_at_a_near_tie(arch, all_reduce, models):
    """In bfloat16 each rank rounds its partial sums before the all-reduce adds them: the tokens are one
    process's until a position where the token two processes chose was within a few bfloat16 steps of one
    process's best."""
    model = models(arch)
    one, _ = _engine_run(model, 1, "bfloat16", logprobs=5)
    two, _ = _engine_run(model, 2, "bfloat16", logprobs=5, tp_all_reduce=all_reduce)
    agreed = 0
    for a, b in zip(one, two):
        j = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if j is None:
            agreed += 1
            continue
        best = a.logprobs[j]
        assert b.token_ids[j] in best, (j, best, b.token_ids[j])
        assert best[a.token_ids[j]] - best[b.token_ids[j]] < 0.25, (j, best)
    assert agreed >= len(one) // 2


def test_speculative_verification_and_embeddings(models, tmp_path):
    """n-gram drafts verified several positions at a time, and pooled hidden states, across two ranks."""
    from tests.actors.test_pooling import st_folder
    from tests.actors.test_spec_engine import repetitive, spec_config

    model = models("llama")
    prompts = [repetitive(40, 7, 1), repetitive(33, 5, 2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    runs, embeddings = [], []
    for tp in (1, 2):
        with LLM(model, dtype="float32", num_threads=1, num_blocks=32, tensor_parallel_size=tp,
                 speculative=spec_config("ngram")) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
            drafted = llm.stats().spec_decode_draft_tokens
        with LLM(st_folder(model, str(tmp_path / f"st{tp}"), "mean", True), dtype="float32", num_threads=1,
                 num_blocks=32, max_num_batched_tokens=16, tensor_parallel_size=tp) as llm:
            embeddings.append(torch.tensor(llm.embed(prompts)))
    assert runs[1] == runs[0] and drafted > 0
    assert torch.allclose(embeddings[1], embeddings[0], atol=1e-5)


# ---- failures ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("all_reduce", ["shm", "gloo"])
def test_a_killed_rank_stops_the_engine_without_hanging(all_reduce, models):
    llm = LLM(models("llama"), dtype="float32", num_threads=1, block_size=BLOCK_SIZE, num_blocks=64,
              tensor_parallel_size=2, decode_burst=1, tp_all_reduce=all_reduce)
    try:
        (rank1,) = llm.engine.ranks.procs.values()
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:   # each rank on its own half of the cores
            assert sorted(os.sched_getaffinity(rank1.pid)) == cores[len(cores) // 2:]
        # Killed early: through shared memory this tiny model decodes a token in about a millisecond.
        long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        killer = threading.Timer(0.5, os.kill, (rank1.pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        (out,) = llm.generate([[5, 6, 7]], long)
        assert time.monotonic() - t0 < 60
        assert out.outputs[0].finish_reason == "error" and "engine stopped" in out.outputs[0].error
        assert 0 < len(out.outputs[0].token_ids) < 1000
        assert llm.engine.system.exit_code == 1   # the node stops: a cluster moves its streams
        assert rank1.wait(10) == -signal.SIGKILL
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3, nnodes=2), "must be a multiple of nnodes"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234), "node_rank must be in"),
    (dict(tensor_parallel_size=2, nnodes=2), "need --master-addr and --master-port"),
    (dict(tensor_parallel_size=2, enable_lora=True), "LoRA adapters are not served"),
    (dict(tensor_parallel_size=2, speculative={"method": "layerskip", "num_speculative_tokens": 2,
                                               "draft_layers": 1}), "layer-skip"),
    (dict(tensor_parallel_size=2, kv_offload_memory=1 << 20), "KV offload"),
])
def test_what_tensor_parallelism_does_not_serve_is_refused_at_start(kwargs, message, tiny_model_dir):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_model_dir("llama"), **kwargs)


# ---- two nodes ----------------------------------------------------------------------------------------------

def test_ranks_on_a_second_node(models):
    """--nnodes 2: node 1 runs its rank alone (serve_ranks), node 0 the engine and rank 0; same tokens."""
    model = models("llama")
    port = free_port("127.0.0.1")
    node1 = EngineConfig(model=model, dtype="float32", num_threads=1, block_size=BLOCK_SIZE, num_blocks=10,
                         tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=port)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(serve_ranks(node1)))
    thread.start()
    try:
        two, _ = _engine_run(model, 2, nnodes=2, node_rank=0, master_port=port)
    finally:
        thread.join(60)
    one, _ = _engine_run(model, 1)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert status == [0]   # rank 0 stopped it


def test_a_second_node_serves_its_ranks_alone_and_disaggregation_is_refused(tiny_model_dir, monkeypatch):
    """`matinee serve --node-rank 1` runs no engine (nor needs the cluster secret); --role prefill or decode
    hands KV blocks a rank holds only part of: refused before anything starts."""
    from gateway import cli
    from gateway.roles import RUNNERS, SECRET_ENV

    monkeypatch.delenv(SECRET_ENV, raising=False)
    flags = ["serve", "--model", tiny_model_dir("llama"), "--tensor-parallel-size", "2"]
    for role in ("engine", "all"):
        args = cli.build_parser({}).parse_args(flags + ["--role", role, "--nnodes", "2", "--node-rank", "1",
                                                        "--master-port", "29511"])
        assert RUNNERS[role](args).__qualname__.startswith("_ranks_only")
    monkeypatch.setenv(SECRET_ENV, "s")
    with pytest.raises(ValueError, match="--role prefill hands KV blocks"):
        RUNNERS["prefill"](cli.build_parser({}).parse_args(flags + ["--role", "prefill"]))
