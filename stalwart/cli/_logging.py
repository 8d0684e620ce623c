"""Logging set-up for the command line: the only place stalwart configures structlog."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from stalwart._logs import REDACTED, redact
from stalwart._text import escaped

__all__ = ["REDACTED", "configure_logging", "redact"]


class _Stderr(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (a test's runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # a closed stream: logging's own report, never a crash
            self.handleError(record)


#: the one handler the CLI puts on the root logger (configuring again replaces it)
_HANDLER = _Stderr()
#: the keys whose text is a traceback (or a stack), shown on lines of their own
_TRACEBACKS = ("exception", "stack")


def _escape_controls(
    _: Any, __: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """For a terminal: the text of a line is anyone's (a stream id, a dependency's
    message, an exception's), so its control characters are shown escaped (``\\u001b``)
    and cannot drive the terminal or forge a line; a traceback keeps its line breaks."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = _traceback_shown(value) if key in _TRACEBACKS else escaped(value)
    return event_dict


def _traceback_shown(text: str) -> str:
    return "\n".join(escaped(line, tabs=True) for line in text.split("\n"))


def configure_logging(level: str = "warning", *, json: bool | None = None) -> None:
    """Key-value logs on stderr: coloured console on a terminal, JSON lines otherwise.

    The standard library's loggers (a dependency's: psycopg's pool during a database
    outage, httpx) go the same way, at the same level: one rendered line each, not raw
    multi-line text that ``--log-level`` cannot quiet."""
    as_json = not sys.stderr.isatty() if json is None else json
    # A traceback is plain text made before ``redact`` reads the line: never the frames'
    # local variables (rich's and better-exceptions' renderers, used when installed, show
    # them, and a local may hold an API key), and never dropped (JSON printed a bare
    # ``"exc_info": true`` or a traceback object's repr).
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    )
    # JSON escapes control characters itself; the console renderer writes text as it is
    shown: list[Any] = [redact] if as_json else [redact, _escape_controls]
    stamped: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    traced = structlog.processors.format_exc_info
    number = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *stamped, traced, *shown, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _HANDLER.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamped],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                traced,
                *shown,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    if _HANDLER not in root.handlers:
        root.addHandler(_HANDLER)
    root.setLevel(number)
