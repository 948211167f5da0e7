"""`matinee`, the console script: `matinee serve` runs the OpenAI-compatible server.

With no arguments it serves the default model (SmolLM2) at 127.0.0.1:8000 with every actor in
one process (`--role all`). Its flags come from the config classes' fields (gateway/flags.py).
"""
from __future__ import annotations

import argparse
import sys
from typing import Mapping

from actors.config import EngineConfig
from actors.draft.config import SpeculativeConfig
from actors.engine_node import EngineNodeConfig
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
    ("cluster (--role gateway|engine|draft)", (EngineNodeConfig, GatewayNodeConfig, PoolConfig)),
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
    return p


def main(argv: list[str] | None = None) -> int:
    from runtime import configure_logging

    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:
        return _config_error(e)
    configure_logging(args.log_level)
    try:
        serve = RUNNERS[args.role](args)
    except ValueError as e:
        return _config_error(e)
    return serve()


def _config_error(e: ValueError) -> int:
    print(f"matinee serve: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
