"""`matinee`, the console script: `matinee serve` runs the OpenAI-compatible server.

With no arguments it serves the default model (SmolLM2) at 127.0.0.1:8000 with every actor in
one process (`--role all`), and prints the URL and a curl line once the engine is ready.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys

from gateway.config import ROLES, GatewayConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'1073741824', '1GiB', '512MB', '2g' -> bytes (binary units, as memory budgets are)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB or 536870912)")
    unit = (m.group(2) or "b").lower()[0]
    return int(float(m.group(1)) * {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="matinee", description="An LLM inference server on actors.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default=None,
                   help="HF folder or .gguf file (default: SmolLM2-135M-Instruct)")
    s.add_argument("--served-model-name", default=None, help="the `model` name clients use")
    s.add_argument("--role", choices=ROLES, default="all",
                   help="which part of the system this process runs: all (embedded), gateway, engine or draft")
    http = s.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=int, default=8000)
    http.add_argument("--api-key", default=os.environ.get("MATINEE_API_KEY") or None,
                      help="require `Authorization: Bearer KEY` (default: $MATINEE_API_KEY)")
    http.add_argument("--max-waiting", type=int, default=256,
                      help="requests waiting for their first token before new ones get 429")
    http.add_argument("--max-body-bytes", type=parse_bytes, default=4 << 20)
    http.add_argument("--ping-interval", type=float, default=15.0,
                      help="seconds of silence before a stream gets a `: ping` comment")
    http.add_argument("--read-timeout", type=float, default=30.0,
                      help="seconds a client has to send a request's headers, and then its body")
    eng = s.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    eng.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    eng.add_argument("--kernels", default="auto", choices=("auto", "torch", "cpu", "triton"))
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--kv-cache-memory", type=parse_bytes, default=1 << 30,
                     help="bytes for the KV cache (e.g. 2GiB)")
    eng.add_argument("--num-blocks", type=int, default=None, help="KV pool size exactly")
    eng.add_argument("--no-prefix-caching", action="store_true")
    eng.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                     help="priority: requests' `priority` field orders them (lower first); fcfs refuses it")
    eng.add_argument("--num-threads", type=int, default=None,
                     help="torch threads for the forward pass (default: torch's own choice)")
    eng.add_argument("--log-level", default="INFO")
    spec = s.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=("ngram", "draft", "layerskip"), default=None,
                      help="draft tokens by prompt lookup, a small draft model, or the target's first layers")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="k: tokens drafted per step")
    spec.add_argument("--speculative-model", default=None, help="the draft model (method draft)")
    spec.add_argument("--speculative-draft-layers", type=int, default=None,
                      help="L: the target's first L layers draft (method layerskip)")
    spec.add_argument("--speculative-disable-batch-size", type=_batch_size_or_none, default=None,
                      help='no drafting while more sequences than this are decoding (default "none": the '
                           "controller drafts in a large batch only where a sequence's acceptance pays for it)")
    spec.add_argument("--speculative-draft-node", default=None,
                      help="draft on this draft node (`--role draft --engine-id ID`) instead of in the engine")
    return p


def _batch_size_or_none(value: str) -> int | None:
    if value == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected an integer or "none", got {value!r}') from None


def speculative_kwargs(args: argparse.Namespace) -> dict | None:
    """The engine's `speculative=` dict from the flags (validated by the engine config)."""
    if args.speculative_method is None:
        return None
    out = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
           "disable_batch_size": args.speculative_disable_batch_size}
    if args.speculative_model is not None:
        out["model"] = args.speculative_model
    if args.speculative_draft_layers is not None:
        out["draft_layers"] = args.speculative_draft_layers
    if getattr(args, "speculative_draft_node", None) is not None:
        out["draft_node"] = args.speculative_draft_node
    return out


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, kernels=args.kernels,
                block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                num_blocks=args.num_blocks, enable_prefix_caching=not args.no_prefix_caching,
                scheduling_policy=args.scheduling_policy, num_threads=args.num_threads,
                speculative=speculative_kwargs(args))


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(host=args.host, port=args.port, api_key=args.api_key,
                         served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                         max_body_bytes=args.max_body_bytes, ping_interval_s=args.ping_interval,
                         read_timeout_s=args.read_timeout, role=args.role)


def curl_line(config: GatewayConfig, model: str) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = f" -H 'Authorization: Bearer {config.api_key}'" if config.api_key else ""
    return (f"curl http://{host}:{config.port}/v1/chat/completions "
            f"-H 'Content-Type: application/json'{auth} -d '{body}'")


def serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from actors.config import EngineConfig
    from gateway.app import create_app, server_options
    from gateway.app_keys import STATE
    from gateway.embedded import embedded_launcher
    from runtime import configure_logging

    if args.role != "all":
        print(f"matinee serve: --role {args.role} is not available yet; use --role all",
              file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    try:
        config = gateway_config(args)
        engine_config = EngineConfig(**engine_kwargs(args))
    except ValueError as e:
        print(f"matinee serve: {e}", file=sys.stderr)
        return 2
    app = create_app(config, embedded_launcher(engine_config))

    async def announce(app: web.Application):
        state = app[STATE]

        async def when_ready() -> None:
            await state.ready_event.wait()
            if state.startup_error:
                print(f"matinee: the engine failed to start: {state.startup_error}",
                      file=sys.stderr, flush=True)
                return
            host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
            print(f"\nMatinee is serving {state.model_name} at http://{host}:{config.port}/v1\n"
                  f"Try it:\n  {curl_line(config, state.model_name)}\n", flush=True)

        task = asyncio.create_task(when_ready())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(announce)
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(f"matinee: loading the model; listening on http://{config.host}:{config.port} "
          f"(/ready turns 200 when the engine is up)", flush=True)
    web.run_app(app, host=config.host, port=config.port, print=None, **server_options(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    # The cluster roles (gateway, engine) extend this parser in gateway.roles: their flags, and
    # MATINEE_<FLAG> environment defaults; `--role all` comes back to serve() below.
    from gateway.roles import main as main_with_roles

    return main_with_roles(argv)


if __name__ == "__main__":
    sys.exit(main())
