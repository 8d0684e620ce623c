"""Logging set-up for the command line: the only place stalwart configures structlog."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from stalwart._logs import REDACTED, redact

__all__ = ["REDACTED", "configure_logging", "redact"]


def configure_logging(level: str = "warning", *, json: bool | None = None) -> None:
    """Key-value logs on stderr: coloured console on a terminal, JSON lines otherwise."""
    as_json = not sys.stderr.isatty() if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
