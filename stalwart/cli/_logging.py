"""Logging set-up for the command line: the only place stalwart configures structlog."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

#: a key naming a secret; ``token`` but not ``tokens`` (``input_tokens`` is a count)
_SECRET_KEYS = re.compile(r"(api[_-]?key|token(?!s)|secret|password|authorization|cookie)", re.I)
_SECRET_VALUES = re.compile(r"(sk-[A-Za-z0-9_\-]{8,}|Bearer\s+\S+)")
REDACTED = "[redacted]"


def redact(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: no secret-looking key or value reaches a log line."""
    for key, value in list(event_dict.items()):
        if _SECRET_KEYS.search(key):
            event_dict[key] = REDACTED
        elif isinstance(value, str) and _SECRET_VALUES.search(value):
            event_dict[key] = _SECRET_VALUES.sub(REDACTED, value)
    return event_dict


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
