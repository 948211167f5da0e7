"""Reading a PEFT folder: what is kept (A, B scaled by alpha / r or alpha / sqrt(r), the modules), and
every folder the engine cannot serve refused with a LoRAError that names the problem."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from actors.worker.lora_adapter import LoRAError, read_adapter
from actors.model.config import read_hf_config
from tests.actors.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    return {name: make_adapter(base, str(tmp_path_factory.mktemp(f"ad-{name}")), name) for name in ("all", "attn")}


def copy(src: str, tmp_path, name: str = "copy") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_scaling_and_modules_as_peft_has_them(base, adapters):
    from safetensors.torch import load_file

    cfg = read_hf_config(base)
    plain = read_adapter("all", adapters["all"], cfg, max_rank=16)
    assert plain.rank == 8 and plain.scale == 16 / 8
    assert plain.modules == {"q", "k", "v", "o", "gate", "up", "down"}
    tensors = load_file(os.path.join(adapters["all"], "adapter_model.safetensors"))
    a = next(t for k, t in tensors.items() if "layers.1.mlp.down_proj.lora_A" in k)
    b = next(t for k, t in tensors.items() if "layers.1.mlp.down_proj.lora_B" in k)
    got_a, got_b = plain.weights[(1, "down")]
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    rs = read_adapter("attn", adapters["attn"], cfg, max_rank=16)
    assert rs.modules == {"q", "v", "o"} and math.isclose(rs.scale, 8 / math.sqrt(4))   # rsLoRA


def test_the_key_names_the_contents(base, adapters, tmp_path):
    """An adapter's prefix-cache identity follows what it computes: the same files under another folder give
    the same key, one changed weight or alpha another."""
    from safetensors.torch import load_file, save_file

    cfg = read_hf_config(base)
    key = read_adapter("x", adapters["all"], cfg, max_rank=16).key
    assert key.startswith("x@") and read_adapter("x", copy(adapters["all"], tmp_path), cfg, max_rank=16).key == key
    changed = copy(adapters["all"], tmp_path, "changed")
    file = os.path.join(changed, "adapter_model.safetensors")
    tensors = load_file(file)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] += 1.0
    save_file(tensors, file)
    assert read_adapter("x", changed, cfg, max_rank=16).key != key
    scaled = copy(adapters["all"], tmp_path, "scaled")
    edit_config(scaled, lora_alpha=17)
    assert read_adapter("x", scaled, cfg, max_rank=16).key != key


@pytest.mark.parametrize("breakage,message", [
    ("no folder", "does not exist"),
    ("no config", "has no adapter_config.json"),
    ("no weights", "has no adapter_model.safetensors"),
    ("rank too large", "rank 8, more than --max-lora-rank 4"),
    ("dora", "use_dora=True is not supported"),
    ("bad json", "cannot be read as JSON"),
    ("alpha a string", "`lora_alpha` in adapter_config.json must be a number"),
    ("not safetensors", "is not a readable safetensors file"),
])
def test_a_broken_folder_is_refused_by_name(base, adapters, tmp_path, breakage, message):
    folder = copy(adapters["all"], tmp_path)
    max_rank = 16
    if breakage == "no folder":
        folder = str(tmp_path / "nowhere")
    elif breakage == "no config":
        os.remove(os.path.join(folder, "adapter_config.json"))
    elif breakage == "no weights":
        os.remove(os.path.join(folder, "adapter_model.safetensors"))
    elif breakage == "rank too large":
        max_rank = 4
    elif breakage == "dora":
        edit_config(folder, use_dora=True)
    elif breakage == "alpha a string":
        edit_config(folder, lora_alpha="16")
    elif breakage == "not safetensors":
        with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
            f.write(b"\x00" * 64)
    elif breakage == "bad json":
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write("{not json")
    with pytest.raises(LoRAError, match=message):
        read_adapter("x", folder, read_hf_config(base), max_rank)


def test_an_adapter_of_another_base_is_refused_by_its_shapes(tiny_model_dir, adapters, base):
    qwen2 = read_hf_config(tiny_model_dir("qwen2"))   # one KV head where the llama has two: k and v differ
    with pytest.raises(LoRAError, match=r"k_proj has lora_A .* \(wrong base model\?\)"):
        read_adapter("all", adapters["all"], qwen2, max_rank=16)


def test_half_an_adapter_pair_is_refused(adapters, base, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy(adapters["all"], tmp_path)
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, path)
    with pytest.raises(LoRAError, match="layer 0 q_proj has lora_A without its other half"):
        read_adapter("x", folder, read_hf_config(base), 16)


def test_lora_modules_take_name_equals_path_and_vllms_json(base):
    from actors.config import EngineConfig

    cfg = EngineConfig(model=base, lora_modules=["sql=/a/sql", '{"name": "fr", "path": "/a/fr", "base_model_name": "m"}'])
    assert cfg.lora_paths() == {"sql": "/a/sql", "fr": "/a/fr"} and cfg.lora_slots == 1
    assert EngineConfig(model=base).lora_slots == 0   # off without adapters or --enable-lora
    for bad in ("sql", "=/a", '{"name": "x"}', "{not json", "a=/x a=/y".split()):
        with pytest.raises(ValueError, match="lora_modules"):
            EngineConfig(model=base, lora_modules=bad if isinstance(bad, list) else [bad])
