"""`matinee`, the console script: `matinee serve` runs the OpenAI-compatible server; `matinee plan`
says how much GPU memory a model, context and concurrency take (actors/model/memory_plan.py).

With no arguments it serves the default model (SmolLM2) at 127.0.0.1:8000 with every actor in
one process (`--role all`). Its flags come from the config classes' fields (gateway/flags.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Mapping

from actors.config import GPU_STEP_TOKENS, EngineConfig
from actors.model.memory_plan import AUTO, BACKENDS, GB, DTYPE_BYTES, WEIGHT_BYTES, MemoryPlan, parse_size
from actors.model.shape import PRESETS, ModelShape
from actors.draft.config import SpeculativeConfig
from actors.nodes.engine_node import EngineNodeConfig
from actors.kv.transfer import KVTransferConfig
from gateway.cluster import GatewayNodeConfig
from gateway.config import GatewayConfig, ProcessConfig
from gateway.engine_pool import PoolConfig
from gateway.flags import HelpFormatter, add_flags
from gateway.flags import parse_bytes  # noqa: F401  (the CLI's helpers, importable from here as before)
from gateway.roles import RUNNERS, curl_line, engine_kwargs  # noqa: F401

# `matinee serve --help`'s sections, and the config classes whose fields are their flags.
SECTIONS = (
    (None, (ProcessConfig,)),
    ("HTTP", (GatewayConfig,)),
    ("engine", (EngineConfig,)),
    ("speculative decoding", (SpeculativeConfig,)),
    ("cluster (--role gateway|engine|prefill|decode|draft)",
     (EngineNodeConfig, KVTransferConfig, GatewayNodeConfig, PoolConfig)),
)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Raises ValueError for a bad MATINEE_<FLAG> value in `environ` (default: os.environ)."""
    p = argparse.ArgumentParser(prog="matinee", description="An LLM inference server on actors.")
    sub = p.add_subparsers(dest="command", required=True)
    # A short usage line, so a bad flag's error is not lost under forty others.
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API",
                       usage="%(prog)s [options]  (matinee serve --help lists them)",
                       formatter_class=HelpFormatter,
                       epilog="Each flag's default can also be set as MATINEE_<FLAG> in the environment "
                              "(MATINEE_API_KEY, MATINEE_KV_CACHE_MEMORY=2GiB, ...).")
    for title, classes in SECTIONS:
        group = s.add_argument_group(title) if title else s
        for cls in classes:
            add_flags(group, cls, environ)
    _add_plan_parser(sub)
    return p


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="GPU memory for a model, context length and concurrency",
                       description="Weights, KV cache and activation headroom in GB (10^9 bytes), and the "
                                   "GPUs they need; with --fit, the concurrency that a given memory holds.")
    p.add_argument("--model", help="config.json folder, .gguf file or preset: " + ", ".join(PRESETS)
                   + " (unset: the default model)")
    p.add_argument("--context-len", type=int, help="tokens per sequence (unset: the model's context)")
    p.add_argument("--concurrency", type=int, default=1, help="sequences resident at once")
    p.add_argument("--weight-dtype", default="bf16", choices=[*WEIGHT_BYTES, AUTO], metavar="DTYPE",
                   help="fp32, bf16, fp16, int8, fp8 or int4 (default bf16; int8 and int4 as the engine holds "
                        "them under --quantization int8 / int4, scales, int8 LM head and float norms included, "
                        "or nominal 1 and 0.5 bytes a value for a preset that is only a parameter count, "
                        "70b-gqa); a GGUF type (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, "
                        "q4_k, q5_k, q6_k, iq4_xs: bytes as the CPU kernels hold it, scales included); "
                        "auto: a GGUF file's own "
                        "types, as the CPU engine holds them under --quantization auto")
    p.add_argument("--backend", default="gpu", choices=BACKENDS,
                   help="whose int4 layout --weight-dtype int4 is sized in: gpu (torch and Triton kernels: a "
                        "float16 scale and a uint8 zero per group) or cpu (torch's CPU int4 matmul: rows padded "
                        "to 16, a scale and an offset per group in the activation dtype)")
    p.add_argument("--kv-dtype", default="bf16", choices=DTYPE_BYTES, metavar="DTYPE",
                   help="fp32, bf16, fp16, int8, fp8 (int8 and fp8 with their scales per block)")
    p.add_argument("--step-tokens", type=int, default=GPU_STEP_TOKENS,
                   help="tokens computed in one step, for the activation headroom (serve's "
                        "--max-num-batched-tokens)")
    p.add_argument("--gpu-memory", default="80GB", help="memory of one GPU: 80GB (10^9) or 80GiB (2^30)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs that --fit fills")
    p.add_argument("--fit", action="store_true", help="also print the concurrency that --gpus GPUs hold")
    p.add_argument("--json", action="store_true", help="one JSON object, byte counts unrounded")


def plan(args: argparse.Namespace) -> int:
    from actors.model.source import default_model_path

    shape = ModelShape.load(args.model or default_model_path())
    gpu_memory = parse_size(args.gpu_memory)
    p = MemoryPlan(shape, args.context_len or shape.max_context, args.concurrency, args.weight_dtype,
                   args.kv_dtype, args.step_tokens, backend=args.backend)
    out = p.as_dict(gpu_memory)
    if args.fit:
        out |= {"fit_gpus": args.gpus, "fit_concurrency": p.max_concurrency(args.gpus * gpu_memory)}
    if args.json:
        print(json.dumps(out))
        return 0
    rows = [("model", f"{shape.name} ({shape.num_params / 1e9:.2f}B parameters)"),
            ("context", f"{p.context_len} tokens x {p.concurrency} sequences"),
            ("weights", f"{p.weight_bytes / GB:8.1f} GB  ({p.weight_dtype}"
                         + (", nominal bytes a value)" if p.nominal_weights else ")")),
            ("KV cache", f"{p.kv_bytes / GB:8.1f} GB  ({p.kv_dtype}, {p.kv_bytes_per_token:g} bytes/token)"),
            ("activations", f"{p.activation_bytes / GB:8.1f} GB  ({p.step_tokens} tokens/step, logits)"),
            ("total", f"{p.total_bytes / GB:8.1f} GB"),
            ("GPUs", f"{out['gpus']} x {gpu_memory / GB:g} GB")]
    if args.fit:
        rows.append(("fits", f"{out['fit_concurrency']} sequences of {p.context_len} tokens "
                             f"in {args.gpus} x {gpu_memory / GB:g} GB"))
    print("\n".join(f"{k:<12} {v}" for k, v in rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    from runtime import configure_logging

    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:
        return _config_error(e)
    if args.command == "plan":
        try:
            return plan(args)
        except ValueError as e:
            return _config_error(e, "plan")
    configure_logging(args.log_level)
    try:
        serve = RUNNERS[args.role](args)
    except ValueError as e:
        return _config_error(e)
    return serve()


def _config_error(e: ValueError, command: str = "serve") -> int:
    print(f"matinee {command}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
