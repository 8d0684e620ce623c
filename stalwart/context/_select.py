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
    session: DagSession, tail: int, available: int, relevance: bool, recent_turns: int
) -> tuple[list[Unit], int]:
    """The history units between the system prompt and the tail that fit."""
    units = [
        Unit(*session.spans[root], session.rendered(root)[1], summary_id=root)
        for root in session.roots
    ]
    units += session.units(session.covered, tail)
    if sum(unit.tokens for unit in units) <= available:
        return units, 0
    if relevance:
        return _by_relevance(session, units, available, recent_turns)
    settled = 0
    while settled < len(units) and _depth(session, units[settled]) > 0:
        settled += 1
    fenced = sum(unit.tokens for unit in units[:settled])
    if fenced <= available:
        kept = units[:settled] + _newest(units[settled:], available - fenced)
    else:
        kept = _newest(units[:settled], available)
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
    """The tail with its largest messages cut (marked) until it fits in ``room``."""
    out = list(messages)
    sizes = [estimate_message_tokens(message) for message in out]
    clipped: set[int] = set()
    for _ in range(len(out)):
        over = sum(sizes) - room
        if over <= 0:
            break
        index = max(range(len(out)), key=lambda i: (i not in clipped, sizes[i]))
        if index in clipped:
            break
        message = out[index]
        keep = max(200, len(message.content) - over * 4 - 200)
        if keep >= len(message.content) and not message.images:
            clipped.add(index)
            continue
        cut = len(message.content) - min(keep, len(message.content))
        text = message.content[: len(message.content) - cut] + (
            f"\n[stalwart: {cut} more characters and {len(message.images)} images of this "
            f"message are not shown to fit the context budget; ctx_expand "
            f"id={message.message_id} returns it whole]"
        )
        out[index] = msgspec.structs.replace(message, content=text, images=())
        sizes[index] = estimate_message_tokens(out[index])
        clipped.add(index)
    return out, len(clipped)
