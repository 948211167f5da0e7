"""The GPU benchmark script runs end to end at toy sizes on the CPU (under the interpreter)."""

import json
import sys

import pytest


@pytest.mark.slow
def test_kernels_gpu_bench_dry_run(monkeypatch, capsys, tmp_path):
    from bench import kernels_gpu

    out = tmp_path / "summary.json"
    monkeypatch.setattr(sys, "argv", ["kernels_gpu", "--dry-run", "--json", str(out)])
    kernels_gpu.main()
    summary = json.loads(out.read_text())
    assert summary["correct"], summary["max_error"]
    assert set(summary["max_error"]) >= {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                                         "write_kv", "paged_attention", "paged_attention_split_kv"}
    assert len(summary["decode_attention"]) == 2 and len(summary["model_decode_step"]) == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


def test_engine_chat_workload_is_seeded_and_shaped():
    from bench.engine import WORKLOADS, make_chat_workload

    make, n = WORKLOADS["chat"]
    wl = make(n, 49152, 0, 1.0)
    assert make is make_chat_workload and len(wl.prompts) == 48
    assert wl == make_chat_workload(48, 49152, 0, 1.0) and wl != make_chat_workload(48, 49152, 1, 1.0)
    assert all(40 <= len(p) <= 400 for p in wl.prompts) and all(8 <= n <= 256 for n in wl.output_lens)
    assert len(set(wl.output_lens)) > 20   # a mix, not one length
    assert sum(make_chat_workload(48, 49152, 0, 0.5).output_lens) < wl.output_tokens


def test_engine_vllm_job_is_the_matinee_workload():
    from bench.engine import make_chat_workload, vllm_job

    wl = make_chat_workload(6, 1000, 0, 1.0)
    job = json.loads(json.dumps(vllm_job(wl, "bfloat16", "/tmp/m", 512)))   # it travels as JSON
    assert job["prompts"] == wl.prompts and job["max_tokens"] == wl.output_lens
    assert job["dtype"] == "bfloat16" and job["model"] == "/tmp/m"
    assert job["max_num_batched_tokens"] == 512 and job["max_num_seqs"] == 6


def test_engine_ratios_against_vllm_take_its_best_dtype():
    from bench.engine import vllm_ratios

    assert vllm_ratios({"matinee_tok_s": 60.0}) == {}
    r = vllm_ratios({"matinee_tok_s": 60.0, "matinee_bf16_tok_s": 90.0, "vllm_bf16_tok_s": 40.0,
                     "vllm_f32_tok_s": 30.0})
    assert r == {"vllm_best": "vllm_bf16", "vllm_best_tok_s": 40.0, "speedup_vs_vllm": 1.5,
                 "bf16_speedup_vs_vllm": 2.25}
    # a bfloat16 run on a subset is not comparable with vLLM's run on the whole workload
    r = vllm_ratios({"matinee_tok_s": 60.0, "matinee_bf16_tok_s": 9.0, "bf16_num_requests": 4,
                     "vllm_f32_tok_s": 30.0})
    assert r == {"vllm_best": "vllm_f32", "vllm_best_tok_s": 30.0, "speedup_vs_vllm": 2.0}
    # without Matinee's float32 run; other files of the model against the same vLLM run
    r = vllm_ratios({"matinee_bf16_tok_s": 50.0, "vllm_bf16_tok_s": 40.0,
                     "also_bf16_tok_s": {"m-q4_0.gguf": 60.0, "m-q4_k_m.gguf": 20.0}})
    assert r == {"vllm_best": "vllm_bf16", "vllm_best_tok_s": 40.0, "bf16_speedup_vs_vllm": 1.25,
                 "also_bf16_speedup_vs_vllm": {"m-q4_0.gguf": 1.5, "m-q4_k_m.gguf": 0.5}}


def test_engine_rejects_unknown_peers_and_a_missing_vllm(capsys):
    from bench import engine

    with pytest.raises(SystemExit):
        engine.main(["--skip", "hf_static,vllm"])
    assert "unknown ['vllm']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine.main(["--skip", "hf_static", "--vllm-python", "/nonexistent/python"])
    assert "--skip vllm_bf16,vllm_f32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine.main(["--skip", "f32,vllm_bf16,vllm_f32"])   # transformers would have no float32 figure beside it
    assert "--skip f32 leaves" in capsys.readouterr().err


@pytest.mark.parametrize("kv_first", [False, True])
def test_engine_kv_cache_run_order_is_swappable(monkeypatch, capsys, kv_first):
    """--kv-first puts each --kv-cache-dtype engine before its peer in the model dtype's cache, and the
    ratios still compare the same two engines (the engines themselves are stubbed: only the order runs)."""
    from bench import engine

    runs = []

    def fake_run(model, wl, dtype, threads, budget, kv_cache_dtype="auto"):
        runs.append((dtype, kv_cache_dtype))
        tok_s = {"float32": 100.0, "bfloat16": 200.0}[dtype] * (0.5 if kv_cache_dtype == "int8" else 1.0)
        return {"tok_s": tok_s, "wall_s": 1.0, "overhead_frac": 0.0, "loop_idle_frac": 0.0, "kv_waste_frac": 0.0,
                "steps": 1, "preemptions": 0, "model_flops": 1.0}

    monkeypatch.setattr(engine, "run_matinee", fake_run)
    monkeypatch.setattr(engine, "matmul_gflops", lambda dtype, windows=3: 1.0)
    argv = ["--workload", "chat", "--num-requests", "2", "--skip", "hf_static,hf_batch,vllm_bf16,vllm_f32",
            "--kv-cache-dtype", "int8", "--json"] + (["--kv-first"] if kv_first else [])
    out = engine.main(argv)
    pairs = [[("float32", "int8"), ("float32", "auto")], [("bfloat16", "int8"), ("bfloat16", "auto")]]
    assert runs == [r for pair in pairs for r in (pair if kv_first else pair[::-1])]
    assert out["kv_order"] == ("kv_first" if kv_first else "kv_after")
    assert out["kv_int8_speedup"] == out["bf16_kv_int8_speedup"] == 0.5
    assert json.loads(capsys.readouterr().out) == out


def test_vllm_offline_script_needs_only_the_standard_library():
    """It runs in vLLM's venv: importing it (vllm is imported only when it runs) pulls in nothing else."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).parents[2] / "bench" / "vllm_offline.py"
    tree = ast.parse(src.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names) | {"vllm"}, names


def test_kv_blocks_bench_times_both_copy_paths_at_toy_sizes(capsys):
    from bench import kv_blocks

    rows = kv_blocks.main(["--blocks", "1,3", "--layers", "2", "--repeats", "2"])
    assert [r["blocks"] for r in rows] == [1, 3] and rows[1]["bytes"] == 3 * rows[0]["bytes"]
    assert all(r[f"{p}_{op}_ms"] > 0 for r in rows for p in ("numpy", "torch") for op in ("read", "write"))
    assert [json.loads(line)["blocks"] for line in capsys.readouterr().out.splitlines()] == [1, 3]
