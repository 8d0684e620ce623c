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

import base64
import json
import logging
import re
import sys
import threading
import traceback
from collections.abc import MutableMapping
from typing import Any

import httpx
import structlog

__all__ = [
    "REDACTED",
    "get_logger",
    "hide_secret",
    "hide_url",
    "redact",
    "scrub_secrets",
    "unhide_secret",
    "unhide_url",
    "url_secrets",
]

#: a key naming a secret; ``token`` but not ``tokens`` (``input_tokens`` is a count)
_SECRET_KEYS = re.compile(r"(api[_-]?key|token(?!s)|secret|password|authorization|cookie)", re.I)
#: an API key, a bearer token, or the user info of a URL (``postgresql://app:pw@db``: a
#: dependency's error, now in a traceback's text, may quote one)
_SECRET_VALUES = re.compile(r"(sk-[A-Za-z0-9_\-]{8,}|Bearer\s+\S+|(?<=://)[^/\s@]+(?=@))")
REDACTED = "[redacted]"
#: a value shorter than this is not hidden by its text (it would blank common words)
_MIN_SECRET = 6


class _Secrets:
    """The secrets this process holds (a provider's API key, a webhook's secret header
    value), each with how many holders hide it: a log line never shows one, whatever its
    shape (a gateway's key has no ``sk-`` to match, and a server that echoes it in a
    response header puts it in httpcore's DEBUG trace)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        #: one pattern matching any of them (longest first), None when there are none
        self.pattern: re.Pattern[str] | None = None

    def add(self, value: str) -> None:
        with self.lock:
            self.counts[value] = self.counts.get(value, 0) + 1
            self._compile()

    def discard(self, value: str) -> None:
        with self.lock:
            count = self.counts.get(value)
            if count is None:
                return
            if count > 1:
                self.counts[value] = count - 1
                return
            del self.counts[value]
            self._compile()

    def _compile(self) -> None:
        shown = {form for secret in self.counts for form in _forms(secret)}
        longest_first = sorted(shown, key=len, reverse=True)
        alternatives = "|".join(re.escape(secret) for secret in longest_first)
        self.pattern = re.compile(alternatives) if alternatives else None


def _forms(secret: str) -> set[str]:
    """``secret`` as a log line may show it: as it is, and as a string's repr, a bytes'
    repr and JSON escape it (httpcore's wire trace prints the headers a server echoed
    as bytes: a ``\\`` for each backslash, a ``\\'`` for a quote)."""
    forms = {
        secret,
        repr(secret)[1:-1],
        repr(secret.encode("utf-8", "surrogatepass"))[2:-1],
        json.dumps(secret)[1:-1],
    }
    return {form for form in forms if len(form) >= _MIN_SECRET}


_SECRETS = _Secrets()


def hide_secret(value: str) -> None:
    """Keep ``value`` out of every log line, until as many :func:`unhide_secret` calls
    as there were ``hide_secret`` ones."""
    if len(value) >= _MIN_SECRET:
        _SECRETS.add(value)


def unhide_secret(value: str) -> None:
    """One holder of :func:`hide_secret`'s ``value`` is done with it (a closed client)."""
    _SECRETS.discard(value)


def url_secrets(url: str) -> tuple[str, ...]:
    """What of ``url``'s user info a log line may show, to pass to :func:`hide_secret`:
    its password (its user name when it has none: ``https://TOKEN@host``), and the HTTP
    Basic credential httpx sends for it (base64, which a server may echo back)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:  # no request can be sent to it either
        return ()
    user, password = parsed.username, parsed.password
    if not (user or password):
        return ()
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    return (password or user, basic)


def scrub_secrets(text: str) -> str:
    """``text`` with every secret this process holds, and every secret-looking value (an
    API key, a bearer token, a URL's user info), replaced by ``[redacted]``."""
    known = _SECRETS.pattern
    if known is not None:
        text = known.sub(REDACTED, text)
    return _SECRET_VALUES.sub(REDACTED, text)


def redact(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor: no secret-looking key or value, and no secret this process
    holds, reaches a log line."""
    for key, value in list(event_dict.items()):
        if _SECRET_KEYS.search(key):
            event_dict[key] = REDACTED
        elif isinstance(value, str):
            event_dict[key] = scrub_secrets(value)
    return event_dict


def _traceback_of(info: Any) -> str:
    """An exception (``sys.exc_info()``'s three) as a traceback's text, its secrets
    scrubbed: an exception's text is anyone's (a host's callback quoting a url with its
    token, a dependency quoting a header it refused)."""
    return scrub_secrets("".join(traceback.format_exception(*info)).rstrip("\n"))


class _ScrubbedTraceback(logging.Filter):
    """On each standard library logger of stalwart (and pykka's): a record's traceback
    is made here, its secrets scrubbed (``exc_text``, which a ``Formatter`` prints as it
    is instead of formatting ``exc_info`` itself). ``exc_info`` stays: structlog's
    ``ProcessorFormatter`` (the CLI's) formats it again and redacts that."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is not None and record.exc_text is None:
            record.exc_text = _traceback_of(record.exc_info)
        return True


_SCRUBBED_TRACEBACK = _ScrubbedTraceback()


class Logger:
    """structlog's calls (``log.info("event", key=value)``), sent where the host wants them."""

    __slots__ = ("_name", "_stdlib")

    def __init__(self, name: str) -> None:
        self._name = name
        self._stdlib = logging.getLogger(name)
        if _SCRUBBED_TRACEBACK not in self._stdlib.filters:
            self._stdlib.addFilter(_SCRUBBED_TRACEBACK)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            redact(None, method, fields)
            if method == "exception" and sys.exc_info()[0] is not None:
                fields["exception"] = _traceback_of(sys.exc_info())  # as text, scrubbed
                method = "error"
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
    echoes the request's ``Authorization`` or ``x-api-key`` (or a webhook's secret
    header) would put the key in it, in any shape. Costs nothing unless
    the host turned that trace on (a logger's filters run only for records it emits)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        scrubbed = scrub_secrets(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


# pykka logs an actor's crash, and an exception an ask returns, with its traceback
logging.getLogger("pykka").addFilter(_SCRUBBED_TRACEBACK)

# httpcore logs under these names; a logger's filters do not apply to its children
for _name in ("httpcore.connection", "httpcore.http11", "httpcore.http2", "httpcore.proxy"):
    logging.getLogger(_name).addFilter(_RedactSecretValues())
