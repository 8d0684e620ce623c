"""The types a reply's values must have, checked where the wires read them.

A wire reads JSON as its API documents it; a value of another type (a list of parts
where text goes, a string where a token count goes) raises :class:`WrongShape`, which the
client reports as a ``malformed`` reply (retryable) without quoting the value. Each check
is one ``isinstance``: they run once per delta.
"""

from __future__ import annotations


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


def number(value: object) -> int:
    """A whole number >= 0 (a token count, an index); absent reads as 0."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise WrongShape(f"expected a whole number >= 0, found {type(value).__name__}")
