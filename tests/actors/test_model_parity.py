"""Greedy tokens from ModelRunner equal transformers' generate for tiny Llama, Qwen2 and Qwen3 models.

The runner is driven by a small greedy loop here (no scheduler): whole-prompt prefill, chunked
prefill mixed with decodes and staggered arrivals, prefixes shared through the same physical
blocks, and multi-position logits as speculative verification uses them.
"""
from __future__ import annotations

import random

import pytest
import torch

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner
from tests.actors.conftest import TINY_ARCHS, TINY_VOCAB

BLOCK_SIZE = 8
NUM_NEW = 10
PROMPT_LENS = (1, 3, 8, 17, 40, 123)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(folder: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 1
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_new, min_new_tokens=0)
            outs.append(out[0, len(p):].tolist())
    return outs


class Blocks:
    """A shuffled free list, so block tables are scattered over the pool as in real serving."""

    def __init__(self, num_blocks: int, seed: int = 1) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())


class Seq:
    def __init__(self, prompt: list[int]) -> None:
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0
        self.table: list[int] = []

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]


def run_greedy(runner: ModelRunner, seqs: list[Seq], blocks: Blocks, num_new: int, chunk: int | None = None,
               arrivals: list[int] | None = None) -> None:
    """Steps until every sequence has num_new outputs; `chunk` caps new tokens per sequence per step,
    `arrivals[i]` is the step at which sequence i joins the batch."""
    arrivals = arrivals or [0] * len(seqs)
    step = 0
    while any(len(s.output) < num_new for s in seqs):
        active = [s for s, a in zip(seqs, arrivals) if a <= step and len(s.output) < num_new]
        items = []
        for s in active:
            todo = s.tokens[s.num_computed:]
            if chunk is not None:
                todo = todo[:chunk]
            blocks.grow(s.table, s.num_computed + len(todo))
            items.append(SequenceInput(todo, s.num_computed, list(s.table)))
        if items:
            logits = runner.execute(ForwardBatch(items))
            assert logits.shape == (len(items), runner.model_config.vocab_size)
            assert logits.dtype == torch.float32
            for s, item, row in zip(active, items, logits):
                s.num_computed += len(item.token_ids)
                if s.num_computed == len(s.tokens):  # the prompt (or last token) is done: sample
                    s.tokens.append(int(row.argmax()))
        step += 1


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_dir(arch), _prompts(), NUM_NEW)
        return cache[arch]

    return get


def _runner(folder: str, num_blocks: int = 96) -> ModelRunner:
    return ModelRunner(folder, dtype="float32", kernels="torch", num_threads=1, block_size=BLOCK_SIZE, num_blocks=num_blocks)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_prefill_then_decode_matches_hf(arch, tiny_model_dir, reference):
    runner = _runner(tiny_model_dir(arch))
    seqs = [Seq(p) for p in _prompts()]
    run_greedy(runner, seqs, Blocks(runner.num_blocks), NUM_NEW)
    assert [s.output for s in seqs] == reference(arch)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_chunked_prefill_mixed_with_decode_matches_hf(arch, tiny_model_dir, reference):
    runner = _runner(tiny_model_dir(arch))
    seqs = [Seq(p) for p in _prompts()]
    # 7-token chunks and staggered arrivals: steps mix decodes with prefill chunks over cached blocks.
    run_greedy(runner, seqs, Blocks(runner.num_blocks), NUM_NEW, chunk=7, arrivals=[0, 5, 1, 0, 3, 2])
    assert [s.output for s in seqs] == reference(arch)


def test_llama_attention_bias_matches_hf(tiny_model_dir):
    folder = tiny_model_dir("llama_bias")
    runner = _runner(folder)
    assert runner.model_config.attention_bias and runner.model_config.o_proj_bias
    seqs = [Seq(p) for p in _prompts()[:4]]
    run_greedy(runner, seqs, Blocks(runner.num_blocks), NUM_NEW, chunk=7)
    assert [s.output for s in seqs] == hf_greedy(folder, _prompts()[:4], NUM_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_blocks_match_hf(arch, tiny_model_dir):
    """A second request maps the first one's full prompt blocks and prefills only its own tail."""
    folder = tiny_model_dir(arch)
    rng = random.Random(7)
    prefix = [rng.randrange(4, TINY_VOCAB) for _ in range(3 * BLOCK_SIZE)]
    prompts = [prefix + [rng.randrange(4, TINY_VOCAB) for _ in range(n)] for n in (5, 1, 12)]
    expected = hf_greedy(folder, prompts, NUM_NEW)

    runner = _runner(folder)
    blocks = Blocks(runner.num_blocks)
    first = Seq(prompts[0])
    run_greedy(runner, [first], blocks, NUM_NEW)
    others = [Seq(p) for p in prompts[1:]]
    for s in others:  # the prefix's three full blocks hold exactly its KV: reuse them, skip their prefill
        s.table = first.table[:3]
        s.num_computed = len(prefix)
    run_greedy(runner, others, blocks, NUM_NEW, chunk=5)
    assert [first.output] + [s.output for s in others] == expected


@pytest.mark.parametrize("arch", ["llama_tied", "qwen2"])
def test_multi_position_logits_verify_a_draft(arch, tiny_model_dir, reference):
    """num_logits = k+1 returns the logits of the last k+1 positions (speculative verification)."""
    runner = _runner(tiny_model_dir(arch))
    blocks = Blocks(runner.num_blocks)
    prompts, expected = _prompts(), reference(arch)
    k = 4
    tables: list[list[int]] = [[] for _ in prompts]
    for p, table in zip(prompts, tables):
        blocks.grow(table, len(p) + k)
    runner.execute(ForwardBatch([SequenceInput(p[:-1], 0, t) for p, t in zip(prompts, tables) if len(p) > 1]))
    # Verify step: the last prompt token plus a k-token "draft" equal to the reference continuation.
    verify = []
    for p, exp, t in zip(prompts, expected, tables):
        start = len(p) - 1
        verify.append(SequenceInput([p[-1]] + exp[:k], start, t, num_logits=k + 1))
    logits = runner.execute(ForwardBatch(verify))
    assert logits.shape == (len(prompts) * (k + 1), runner.model_config.vocab_size)
    rows = logits.argmax(-1).view(len(prompts), k + 1).tolist()
    assert rows == [exp[:k + 1] for exp in expected]


def test_layer_skip_caches_run_the_first_layers(tiny_model_dir):
    """Passing caches for L layers runs the first L layers + final norm + LM head (self-speculation),
    which is what transformers computes for the same checkpoint cut to L layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    runner = _runner(folder)
    draft_caches = runner.allocate_kv_caches(2, 16)
    prompt = _prompts()[4]
    table = list(range(-(-len(prompt) // BLOCK_SIZE)))
    got = runner.execute(ForwardBatch([SequenceInput(prompt, 0, table, num_logits=len(prompt))]), draft_caches)
    assert not any(c[0].any() for c in runner.kv_caches[:1])  # the target's own cache was not touched
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 2
    cut = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32)
    with torch.no_grad():
        want = cut(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rows_without_logits(tiny_model_dir):
    """num_logits=0 (a prefill chunk that does not end its prompt) returns no row for that sequence."""
    runner = _runner(tiny_model_dir("qwen3"))
    a, b = _prompts()[3], _prompts()[4]
    logits = runner.execute(ForwardBatch([SequenceInput(a, 0, [0, 1, 2], num_logits=0),
                                          SequenceInput(b, 0, [3, 4, 5, 6, 7], num_logits=2)]))
    full = runner.execute(ForwardBatch([SequenceInput(b, 0, [8, 9, 10, 11, 12], num_logits=2)]))
    assert logits.shape == (2, TINY_VOCAB)
    torch.testing.assert_close(logits, full)
    with pytest.raises(ValueError, match="num_logits"):
        runner.execute(ForwardBatch([SequenceInput(a, 0, [0, 1, 2], num_logits=len(a) + 1)]))
    with pytest.raises(ValueError, match="token id out of range"):
        runner.execute(ForwardBatch([SequenceInput([TINY_VOCAB], 0, [0])]))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(ForwardBatch([SequenceInput(b, 0, [0, 1])]))


@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_torch_linear(rows, with_bias):
    from kernels.linear import linear

    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 64, generator=g), torch.randn(1000, 64, generator=g)
    bias = torch.randn(1000, generator=g) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, 1000) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_weight_at_any_file_offset_gives_the_same_logits():
    from actors.worker.model import _aligned
    from kernels.linear import linear

    w = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    buf = torch.empty(w.numel() + 1)
    shifted = buf[1:].view(1000, 64).copy_(w)          # 4 bytes off torch's 64-byte alignment
    x = torch.randn(3, 64)
    assert _aligned(shifted).data_ptr() % 64 == 0 and _aligned(w) is w
    assert torch.equal(linear(x, _aligned(shifted)), linear(x, w))
