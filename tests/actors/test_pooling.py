"""Embeddings: the engine's pooled hidden states against transformers' last_hidden_state pooled the
same way, whatever the chunking, the batch and the prefix cache."""
import json
import os
import shutil

import pytest
import torch

from actors.worker.pooling import Pooling, PoolState, read_pooling

TEXTS = ["Hello world, how are you today?", "One two three", "x", "A much longer sentence about tea. " * 8]


def st_folder(src: str, dst: str, kind: str | None, normalize: bool) -> str:
    """A copy of `src` with sentence-transformers' modules: a Pooling of `kind`, and Normalize."""
    shutil.copytree(src, dst)
    if kind is None:
        return dst
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dst, "1_Pooling"))
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": kind == "cls",
                   "pooling_mode_mean_tokens": kind == "mean", "pooling_mode_max_tokens": False,
                   "pooling_mode_lasttoken": kind == "last"}, f)
    return dst


def reference(folder: str, text: str, pooling: Pooling) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32)
    hidden = model(tok(text, return_tensors="pt").input_ids).last_hidden_state[0]
    vector = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling.kind]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def test_read_pooling_follows_sentence_transformers_modules(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    assert read_pooling(src) == Pooling("last", True)   # no modules: a decoder's default, as vLLM's
    assert read_pooling(None) == Pooling("last", True)
    for kind in ("mean", "cls", "last"):
        for normalize in (True, False):
            folder = st_folder(src, str(tmp_path / f"{kind}-{normalize}"), kind, normalize)
            assert read_pooling(folder) == Pooling(kind, normalize)


def test_a_pool_over_chunks_is_the_pool_of_the_whole_and_adds_nothing_twice():
    hidden = torch.randn(10, 4)
    state = PoolState(Pooling("mean", False), 10)
    for start, length in ((0, 3), (0, 3), (3, 4), (7, 3)):   # the second: a retried chunk
        rows = state.positions(start, length)
        state.add(hidden[rows.start:rows.stop]) if rows else None
        if start < 7:
            assert state.take() is None
    assert torch.allclose(torch.tensor(state.take()), hidden.mean(0))
    last = PoolState(Pooling("last", True), 10)
    assert not last.positions(0, 9) and list(last.positions(9, 1)) == [9]


@pytest.mark.parametrize("arch, kind, normalize", [("llama", None, True), ("llama", "mean", True),
                                                   ("llama", "cls", False), ("qwen2", "mean", False)])
def test_engine_embeddings_equal_transformers_pooling(tiny_model_dir, tmp_path, arch, kind, normalize):
    """Chunks of 16 tokens, all inputs in one batch, then again (nothing read from the cache)."""
    from actors import LLM

    folder = st_folder(tiny_model_dir(arch), str(tmp_path / "m"), kind, normalize)
    pooling = read_pooling(folder)
    with LLM(model=folder, dtype="float32", num_blocks=64, max_num_batched_tokens=16, num_threads=1) as llm:
        together = llm.embed(TEXTS)
        again = llm.embed(TEXTS)
        alone = [llm.embed(t)[0] for t in TEXTS[:2]]
        text = llm.generate(TEXTS[1])[0].outputs[0].text   # generation unaffected beside them
    assert again == together and text
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5) for a, b in zip(alone, together))
    for t, got in zip(TEXTS, together):
        want = reference(folder, t, pooling)
        assert torch.allclose(torch.tensor(got), want, atol=1e-4), (t, (torch.tensor(got) - want).abs().max())
