"""Which history fits: whole units kept by recency or by relevance, and tail clipping.

A unit is a summary, or one message with the tool results that answer it, so a tool pair
is always kept or dropped together. Recency-first keeps the condensed summaries before
the cache fence whole when they fit (dropping one would break the provider's cached
prefix), then the newest of the rest that fit; only when the fenced summaries alone do
not fit does it drop the oldest of them. Relevance-first ranks every unit by BM25 against the recent
user turns, keeps the best that fit, and puts them back in chronological order.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ._dag import DagSession, Unit
from ._tokens import estimate_message_tokens
from ._types import ContextMessage

__all__ = ["clip_tail", "select_history"]


def select_history(
    session: DagSession,
    tail: int,
    available: int,
    *,
    relevance: bool,
    caching: bool,
    recent_turns: int,
) -> tuple[list[Unit], int]:
    """The history units between the system prompt and the tail that fit, and how many
    were left out. On a caching profile, fenced summaries once left out stay out while
    the fenced set only grows (``session.shed``), so the cached prefix does not flap."""
    units = [
        Unit(*session.spans[root], session.rendered(root)[1], summary_id=root)
        for root in session.roots
    ]
    units += session.units(session.covered, tail)
    if relevance:
        session.shed, session.fenced = 0, ()
        if sum(unit.tokens for unit in units) <= available:
            return units, 0
        return _by_relevance(session, units, available, recent_turns)
    settled = 0
    while settled < len(units) and _depth(session, units[settled]) > 0:
        settled += 1
    ids = tuple(unit.summary_id or "" for unit in units[:settled])
    previous = session.fenced
    sticky = caching and ids[: len(previous)] == previous
    # a rewritten fenced set breaks the cache anyway: leave room for the tail to grow
    # (half of what is available) so the new prefix is not shed again next turn
    room = available if sticky or not caching else available // 2
    shed = min(session.shed, settled) if sticky else 0
    while shed < settled and sum(unit.tokens for unit in units[shed:settled]) > room:
        shed += 1
    session.shed, session.fenced = shed, ids
    fenced = sum(unit.tokens for unit in units[shed:settled])
    kept = units[shed:settled] + _newest(units[settled:], available - fenced)
    return kept, len(units) - len(kept)


def _depth(session: DagSession, unit: Unit) -> int:
    return -1 if unit.summary_id is None else session.nodes[unit.summary_id].depth


def _newest(units: list[Unit], available: int) -> list[Unit]:
    """The newest units that fit, oldest first (stops at the first that does not)."""
    kept: list[Unit] = []
    used = 0
    for unit in reversed(units):
        if used + unit.tokens > available:
            break
        kept.append(unit)
        used += unit.tokens
    kept.reverse()
    return kept


def _by_relevance(
    session: DagSession, units: list[Unit], available: int, recent_turns: int
) -> tuple[list[Unit], int]:
    recent = session.user_positions[-recent_turns:]
    query = "\n".join(session.messages[position].content for position in recent)
    docs: dict[str, Unit] = {}
    for unit in units:
        if unit.summary_id is not None:
            docs[f"s:{unit.summary_id}"] = unit
        else:
            for position in range(unit.start, unit.end):
                docs[f"m:{session.messages[position].message_id}"] = unit
    score: dict[int, float] = {}
    for doc, value in session.index.scores(query, docs).items():
        unit = docs[doc]
        score[id(unit)] = max(score.get(id(unit), 0.0), value)
    ranked = sorted(units, key=lambda unit: (-score.get(id(unit), 0.0), -unit.start))
    kept: list[Unit] = []
    used = 0
    for unit in ranked:
        if used + unit.tokens <= available:
            kept.append(unit)
            used += unit.tokens
    kept.sort(key=lambda unit: (unit.summary_id is None, unit.start))
    return kept, len(units) - len(kept)


def clip_tail(messages: Sequence[ContextMessage], room: int) -> tuple[list[ContextMessage], int]:
    """The tail with its largest messages cut (marked) until it fits in ``room``; when
    cutting is not enough, whole units go, oldest first (the opening user message last).
    Returns the tail and how many messages were cut or left out."""
    out = list(messages)
    sizes = [estimate_message_tokens(message) for message in out]
    clipped: set[int] = set()
    for _ in range(len(out)):
        over = sum(sizes) - room
        if over <= 0:
            return out, len(clipped)
        index = max(range(len(out)), key=lambda i: (i not in clipped, sizes[i]))
        if index in clipped:
            break
        clipped.add(index)
        cut = _cut(out[index], sizes[index] - over)
        if cut is not None:
            out[index] = cut
            sizes[index] = estimate_message_tokens(cut)
    dropped = 0
    while sum(sizes) > room and len(out) > 1:
        start = 1 if out[0].role == "user" and len(out) > 1 else 0
        end = start + 1
        while end < len(out) and out[end].role == "tool":
            end += 1
        del out[start:end], sizes[start:end]
        dropped += end - start
    return out, len(clipped) + dropped


def _cut(message: ContextMessage, target: int) -> ContextMessage | None:
    """``message`` cut to about ``target`` tokens with a marker, or None if it cannot
    get smaller."""
    content = message.content
    marker = (
        "\n[stalwart: {cut} more characters and {images} images of this message are not "
        f"shown to fit the context budget; ctx_expand id={message.message_id} returns it whole]"
    )
    keep = len(content)
    for _ in range(32):
        keep = min(keep, max(40, keep - max(1, keep // 4)))
        text = content[:keep] + marker.format(cut=len(content) - keep, images=len(message.images))
        candidate = msgspec.structs.replace(message, content=text, images=())
        if estimate_message_tokens(candidate) <= target or keep == 40:
            break
    if keep >= len(content) and not message.images:
        return None
    return candidate
