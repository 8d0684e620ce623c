"""How events and states look on a terminal and as JSON."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import click
import msgspec

from stalwart._text import escaped
from stalwart.events import RecordedEvent, UnknownEvent, event_data

_COLOURS = {"debug": "bright_black", "info": None, "warning": "yellow", "error": "red"}
_MAX_VALUE = 60
_json = msgspec.json.Encoder()
#: what JSON leaves raw in a string and a terminal still acts on: DEL, the C1 controls
#: (U+009B is CSI, as ESC [ is), the line and paragraph separators, and the bidirectional
#: embedding, override and isolate controls (they reorder what a line shows)
_RAW_IN_JSON = re.compile("[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _json_text(value: Any) -> str:
    """``value`` as one line of JSON that a terminal shows as it is: the characters JSON
    leaves raw that would drive a terminal are ``\\uXXXX`` escapes (the same JSON)."""
    text = _json.encode(value).decode()
    if text.isascii() and "\x7f" not in text:  # isascii() is O(1) in CPython
        return text
    return _RAW_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def fmt_ts(ts: float) -> str:
    """UTC time with milliseconds: ``2026-11-22T14:03:05.123Z`` (a time outside what a
    calendar date can show: the number itself)."""
    try:
        stamp = datetime.fromtimestamp(ts, tz=UTC)
    except (ValueError, OverflowError, OSError):
        return f"{ts}"
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else _json.encode(value).decode()
    text = escaped(text)
    if len(text) > _MAX_VALUE:
        text = text[: _MAX_VALUE - 1] + "…"
    if isinstance(value, str) and (" " in text or not text):
        text = '"' + text + '"'
    return text


def event_line(record: RecordedEvent) -> str:
    """One human line: position, time, stream, type, then the fields that say something."""
    event = record.event
    fields = " ".join(
        f"{escaped(key)}={_short(value)}"
        for key, value in event_data(event).items()
        if value not in (None, "", [], {}, ()) and not key.startswith("_raw")
    )
    severity = event.severity
    kind = record.type + (" (unknown type)" if isinstance(event, UnknownEvent) else "")
    # a stream id or an unknown type's tag is some writer's text: it stays on its line
    text = f"{record.position:>8}  {fmt_ts(record.ts)}  {escaped(record.stream)}  {escaped(kind)}"
    if fields:
        text += "  " + fields
    colour = _COLOURS.get(severity)
    return click.style(text, fg=colour) if colour else text


def event_json(record: RecordedEvent) -> str:
    """One JSON object: position, stream, version, type, ts, data."""
    return _json_text(
        {
            "position": record.position,
            "stream": record.stream,
            "version": record.version,
            "type": record.type,
            "ts": record.ts,
            "data": event_data(record.event),
        }
    )


def state_lines(state: Any) -> list[str]:
    """A folded state as aligned ``key  value`` lines."""
    data = msgspec.to_builtins(state)
    width = max((len(k) for k in data), default=0)
    lines = []
    for key, value in data.items():
        if isinstance(value, float) and key.endswith(("_at", "_ts")):
            shown = fmt_ts(value)
        elif isinstance(value, dict | list | tuple):
            shown = _json.encode(value).decode()
        else:
            shown = "-" if value is None else str(value)
        lines.append(f"{key:<{width}}  {escaped(shown)}")
    return lines


def to_json(value: Any) -> str:
    """One line of JSON; a control character in a string (untrusted text) is escaped."""
    return _json_text(value)


def counted(n: int, noun: str) -> str:
    """``1 call``, ``2 calls``: a count with its noun (plural by an ``s``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
