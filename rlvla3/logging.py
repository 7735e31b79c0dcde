"""structlog set-up, done inside each process after it starts (a cached logger does not survive
spawn): key=value lines on a terminal, one JSON object per line with ``--log-json``."""

from __future__ import annotations

import logging
import os
import sys

import structlog

_ENV_JSON = "RLVLA3_LOG_JSON"
_ENV_LEVEL = "RLVLA3_LOG_LEVEL"


def configure(json: bool | None = None, level: str | None = None, **context: object) -> None:
    """Configure structlog for this process; ``context`` is bound to every line (role, pid)."""
    if json is None:
        json = os.environ.get(_ENV_JSON, "") == "1"
    level = (level or os.environ.get(_ENV_LEVEL) or "info").upper()
    os.environ[_ENV_JSON] = "1" if json else "0"  # children inherit the choice
    os.environ[_ENV_LEVEL] = level
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)
