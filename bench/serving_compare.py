"""`matinee serve` against `transformers serve` on the same weights, in one run of the load generator.

Both servers stay up and each rate runs on one, then the other, so background load drifts alike.
The figure of merit: at the highest rate where each holds p90 TPOT <= the SLO, Matinee's req/s
over transformers'. Run: `python -m bench.serving_compare --rates 0.5,1,2 --json out.json`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys

from bench import serving
from bench.peers import free_port, wait_ready

HF_DIR = os.path.join("/tmp", "matinee-bench-smollm2-hf")


def hf_folder_from_gguf(gguf: str, out: str = HF_DIR) -> str:
    """transformers serve cannot load a GGUF file: dequantize it once into an HF folder."""
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf)
    m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = m.config
    cfg.architectures = ["LlamaForCausalLM"]
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = LlamaForCausalLM(cfg)
    plain.load_state_dict(m.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def _server_cmds(model_dir: str, port: int, threads: int | None) -> dict[str, tuple[list[str], str]]:
    py = sys.executable
    matinee = [py, "-m", "gateway.cli", "serve", "--model", model_dir, "--port", str(port),
               "--dtype", "float32", "--served-model-name", "smollm2", "--log-level", "WARNING"]
    if threads:
        matinee += ["--num-threads", str(threads)]
    hf = [os.path.join(os.path.dirname(py), "transformers"), "serve", "--continuous-batching",
          "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
          model_dir]
    return {"matinee": (matinee, f"http://127.0.0.1:{port}/ready"),
            "transformers": (hf, f"http://127.0.0.1:{port}/health")}


class Server:
    """One server process on a free port, ready once its health URL answers 200."""

    def __init__(self, label: str, model_dir: str, args: argparse.Namespace) -> None:
        self.label, self.port = label, free_port()
        cmd, ready_url = _server_cmds(model_dir, self.port, args.threads)[label]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if args.threads:   # the same torch thread count for both servers
            env["OMP_NUM_THREADS"] = str(args.threads)
        self.log = open(os.path.join(args.log_dir, f"{label}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.ready_url = ready_url

    def wait_ready(self) -> None:
        wait_ready(self.ready_url, self.proc)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def sweep(servers: list[Server], args: argparse.Namespace) -> dict[str, dict]:
    """Each rate runs on every server in turn, so a drifting background load hits both alike."""
    results: dict[str, dict] = {}
    for rate in args.rates.split(","):
        for srv in servers:
            argv = ["--url", f"http://127.0.0.1:{srv.port}", "--label", srv.label,
                    "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--rates", rate, "--no-ignore-eos", "--slo-ttft", str(args.slo_ttft),
                    "--slo-tpot", str(args.slo_tpot)]
            print(f"--- {srv.label}", file=sys.stderr, flush=True)
            r = asyncio.run(serving.amain(serving.build_parser().parse_args(argv)))
            if srv.label in results:
                results[srv.label]["runs"].extend(r["runs"])
            else:
                results[srv.label] = r
    return results


def best_rate(result: dict, slo_tpot: float) -> dict | None:
    """The run with the highest achieved req/s among those holding p90 TPOT within the SLO."""
    ok = [r for r in result["runs"] if r["failed"] == 0 and r["tpot_s"]["p90"] is not None
          and r["tpot_s"]["p90"] <= slo_tpot]
    return max(ok, key=lambda r: r["req_s"], default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving_compare", description=__doc__)
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2 from its GGUF)")
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--dataset", default="random")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--servers", default="matinee,transformers")
    p.add_argument("--json", default="serving_compare.json")
    p.add_argument("--plot", default="serving_compare.png")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for both servers (1 avoids spinning on a busy machine)")
    args = p.parse_args(argv)
    if args.model is None:
        from actors.config import default_model_path
        args.model = hf_folder_from_gguf(default_model_path())
    servers = [Server(label, args.model, args) for label in args.servers.split(",")]
    try:
        for srv in servers:
            srv.wait_ready()
        results = sweep(servers, args)
    finally:
        for srv in servers:
            srv.stop()
    summary = {label: best_rate(r, args.slo_tpot) for label, r in results.items()}
    m, h = summary.get("matinee"), summary.get("transformers")
    ratio = (m["req_s"] / h["req_s"]) if m and h and h["req_s"] > 0 else None
    per_rate = []
    if {"matinee", "transformers"} <= results.keys():
        for a, b in zip(results.get("matinee", {}).get("runs", []),
                        results.get("transformers", {}).get("runs", [])):
            per_rate.append({"rate": a["rate"], "req_s_ratio": a["req_s"] / max(b["req_s"], 1e-9),
                             "tok_s_ratio": a["output_tok_s"] / max(b["output_tok_s"], 1e-9),
                             "tpot_p90_ratio": (b["tpot_s"]["p90"] or 0) / max(a["tpot_s"]["p90"] or 1e-9, 1e-9),
                             "ttft_p90_ratio": (b["ttft_s"]["p90"] or 0) / max(a["ttft_s"]["p90"] or 1e-9, 1e-9)})
    out = {"model": args.model, "slo_tpot_s": args.slo_tpot, "results": results,
           "best_under_slo": summary, "req_s_ratio_at_slo": ratio,
           "matinee_over_transformers_per_rate": per_rate}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    serving.plot({label: r["runs"] for label, r in results.items()}, args.plot)
    print(json.dumps({"req_s_ratio_at_slo": ratio, "per_rate": per_rate,
                      "best": {k: (v and {"rate": v["rate"], "req_s": v["req_s"],
                                          "tpot_p90_s": v["tpot_s"]["p90"]})
                               for k, v in summary.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
