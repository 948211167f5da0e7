"""structlog set-up: JSON lines when stderr is not a terminal, readable console output otherwise.

Context (node, actor) is bound on loggers; a request id is bound per task with `bound(...)`."""
from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.contextvars import bound_contextvars

_configured = False


class _StderrLogger:
    """Writes to whatever sys.stderr is at call time (it may be swapped, e.g. under pytest)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_factory(*args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(level: str | int = "INFO", json: bool | None = None) -> None:
    """Configure structlog once for the process; `json=None` decides from isatty()."""
    global _configured
    if isinstance(level, str):
        level_no = logging.getLevelName(level.upper())
        if not isinstance(level_no, int):
            raise ValueError(f"unknown log level {level!r}")
    else:
        level_no = level
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=_stderr_factory,
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(**context: Any) -> Any:
    """A structlog logger with `context` bound; configures defaults on first use."""
    if not _configured:
        configure_logging()
    return structlog.get_logger().bind(**context)


def bound(**context: Any):
    """Context manager binding e.g. request_id on every log line of the current task."""
    return bound_contextvars(**context)
