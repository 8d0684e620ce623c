"""The types a reply's values must have, checked where the wires read them.

A wire reads JSON as its API documents it; a value of another type (a list of parts
where text goes, a string where a token count goes) raises :class:`WrongShape`, which the
client reports as a ``malformed`` reply (retryable) without quoting the value. Each check
is one ``isinstance``: they run once per delta.
"""

from __future__ import annotations

import msgspec

#: what decoding a reply's JSON raises: ``DecodeError`` for text that is not JSON,
#: ``RecursionError`` for arrays or objects nested past msgspec's depth limit (about a
#: thousand levels: valid JSON, but no API's shape, and not a dependency error to let out),
#: and ``UnicodeDecodeError`` for a body whose strings are not UTF-8 (msgspec's own)
JSON_ERRORS = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)


class WrongShape(TypeError):
    """A value of a reply is not of the type its API documents (one of the client's shape
    errors, so it becomes a ``malformed`` ProviderError)."""


def text(value: object) -> str:
    """A string (text, thinking, tool-call arguments, a finish reason); absent reads as ""."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise WrongShape(f"expected a string, found {type(value).__name__}")


def label(value: object) -> str | None:
    """A string that may be absent (a tool call's id or name)."""
    if value is None or isinstance(value, str):
        return value
    raise WrongShape(f"expected a string or null, found {type(value).__name__}")


#: the largest count a reply may give: JSON's integers have no bound, an event's do (the
#: log's encoding stops at 2**64 - 1), and a token count past this one is no real count
MAX_NUMBER = 2**53 - 1


def number(value: object) -> int:
    """A whole number in [0, MAX_NUMBER] (a token count, an index); absent reads as 0."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_NUMBER:
        return value
    raise WrongShape(f"expected a whole number in [0, 2**53), found {type(value).__name__}")
