"""Draft proposers: model drafts follow their model exactly, in step with accepted and rejected tokens.

A draft that is the target itself (all its layers) must propose the target's own greedy
continuation, whatever was accepted before: that checks positions, KV reuse and rollback.
"""

import numpy as np
import pytest
import torch

from actors.draft.draft_actor import build_proposer
from actors.draft.config import SpeculativeConfig
from actors.draft.messages import DraftInput, Propose
from actors.draft.ngram import NgramConfig
from actors.draft.proposer import ModelProposer, NgramProposer, check_same_vocab
from actors.messages.front_end import SamplingParams
from actors.messages.step import NewSequence
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
TABLE = list(range(8))          # the sequence under test: blocks 0..7 (128 positions)
REF_TABLE = list(range(20, 28))  # scratch blocks for the reference decode


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir("llama"), dtype="float32", kernels="torch", block_size=16,
                       num_blocks=40, num_threads=1)


def greedy_continuation(runner, tokens, k):
    """The target's own greedy continuation, recomputed from scratch in scratch blocks."""
    logits = runner.execute(ForwardBatch([SequenceInput(list(tokens), 0, REF_TABLE)]))
    out = [int(logits[-1].argmax())]
    while len(out) < k:
        pos = len(tokens) + len(out) - 1
        logits = runner.execute(ForwardBatch([SequenceInput([out[-1]], pos, REF_TABLE)]))
        out.append(int(logits[-1].argmax()))
    return out


def prompt(n, seed=0):
    return torch.randint(4, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_kv_draft_with_every_layer_proposes_the_targets_greedy_tokens(runner):
    p = prompt(21)
    # The target computed the prompt but its last token (as when that token was just sampled).
    runner.execute(ForwardBatch([SequenceInput(p[:-1], 0, TABLE, 0)]))
    proposer = ModelProposer(runner, runner.kv_caches, shares_target_kv=True)
    new = NewSequence(1, p, GREEDY, None)
    got = proposer.step(Propose(1, [DraftInput(1, [p[-1]], len(p) - 1, TABLE, 5)], [new]))
    assert [g.token_ids for g in got] == [greedy_continuation(runner, p, 5)]
    assert got[0].probs == b""  # greedy: point masses


def test_own_kv_draft_stays_in_step_with_accepts_and_rejections(runner, tiny_model_dir):
    draft = ModelRunner(tiny_model_dir("llama"), dtype="float32", kernels="torch", block_size=16,
                        num_blocks=40, num_threads=1)
    proposer = ModelProposer(draft, draft.kv_caches, shares_target_kv=False)
    p = prompt(30, seed=1)
    new = NewSequence(7, p, GREEDY, None)
    # A prefill chunk without drafting, then the rest of the prompt with 4 drafts.
    assert proposer.step(Propose(1, [DraftInput(7, p[:17], 0, TABLE, 0)], [new])) == []
    got = proposer.step(Propose(2, [DraftInput(7, p[17:], 17, TABLE, 4)]))[0].token_ids
    ref = greedy_continuation(runner, p, 9)
    assert got == ref[:4]
    # All 4 accepted plus a bonus token: the next step starts after them.
    history = p + ref[:5]
    got = proposer.step(Propose(3, [DraftInput(7, [ref[4]], len(history) - 1, TABLE, 4)]))[0].token_ids
    assert got == ref[5:9]
    # Now only one is accepted and the target corrects the second to something else.
    corrected = (ref[6] + 1) % 384
    history = history + [ref[5], corrected]
    got = proposer.step(Propose(4, [DraftInput(7, [corrected], len(history) - 1, TABLE, 3)]))[0].token_ids
    assert got == greedy_continuation(runner, history, 3)
    assert proposer.num_seqs == 1
    proposer.step(Propose(5, [], [], [7]))
    assert proposer.num_seqs == 0


def test_sampled_drafts_come_with_the_distribution_they_were_drawn_from(runner):
    p = prompt(10, seed=2)
    runner.execute(ForwardBatch([SequenceInput(p[:-1], 0, TABLE, 0)]))
    proposer = ModelProposer(runner, runner.kv_caches[:2], shares_target_kv=True)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=3)
    runs = []
    for _ in range(2):  # a seed makes the drafts repeat
        got = proposer.step(Propose(1, [DraftInput(3, [p[-1]], len(p) - 1, TABLE, 3)], [NewSequence(3, p, params, 3)]))
        runs.append(got[0])
    q = np.frombuffer(runs[0].probs, dtype=np.float32).reshape(3, 384)
    assert np.allclose(q.sum(axis=1), 1.0, atol=1e-5)
    assert all(q[i, t] > 0 for i, t in enumerate(runs[0].token_ids))
    assert (q == 0).any(axis=1).all()  # top-p removed the tail, in q as in the sampler
    assert runs[0].token_ids == runs[1].token_ids


def test_ngram_proposer_drafts_from_the_history_it_was_told():
    proposer = NgramProposer(NgramConfig(1, 3, 4))
    p = [5, 6, 7, 8, 9, 10, 5, 6]
    new = NewSequence(1, p, GREEDY, None)
    got = proposer.step(Propose(1, [DraftInput(1, p, 0, [0], 4)], [new]))
    assert got[0].token_ids == [7, 8, 9, 10]
    # 7 and 8 accepted, then the target said 11: the history holds them, and 6 7 8 11 is new.
    got = proposer.step(Propose(2, [DraftInput(1, [11], 10, [0], 4)]))
    assert got[0].token_ids == []
    got = proposer.step(Propose(3, [DraftInput(1, [5], 11, [0], 2)]))
    assert got[0].token_ids == [6, 7]


def test_build_proposer_checks_the_target(runner):
    with pytest.raises(ValueError, match="below the target's 3 layers"):
        build_proposer(SpeculativeConfig("layerskip", draft_layers=3), runner)
    proposer, cost = build_proposer(SpeculativeConfig("layerskip", draft_layers=1), runner)
    assert isinstance(proposer, ModelProposer) and abs(cost - 1 / 3) < 1e-9
    proposer, cost = build_proposer(SpeculativeConfig("ngram"), None)
    assert isinstance(proposer, NgramProposer) and cost == 0.0


def test_a_draft_with_another_vocabulary_is_refused(runner, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    other = ModelRunner(str(tmp_path), dtype="float32", kernels="torch", num_blocks=4, num_threads=1)
    with pytest.raises(ValueError, match="vocabulary \\(400 tokens\\) differs from the target's \\(384\\)"):
        check_same_vocab(runner, other)
