"""Loading failures give one clear ModelLoadError (a ValueError) naming the problem; sharded
safetensors checkpoints load like single-file ones."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.model.config import ModelLoadError
from actors.worker.model_runner import ModelRunner


def _copy(tiny_model_dir, arch: str, tmp_path) -> str:
    dst = str(tmp_path / arch)
    shutil.copytree(tiny_model_dir(arch), dst)
    return dst


def test_missing_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="model path does not exist: .*no-such-model"):
        ModelRunner(missing, kernels="torch", num_threads=1, num_blocks=4)
    assert issubclass(ModelLoadError, ValueError)


def test_folder_without_weights_or_config(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf file"):
        ModelRunner(str(tmp_path), kernels="torch", num_threads=1, num_blocks=4)


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, "llama", tmp_path)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        ModelRunner(folder, kernels="torch", num_threads=1, num_blocks=4)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir, "qwen2", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.self_attn.k_proj.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks the tensor 'model.layers.2.self_attn.k_proj.bias'"):
        ModelRunner(folder, kernels="torch", num_threads=1, num_blocks=4)


def test_missing_shard_is_named(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    os.remove(os.path.join(folder, shards[-1]))
    with pytest.raises(ModelLoadError, match="shard listed in the index is missing"):
        ModelRunner(folder, kernels="torch", num_threads=1, num_blocks=4)


def test_sharded_checkpoint_loads_like_single_file(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    single = tiny_model_dir("qwen3")
    folder = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(folder, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    batch = ForwardBatch([SequenceInput(list(range(10, 50)), 0, [0, 1, 2], num_logits=3)])
    a = ModelRunner(single, kernels="torch", num_threads=1, num_blocks=4).execute(batch)
    b = ModelRunner(folder, kernels="torch", num_threads=1, num_blocks=4).execute(batch)
    assert torch.equal(a, b)


def test_runner_argument_errors(tiny_model_dir):
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unsupported dtype"):
        ModelRunner(folder, dtype="int8", kernels="torch", num_threads=1, num_blocks=4)
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(folder, kernels="torch", num_threads=1, kv_cache_memory=100)
    with pytest.raises(ValueError, match="unknown kernels backend"):
        ModelRunner(folder, kernels="cuda-magic", num_blocks=4)
