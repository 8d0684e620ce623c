"""Untrusted text, fenced so it cannot pass for the engine's own words.

A model-written summary or a re-read file may carry text shaped like our markers (a
poisoned tool result the summarizer repeated, say). :func:`wrap_untrusted` fences it the
way the DAG engine renders its summaries, with the DAG engine's own defanging
(:func:`stalwart.context.neutralise`): every marker the engine's trusted lines use
(``[stalwart:``, ``<<<``, ``>>>``, ``trust=`` ...) is made inert in any case, and every
line is put behind ``| ``, so nothing inside reaches column 0, closes the fence early or
forges a header. Only the engine writes lines that begin with :data:`MARKER`.
"""

from __future__ import annotations

import re

from stalwart._text import scrub_surrogates
from stalwart.context._render import neutralise

__all__ = ["MARKER", "safe_label", "wrap_untrusted"]

#: How every line the engine itself writes (trusted, never inside a fence) begins.
MARKER = "[stalwart:"

_UNSAFE = re.compile(r"[^A-Za-z0-9._/:@+-]")


def safe_label(label: str) -> str:
    """An untrusted name (a path from a tool call) fit for a trusted line: defanged and
    reduced to ``[A-Za-z0-9._/:@+-]`` (anything else, newlines included, becomes ``_``)."""
    return _UNSAFE.sub("_", neutralise(label))


def wrap_untrusted(text: str, *, kind: str, label: str = "") -> str:
    """``text`` fenced as untrusted ``kind`` (``summary``, ``file``); ``label`` (an id or
    a path) names the fence, reduced to ``[A-Za-z0-9._/:@+-]`` (anything else becomes
    ``_``)."""
    fence = f"untrusted-{kind}" + (f" {safe_label(label)}" if label else "")
    # written after the surrogate guard ran: a lone half (a file read with
    # surrogateescape, a summarizer's text) would stop the request's encoding
    lines = neutralise(scrub_surrogates(text)).splitlines() or [""]
    body = "\n".join(f"| {line}" for line in lines)
    return f"<<<{fence}\n{body}\n{fence}>>>"
