"""Tool-call ids as each wire accepts them.

A session keeps the ids its models gave (or the Agent's fresh ones), and a fallback may
send them to a provider of another kind: Anthropic accepts only letters, digits, ``_``
and ``-`` (an id such as ``functions.search:0`` from an OpenAI-compatible server is
refused with a 400), OpenAI at most 40 characters. An id a wire would refuse is sent as
a stable stand-in (the same id always gives the same one, so a call and its result stay
paired and a cached prefix stays the same); a valid id goes as it is.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["anthropic_id", "openai_id"]

_ANTHROPIC = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NOT_ANTHROPIC = re.compile(r"[^A-Za-z0-9_-]+")
#: the longest tool-call id OpenAI's chat completions take
OPENAI_ID_MAX = 40


def _digest(call_id: str) -> str:
    return hashlib.blake2b(call_id.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def anthropic_id(call_id: str) -> str:
    """``call_id`` if Anthropic takes it, else its readable part and a digest of it."""
    if _ANTHROPIC.fullmatch(call_id):
        return call_id
    readable = _NOT_ANTHROPIC.sub("_", call_id)[:40]
    return f"{readable}_{_digest(call_id)}" if readable.strip("_") else f"id_{_digest(call_id)}"


def openai_id(call_id: str) -> str:
    """``call_id`` if OpenAI takes it, else its start and a digest of it (40 characters)."""
    if len(call_id) <= OPENAI_ID_MAX:
        return call_id
    return f"{call_id[: OPENAI_ID_MAX - 17]}_{_digest(call_id)}"
