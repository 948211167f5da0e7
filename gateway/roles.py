"""What `matinee serve --role all|engine|prefill|decode|draft|gateway` runs, one function per role.

Each builds its configs from the parsed flags, raising ValueError before anything starts, and
returns the function that serves. The cluster secret comes only from the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Callable

from actors.config import EngineConfig
from actors.draft.config import SpeculativeConfig
from actors.nodes.engine_node import EngineNodeConfig
from actors.kv.transfer import KVTransferConfig
from gateway.cluster import GatewayNodeConfig
from gateway.config import GatewayConfig
from gateway.engine_pool import PoolConfig
from gateway.flags import build, values
from runtime.loop import new_event_loop

SECRET_ENV = "MATINEE_CLUSTER_SECRET"
Serve = Callable[[], int]


def _secret() -> bytes:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ValueError(f"set {SECRET_ENV} to the cluster secret shared by every node")
    return secret.encode()


def speculative_kwargs(args: argparse.Namespace) -> dict | None:
    """The engine's `speculative=` dict (validated by the engine config); None without a method."""
    return values(SpeculativeConfig, args) if args.speculative_method is not None else None


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {**values(EngineConfig, args), "speculative": speculative_kwargs(args)}


def curl_line(config: GatewayConfig, model: str) -> str:
    """A command to paste. It names the key as `$MATINEE_API_KEY`, never its value: this line lands
    in terminals, logs and bug reports."""
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = ' -H "Authorization: Bearer $MATINEE_API_KEY"' if config.api_keys else ""
    return (f"curl http://{host}:{config.port}/v1/chat/completions "
            f"-H 'Content-Type: application/json'{auth} -d '{body}'")


def all_in_one(args: argparse.Namespace) -> Serve:
    """Every actor in this process; prints the URL and a curl line once the engine is ready."""
    config = build(GatewayConfig, args)
    engine_config = EngineConfig(**engine_kwargs(args))
    if engine_config.node_rank > 0:
        return _ranks_only(engine_config)

    def serve() -> int:
        from aiohttp import web

        from gateway.app import create_app, server_options
        from gateway.embedded import embedded_launcher

        app = create_app(config, embedded_launcher(engine_config))
        app.cleanup_ctx.append(_announce(config))
        print(f"matinee: loading the model; listening on http://{config.host}:{config.port} "
              f"(/ready turns 200 when the engine is up)", flush=True)
        web.run_app(app, host=config.host, port=config.port, print=None, loop=new_event_loop(),
                    **server_options(config))
        return 0

    return serve


def _announce(config: GatewayConfig):
    """A cleanup context that prints where the server is, and a curl line, once the engine is up."""
    from gateway.app_keys import STATE

    async def announce(app):
        state = app[STATE]

        async def when_ready() -> None:
            await state.ready_event.wait()
            if state.startup_error:
                print(f"matinee: the engine failed to start: {state.startup_error}",
                      file=sys.stderr, flush=True)
                return
            host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
            keyed = " (with MATINEE_API_KEY set to one of its keys)" if config.api_keys else ""
            print(f"\nMatinee is serving {state.model_name} at http://{host}:{config.port}/v1\n"
                  f"Try it{keyed}:\n  {curl_line(config, state.model_name)}\n", flush=True)

        task = asyncio.create_task(when_ready())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    return announce


def engine(args: argparse.Namespace) -> Serve:
    """An engine node: colocated (`engine`), or one half of a disaggregated pair (`prefill`, `decode`)."""
    from actors.nodes.engine_node import run_engine_node
    from runtime import run

    config = EngineConfig(**engine_kwargs(args))
    if config.node_rank > 0:
        return _ranks_only(config)
    if config.tensor_parallel_size > 1 and args.role != "engine":
        raise ValueError(f"--role {args.role} hands KV blocks between engines: not with --tensor-parallel-size "
                         f"above 1")
    node = build(EngineNodeConfig, args, secret=_secret(), role=args.role)
    transfer = build(KVTransferConfig, args)
    return lambda: run(run_engine_node(node, config, transfer=transfer))


def _ranks_only(config: EngineConfig) -> Serve:
    """A machine of --node-rank above 0: its tensor-parallel ranks alone; node 0 runs the engine."""
    from actors.nodes.engine_ranks import serve_ranks

    return lambda: serve_ranks(config)


def draft(args: argparse.Namespace) -> Serve:
    """A draft node: the draft worker of every engine started with --speculative-draft-node <its id>."""
    from actors.draft.draft_service import check_remote_method
    from actors.nodes.draft_node import run_draft_node
    from runtime import run

    kwargs = speculative_kwargs(args)
    if kwargs is None:
        raise ValueError("--role draft needs --speculative-method (ngram or draft) and, for draft, "
                         "--speculative-model")
    spec = SpeculativeConfig(**{**kwargs, "draft_node": None})
    check_remote_method(spec)
    node = build(EngineNodeConfig, args, secret=_secret())
    engine = EngineConfig(model=None, dtype=args.dtype, device=args.device, kernels=args.kernels,
                          num_threads=args.num_threads)
    return lambda: run(run_draft_node(node, spec, dtype=engine.resolved_dtype(), kernels=engine.kernels,
                                      device=engine.resolved_device(), num_threads=engine.num_threads))


def gateway(args: argparse.Namespace) -> Serve:
    from aiohttp import web

    from gateway.app import server_options
    from gateway.cluster import create_cluster_app

    config = build(GatewayConfig, args)
    if config.batch_dir is not None:
        raise ValueError("--batch-dir is for `matinee serve --role all`; a cluster's gateways keep files and "
                         "batches in the cluster's Redis (--redis-url), shared by all of them")
    node = build(GatewayNodeConfig, args, secret=_secret(), redis_url=args.redis_url, tokenizer=args.model,
                 pool=build(PoolConfig, args))

    def serve() -> int:
        print(f"matinee gateway listening on http://{config.host}:{config.port} "
              f"(/ready turns 200 once an engine is found)", flush=True)
        web.run_app(create_cluster_app(config, node), host=config.host, port=config.port, print=None,
                    loop=new_event_loop(), **server_options(config))
        return 0

    return serve


RUNNERS: dict[str, Callable[[argparse.Namespace], Serve]] = {
    "all": all_in_one, "engine": engine, "prefill": engine, "decode": engine, "draft": draft, "gateway": gateway}
