"""`matinee serve --role gateway|engine|draft`: the cluster roles' flags and their entry points.

Configuration comes from flags, with environment variables as their defaults (what compose
sets); the cluster secret comes only from the environment, never from a flag or a file.
"""

from __future__ import annotations

import argparse
import os
import sys

ENV_PREFIX = "MATINEE_"
SECRET_ENV = "MATINEE_CLUSTER_SECRET"


def add_cluster_args(s: argparse.ArgumentParser) -> None:
    c = s.add_argument_group("cluster (--role gateway|engine|draft)")
    c.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    c.add_argument("--listen-host", default="127.0.0.1", help="the engine node's TCP address for gateways")
    c.add_argument("--listen-port", type=int, default=7100)
    c.add_argument("--advertise", default=None,
                   help="host:port gateways dial (default: this host's name and --listen-port)")
    c.add_argument("--engine-id", default=None,
                   help="the engine's id in the prefix index, or a draft node's id (default: host name and port)")
    c.add_argument("--drain-grace", type=float, default=30.0,
                   help="seconds a stopping engine lets its running requests finish")
    c.add_argument("--registry-ttl", type=float, default=3.0,
                   help="seconds a dead engine stays in the registry")
    c.add_argument("--routing", default="kv", choices=("kv", "least_loaded", "round_robin"))
    c.add_argument("--max-migrations", type=int, default=3,
                   help="how often one request may move to another engine")
    c.add_argument("--index-timeout", type=float, default=0.1,
                   help="seconds a prefix-index lookup may take before routing falls back to load")


def apply_env_defaults(parser: argparse.ArgumentParser, environ=os.environ) -> None:
    """`MATINEE_<DEST>` (e.g. MATINEE_KV_CACHE_MEMORY=2GiB) sets the default of each flag; an
    empty value counts as unset, so compose files may pass `${VAR:-}` through."""
    defaults = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        raw = environ.get(ENV_PREFIX + action.dest.upper(), "")
        if raw == "":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            value = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            value = action.type(raw) if callable(action.type) else raw
            if action.choices is not None and value not in action.choices:
                raise ValueError(f"{ENV_PREFIX}{action.dest.upper()}={raw!r} is not one of {list(action.choices)}")
        defaults[action.dest] = value
    parser.set_defaults(**defaults)


def _secret() -> bytes:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ValueError(f"set {SECRET_ENV} to the cluster secret shared by every node")
    return secret.encode()


def serve_engine(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from actors.config import EngineConfig
    from actors.engine_node import EngineNodeConfig, run_engine_node
    from runtime import configure_logging, run

    configure_logging(args.log_level)
    try:
        node = EngineNodeConfig(secret=_secret(), redis_url=args.redis_url,
                                listen_host=args.listen_host, listen_port=args.listen_port,
                                advertise=args.advertise, engine_id=args.engine_id,
                                drain_grace_s=args.drain_grace, registry_ttl_s=args.registry_ttl)
        engine_config = EngineConfig(**engine_kwargs)
    except ValueError as e:
        print(f"matinee serve: {e}", file=sys.stderr)
        return 2
    return run(run_engine_node(node, engine_config))


def serve_draft(args: argparse.Namespace) -> int:
    """A draft node: the draft worker of every engine started with --speculative-draft-node <its id>."""
    from actors.config import EngineConfig
    from actors.draft.config import SpeculativeConfig
    from actors.draft.draft_service import check_remote_method
    from actors.draft_node import run_draft_node
    from actors.engine_node import EngineNodeConfig
    from gateway.cli import speculative_kwargs
    from runtime import configure_logging, run

    configure_logging(args.log_level)
    try:
        kwargs = speculative_kwargs(args)
        if kwargs is None:
            raise ValueError("--role draft needs --speculative-method (ngram or draft) and, for draft, "
                             "--speculative-model")
        kwargs.pop("draft_node", None)
        spec = SpeculativeConfig.parse(kwargs)
        check_remote_method(spec)
        node = EngineNodeConfig(secret=_secret(), redis_url=args.redis_url, listen_host=args.listen_host,
                                listen_port=args.listen_port, advertise=args.advertise,
                                engine_id=args.engine_id, registry_ttl_s=args.registry_ttl)
        engine = EngineConfig(model=None, dtype=args.dtype, device=args.device, kernels=args.kernels,
                              num_threads=args.num_threads)
    except ValueError as e:
        print(f"matinee serve: {e}", file=sys.stderr)
        return 2
    return run(run_draft_node(node, spec, dtype=engine.resolved_dtype(), kernels=engine.kernels,
                              device=engine.resolved_device(), num_threads=engine.num_threads))


def serve_gateway(args: argparse.Namespace, config) -> int:
    from aiohttp import web

    from gateway.app import server_options
    from gateway.cluster import GatewayNodeConfig, create_cluster_app
    from gateway.engine_pool import PoolConfig
    from runtime import configure_logging

    configure_logging(args.log_level)
    try:
        node = GatewayNodeConfig(secret=_secret(), redis_url=args.redis_url, tokenizer=args.model,
                                 index_timeout_s=args.index_timeout,
                                 pool=PoolConfig(routing=args.routing, max_migrations=args.max_migrations))
    except ValueError as e:
        print(f"matinee serve: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        import asyncio
        loop = asyncio.new_event_loop()
    print(f"matinee gateway listening on http://{config.host}:{config.port} "
          f"(/ready turns 200 once an engine is found)", flush=True)
    web.run_app(create_cluster_app(config, node), host=config.host, port=config.port, print=None,
                loop=loop, **server_options(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway.roles serve --role ...`: the console script's serve, with the roles."""
    from gateway.cli import build_parser, engine_kwargs, gateway_config

    parser = build_parser()
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    add_cluster_args(serve_parser)
    try:
        apply_env_defaults(serve_parser)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"matinee serve: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.role == "engine":
        return serve_engine(args, engine_kwargs(args))
    if args.role == "draft":
        return serve_draft(args)
    if args.role == "gateway":
        try:
            config = gateway_config(args)
        except ValueError as e:
            print(f"matinee serve: {e}", file=sys.stderr)
            return 2
        return serve_gateway(args, config)
    from gateway.cli import serve
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
