"""Untrusted text shown on a terminal: control characters escaped, so it cannot rewind a
line, move the cursor or forge another line (model output and event values both go
through it); and text made valid Unicode before it is recorded (lone surrogates)."""

from __future__ import annotations

import re

#: characters that would break a line of output (CR rewinds it, ESC starts a terminal
#: sequence, U+2028 ends a line in some terminals)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_TAB = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group(0)
    return _ESCAPES.get(char) or f"\\u{ord(char):04x}"


def escaped(text: str, *, tabs: bool = False) -> str:
    """``text`` with its control characters shown escaped (``\\r``, ``\\u001b``); a tab is
    kept as it is when ``tabs``."""
    return (_CONTROL_BUT_TAB if tabs else _CONTROL).sub(_escape, text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def scrub_surrogates(text: str) -> str:
    """``text`` with each high+low surrogate pair joined into its character and each lone
    half replaced by U+FFFD (what a UTF-16 decoder does), so it encodes as UTF-8 (a
    non-UTF-8 file name from ``os.listdir``, a log cut mid-emoji)."""
    if text.isascii() or _SURROGATE.search(text) is None:  # isascii() is O(1) in CPython
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
