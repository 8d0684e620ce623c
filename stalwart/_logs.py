"""The library's loggers, and the one rule for what they may say.

A module of stalwart logs with ``log = get_logger(__name__)``. When the host has
configured structlog, the lines go through its configuration. When it has not, they go to
the standard library's ``logging`` under the module's name: a host that configured
``logging`` gets them there, and one that configured nothing sees only WARNING and above
on stderr (``logging``'s last resort), never the library's INFO lines on its own stdout,
which is what structlog's unconfigured default would print. Either way :func:`redact`
keeps secrets out of the line; only the CLI configures anything (``cli/_logging.py``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import MutableMapping
from typing import Any

import httpx
import structlog

__all__ = ["REDACTED", "get_logger", "hide_url", "redact", "unhide_url"]

#: a key naming a secret; ``token`` but not ``tokens`` (``input_tokens`` is a count)
_SECRET_KEYS = re.compile(r"(api[_-]?key|token(?!s)|secret|password|authorization|cookie)", re.I)
#: an API key, a bearer token, or the user info of a URL (``postgresql://app:pw@db``: a
#: dependency's error, now in a traceback's text, may quote one)
_SECRET_VALUES = re.compile(r"(sk-[A-Za-z0-9_\-]{8,}|Bearer\s+\S+|(?<=://)[^/\s@]+(?=@))")
REDACTED = "[redacted]"


def redact(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: no secret-looking key or value reaches a log line."""
    for key, value in list(event_dict.items()):
        if _SECRET_KEYS.search(key):
            event_dict[key] = REDACTED
        elif isinstance(value, str) and _SECRET_VALUES.search(value):
            event_dict[key] = _SECRET_VALUES.sub(REDACTED, value)
    return event_dict


class Logger:
    """structlog's calls (``log.info("event", key=value)``), sent where the host wants them."""

    __slots__ = ("_name", "_stdlib")

    def __init__(self, name: str) -> None:
        self._name = name
        self._stdlib = logging.getLogger(name)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            redact(None, method, fields)
            getattr(structlog.get_logger(self._name), method)(event, **fields)
            return
        stdlib = self._stdlib
        if not stdlib.isEnabledFor(level):
            return
        redact(None, method, fields)
        pairs = " ".join(f"{key}={value!r}" for key, value in fields.items())
        stdlib.log(
            level,
            "%s %s" if pairs else "%s",
            event,
            *((pairs,) if pairs else ()),
            exc_info=method == "exception",
        )

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "exception", event, fields)


def get_logger(name: str) -> Logger:
    """The logger of one module of stalwart (pass ``__name__``)."""
    return Logger(name)


#: urls httpx's request log line shows otherwise (a webhook's: its path holds a token)
_HIDDEN_URLS: dict[str, tuple[str, int]] = {}  # url: (shown as, how many hide it)
_HIDDEN_LOCK = threading.Lock()


def hide_url(url: str, shown: str) -> None:
    """Show ``url`` as ``shown`` in httpx's ``HTTP Request: POST <url> ...`` lines, until
    as many :func:`unhide_url` calls as there were ``hide_url`` ones."""
    with _HIDDEN_LOCK:
        _, count = _HIDDEN_URLS.get(url, (shown, 0))
        _HIDDEN_URLS[url] = (shown, count + 1)


def unhide_url(url: str) -> None:
    """One user of :func:`hide_url`'s ``url`` is done with it (a closed channel): the
    last one's leaving forgets it, so a process that builds channels keeps no list."""
    with _HIDDEN_LOCK:
        entry = _HIDDEN_URLS.get(url)
        if entry is None:
            return
        shown, count = entry
        if count > 1:
            _HIDDEN_URLS[url] = (shown, count - 1)
        else:
            del _HIDDEN_URLS[url]


def _shown_url(url: httpx.URL) -> object:
    hidden = _HIDDEN_URLS.get(str(url))
    if hidden is not None:
        return hidden[0]
    return url.copy_with(userinfo=b"") if url.userinfo else url  # user info: a password


class _HideUrlSecrets(logging.Filter):
    """No secret of a url in httpx's request log line: never its user info (a provider's
    ``base_url`` may carry a password), and a url :func:`hide_url` names as it says. The
    server's reason phrase is its own text (one may echo the request's secret header, or
    hold terminal escapes): the line shows the standard phrase of its status instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(arg, httpx.URL) for arg in args):
            shown = [_shown_url(arg) if isinstance(arg, httpx.URL) else arg for arg in args]
            # 'HTTP Request: %s %s "%s %d %s"': method, url, version, status, reason
            if len(shown) == 5 and isinstance(shown[3], int) and isinstance(shown[4], str):
                shown[4] = httpx.codes.get_reason_phrase(shown[3])
            record.args = tuple(shown)
        return True


logging.getLogger("httpx").addFilter(_HideUrlSecrets())


class _RedactSecretValues(logging.Filter):
    """httpcore's DEBUG wire trace prints the response headers a server sent; one that
    echoes the request's ``Authorization`` would put the key in it. Costs nothing unless
    the host turned that trace on (a logger's filters run only for records it emits)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _SECRET_VALUES.search(message):
            record.msg, record.args = _SECRET_VALUES.sub(REDACTED, message), None
        return True


# httpcore logs under these names; a logger's filters do not apply to its children
for _name in ("httpcore.connection", "httpcore.http11", "httpcore.http2", "httpcore.proxy"):
    logging.getLogger(_name).addFilter(_RedactSecretValues())
