"""Untrusted text, fenced so it cannot pass for the engine's own words.

A model-written summary or a re-read file may carry text shaped like our markers (a
poisoned tool result the summarizer repeated, say). :func:`wrap_untrusted` puts it inside
``<untrusted_{kind}>`` tags after defanging, inside the text, every tag of that family
(``<``/``>`` become the single angle quotation marks U+2039/U+203A) and every
``[context engine`` marker (its bracket becomes ``(``), so the region cannot be closed
early and no trusted header can be forged in it.
Only the engine writes the real markers, outside the region.
"""

from __future__ import annotations

import re

__all__ = ["MARKER", "defang", "wrap_untrusted"]

#: How every message the engine itself writes begins (trusted: never inside a region).
MARKER = "[context engine"

_TAG = re.compile(r"<\s*/?\s*untrusted_[a-z_]*[^>]*>?", re.IGNORECASE)
_MARKER = re.compile(r"\[(\s*context\s+engine)", re.IGNORECASE)
_UNSAFE = re.compile(r'[<>"\r\n]')


def defang(text: str) -> str:
    """``text`` with region tags and engine markers made inert (and visibly so)."""
    text = _TAG.sub(lambda m: m.group(0).replace("<", "\u2039").replace(">", "\u203a"), text)
    return _MARKER.sub(r"(\1", text)


def wrap_untrusted(text: str, *, kind: str, label: str = "") -> str:
    """``text`` fenced as untrusted ``kind`` (``summary``, ``file``); ``label`` (an id
    or a path) is defanged too, and quoted on the opening tag with ``<>"`` and line
    breaks replaced."""
    attribute = f' of="{_UNSAFE.sub("_", defang(label))}"' if label else ""
    return f"<untrusted_{kind}{attribute}>\n{defang(text)}\n</untrusted_{kind}>"
