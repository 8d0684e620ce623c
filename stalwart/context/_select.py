"""Which history fits: whole units kept by recency or by relevance, and tail clipping.

A unit is a summary, or one message with the tool results that answer it, so a tool pair
is always kept or dropped together. Recency-first keeps the condensed summaries first
(the cached prefix; when they do not all fit, the newest of them go, so what stays is
still the same prefix), then the newest of the rest that fit. Relevance-first ranks
every unit by BM25 against the recent user turns, keeps the best that fit, and puts them
back in chronological order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import msgspec

from ._dag import DagSession, Unit
from ._tokens import estimate_message_tokens
from ._types import ContextMessage

__all__ = ["clip_tail", "cut_message", "select_history"]


def select_history(
    session: DagSession,
    tail: int,
    available: int,
    *,
    relevance: bool,
    recent_turns: int,
) -> tuple[list[Unit], int, int]:
    """The history units between the system prompt and the tail that fit, how many were
    left out, and how many of the kept ones are fenced (cache-stable) summaries.

    Recency-first keeps the condensed summaries (depth 1 and up, the oldest history)
    first, leaving out the newest of them when they do not all fit, then the newest of
    the rest. The fence covers only the fenced summaries that fit in half of what was
    available, so the tail can grow to twice its size before the cached prefix has to
    change."""
    units = [
        Unit(*session.spans[root], session.rendered(root)[1], summary_id=root)
        for root in session.roots
    ]
    units += session.units(session.covered, tail)
    if relevance:
        if sum(unit.tokens for unit in units) <= available:
            return units, 0, 0
        kept, evicted = _by_relevance(session, units, available, recent_turns)
        return kept, evicted, 0
    settled = 0
    while settled < len(units) and _depth(session, units[settled]) > 0:
        settled += 1
    kept, used = _oldest(units[:settled], available)
    fence, _ = _oldest(kept, available // 2)
    kept += _newest(units[settled:], available - used)
    return kept, len(units) - len(kept), len(fence)


def _oldest(units: list[Unit], available: int) -> tuple[list[Unit], int]:
    """The oldest units that fit (stops at the first that does not), and their tokens."""
    kept: list[Unit] = []
    used = 0
    for unit in units:
        if used + unit.tokens > available:
            break
        kept.append(unit)
        used += unit.tokens
    return kept, used


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
        cut = cut_message(out[index], sizes[index] - over)
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


#: a message id shown as it is in the engine's marker line; any other is shown quoted
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.:@<>/+=-]{1,256}")


def _expand_id(message_id: str) -> str:
    """``message_id`` as the marker shows it for ``ctx_expand``: as it is when plain, else
    as a JSON string (a host's id, an email's Message-ID say, with a newline or a bracket
    in it cannot end the engine's line or start a forged one)."""
    if _PLAIN_ID.fullmatch(message_id):
        return message_id
    return json.dumps(message_id)


def cut_message(message: ContextMessage, target: int) -> ContextMessage | None:
    """``message`` cut to about ``target`` tokens with a marker, or None if it cannot
    get smaller. Its text (the content and each tool call's arguments) is capped at one
    length, so the longest parts shrink first; its images go."""
    content = message.content
    calls = message.tool_calls
    texts = [content, *(call.arguments for call in calls)]
    shown_id = _expand_id(message.message_id)

    def marker(cut: int) -> str:
        return (
            f"\n[stalwart: {cut} more characters and {len(message.images)} images of this "
            f"message are not shown to fit the context budget; ctx_expand id={shown_id} "
            "returns it whole]"
        )

    keep = max(map(len, texts))
    for _ in range(32):
        keep = min(keep, max(40, keep - max(1, keep // 4)))
        cut = sum(max(0, len(text) - keep) for text in texts)
        text = content[:keep] + marker(cut)
        shorter = tuple(
            msgspec.structs.replace(call, arguments=call.arguments[:keep])
            if len(call.arguments) > keep
            else call
            for call in calls
        )
        candidate = msgspec.structs.replace(message, content=text, tool_calls=shorter, images=())
        if estimate_message_tokens(candidate) <= target or keep == 40:
            break
    if not cut and not message.images:
        return None
    return candidate
