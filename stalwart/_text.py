"""Untrusted text shown on a terminal: control characters escaped, so it cannot rewind a
line, move the cursor or forge another line (model output and event values both go
through it); and text made valid Unicode before it is recorded (lone surrogates)."""

from __future__ import annotations

import re

#: characters that would break a line of output (CR rewinds it, ESC starts a terminal
#: sequence, U+2028 ends a line in some terminals), and the bidirectional embedding,
#: override and isolate controls (U+202A-U+202E, U+2066-U+2069), which reorder what a
#: line shows: a provider name holding U+202E read backwards in a table ("Trojan
#: Source"). The marks legitimate right-to-left text uses (U+200E, U+200F) stay.
_BIDI = "\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{_BIDI}]")
_CONTROL_BUT_TAB = re.compile(f"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029{_BIDI}]")
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
