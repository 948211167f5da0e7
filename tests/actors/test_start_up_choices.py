"""What the engine chooses at load without being told, and that it says so: a GGUF file's blocks
dequantized where no kernel multiplies them, the quantized matmul's kernel (AMX or int8) and why,
and the CPU threads of an unset --num-threads."""
import dataclasses
import json
import os

import pytest
import torch

from actors.config import EngineConfig
from actors.worker.model import why_dequantized
from actors.worker.model_runner import ModelRunner
from kernels import cpu_native, quant_amx
from kernels.ops import CPU_OPS, TORCH_OPS
from tests.actors.test_loader_gguf import hf_folder_to_gguf
from runtime import configure_logging
from tests.actors.test_quantized_gguf import MIXES


@pytest.fixture(autouse=True)
def json_log():
    configure_logging("INFO", json=True)   # as `matinee serve` sets it up: JSON lines on stderr


@pytest.fixture(scope="module")
def q8_gguf(tiny_model_dir, tmp_path_factory):
    return hf_folder_to_gguf(tiny_model_dir("llama"), str(tmp_path_factory.mktemp("gguf") / "q8.gguf"), MIXES["q8_0"])


def _lines(err: str, event: str) -> list[dict]:
    found = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return [d for d in found if d.get("event") == event]


def _runner(path, **kwargs) -> ModelRunner:
    return ModelRunner(path, **{"dtype": "float32", "block_size": 8, "num_blocks": 16, "num_threads": 1,
                                "quantization": "auto", **kwargs})


def test_the_dequantizing_decision_names_its_reason():
    assert why_dequantized("auto", torch.device("cpu"), CPU_OPS) is None
    on_gpu = why_dequantized("auto", torch.device("cuda"), TORCH_OPS)   # the decision, without a GPU
    assert "cuda" in on_gpu and "--quantization int8" in on_gpu
    assert why_dequantized("auto", torch.device("cpu"), TORCH_OPS) is None   # its reference reads blocks
    no_blocks = dataclasses.replace(TORCH_OPS, backend="triton", prepare_quantized=None)
    assert "the triton kernels do not multiply GGUF blocks" in why_dequantized("auto", torch.device("cpu"), no_blocks)
    assert why_dequantized("none", torch.device("cpu"), CPU_OPS) == "--quantization none asks for it"


def test_a_gguf_whose_blocks_are_dequantized_says_so_once_at_load(q8_gguf, capsys):
    _runner(q8_gguf, kernels="torch", quantization="none")
    (line,) = _lines(capsys.readouterr().err, "GGUF weights dequantized at load")
    assert line["reason"] == "--quantization none asks for it" and line["dtype"] == "float32"
    _runner(q8_gguf, kernels="torch")   # kept packed: nothing to say
    assert _lines(capsys.readouterr().err, "GGUF weights dequantized at load") == []


@pytest.mark.skipif(not cpu_native.available(), reason="no CPU C kernels here")
def test_the_quantized_matmul_path_is_logged_once_with_its_reason(q8_gguf, capsys, monkeypatch):
    monkeypatch.setattr(quant_amx, "_said", set())
    _runner(q8_gguf, kernels="cpu")
    (line,) = _lines(capsys.readouterr().err, "quantized matmul path")   # once for every weight
    assert line["path"] == "int8" and "float32" in line["reason"]
    _runner(q8_gguf, kernels="cpu", dtype="bfloat16")
    (line,) = _lines(capsys.readouterr().err, "quantized matmul path")
    with open("/proc/cpuinfo") as f:
        has_amx = " amx_tile" in f.read()
    if has_amx:
        assert line["path"] in ("amx", "int8") and line["reason"]
    else:
        assert line == {**line, "path": "int8", "reason": "this CPU has no AMX tiles"}
    _runner(q8_gguf, kernels="cpu", dtype="bfloat16")
    assert _lines(capsys.readouterr().err, "quantized matmul path") == []   # said once per process


def test_unset_num_threads_is_every_core_this_process_may_use(tiny_model_dir):
    before = torch.get_num_threads()
    try:
        _runner(tiny_model_dir("llama"), kernels="torch", num_threads=None)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
    assert "every core" in EngineConfig.__dataclass_fields__["num_threads"].metadata["help"]
