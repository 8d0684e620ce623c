"""The last step: the newest turn's largest tool results cut until the request fits.

The layers drop, mask and summarize what is older; nothing they do touches the newest
turn, which can be far larger than the budget on its own (a step with many tool calls,
a model with a small window). A request over the window is refused by the provider and
the turn fails, so what is sent is cut here, after the final repair, when it is still
over the budget: the tool results of the newest user turn are cut to one common length,
the longest found so that the request fits. That is largest first: a result shorter
than that length stays whole, and each longer one keeps the same share of the room
(its head) whatever its place in the turn, so a model that asked for many things at
once still sees the start of every answer rather than losing the earliest ones whole.
The user's message and the model's own calls are never cut; the session's log keeps
every result whole.

A cut result is the engine's trusted line saying how much is shown, then the head of
the result fenced as untrusted (:func:`wrap_untrusted`), so the tool's text cannot
forge that line or close the fence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from stalwart.context._tokens import TokenEstimator
from stalwart.context._types import ContextMessage

from ._transcript import latest_turn
from ._wrap import MARKER, wrap_untrusted

__all__ = ["CUT_PREFIX", "Cut", "cut_text", "fit_newest_turn"]

Messages = tuple[ContextMessage, ...]

#: How a cut tool result begins (the engine's own line; the rest says how much is shown).
CUT_PREFIX = f"{MARKER}cut tool_result]"

_CUT_LINE = (
    CUT_PREFIX + " {shown:,} of the {total:,} characters of this tool result are shown "
    "(its head), {cut:,} are cut to fit the context budget; the session's log keeps it "
    "whole. Call the tool again with arguments that narrow it to read the rest."
)


@dataclass(frozen=True, slots=True)
class Cut:
    """What :func:`fit_newest_turn` cut: the ids of the results, and the characters."""

    ids: frozenset[str] = frozenset()
    chars: int = 0


def _head(content: str, keep: int) -> str:
    """The first ``keep`` characters of ``content``, ended on a whole line when one ends
    in their second half."""
    head = content[:keep]
    end = head.rfind("\n")
    return head[: end + 1] if end >= keep // 2 else head


def cut_text(content: str, keep: int) -> str:
    """``content`` cut to its head of at most ``keep`` characters: the engine's line
    saying how much is shown, then the head fenced as untrusted."""
    head = _head(content, keep)
    line = _CUT_LINE.format(shown=len(head), total=len(content), cut=len(content) - len(head))
    if not head:
        return line
    return line + "\n" + wrap_untrusted(head, kind="tool-result")


def fit_newest_turn(
    messages: Messages, room: int, estimator: TokenEstimator
) -> tuple[Messages, Cut]:
    """``messages`` as they fit ``room`` tokens, with the newest turn's longest tool
    results cut to one length (see the module); unchanged when they fit already, and cut
    as far as they go (every such result to the line alone) when even that is not
    enough."""
    raws = [estimator.raw(message) for message in messages]
    if math.ceil(sum(raws) * estimator.factor) <= room:
        return messages, Cut()
    turn = latest_turn(messages)
    cuttable = [
        index
        for index, message in enumerate(messages)
        if message.role == "tool" and message.turn == turn and message.content
    ]
    if not cuttable:
        return messages, Cut()
    chosen = set(cuttable)
    fixed = sum(raw for index, raw in enumerate(raws) if index not in chosen)

    def cut_at(keep: int) -> dict[int, ContextMessage]:
        """The results cut to ``keep`` characters (those the cut makes shorter)."""
        cut: dict[int, ContextMessage] = {}
        for index in cuttable:
            content = messages[index].content
            if len(content) > keep and len(text := cut_text(content, keep)) < len(content):
                cut[index] = msgspec.structs.replace(messages[index], content=text)
        return cut

    def fits(keep: int) -> bool:
        cut = cut_at(keep)
        total = fixed + sum(
            estimator.raw(cut[index]) if index in cut else raws[index] for index in cuttable
        )
        return math.ceil(total * estimator.factor) <= room

    low, high = 0, max(len(messages[index].content) for index in cuttable)
    while low < high:  # the longest length that fits (a longer head costs no less)
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    cut = cut_at(low)
    out = tuple(cut.get(index, message) for index, message in enumerate(messages))
    shown = sum(len(_head(messages[index].content, low)) for index in cut)
    total = sum(len(messages[index].content) for index in cut)
    ids = frozenset(messages[index].message_id for index in cut)
    return out, Cut(ids=ids, chars=total - shown)
