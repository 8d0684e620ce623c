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

A turn of very many steps (150 calls of a tool in one user turn) can be over the budget
with every result cut to its line alone: then, first, the oldest steps of the turn are
left out (an assistant message with the results of its calls, always together), as few
as it takes, never the newest one. The user's message that opened the turn stays, and
the engine's line right after it says how many steps and calls are left out (and of
which tools, by safe label): the pipeline has no recall tool, so the model is told to
call the tools again for what it needs of them.

Behind a cache fence, a request that must be cut is cut to fit under the compaction
threshold where it can (``target``), not the budget: the next steps of the turn then go
out behind the fence, read from the provider's cache, until they fill the budget, rather
than each one pushing the request over it and the whole turn being cut (and written to
the cache) again.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import msgspec

from stalwart.context._tokens import TokenEstimator
from stalwart.context._types import ContextMessage

from ._transcript import latest_turn
from ._wrap import MARKER, safe_label, wrap_untrusted

__all__ = [
    "CUT_PREFIX",
    "LEFT_OUT_ID",
    "LEFT_OUT_PREFIX",
    "Cut",
    "cut_text",
    "cut_to_lines",
    "fit_newest_turn",
    "head_on_line",
]

Messages = tuple[ContextMessage, ...]

#: How a cut tool result begins (the engine's own line; the rest says how much is shown).
CUT_PREFIX = f"{MARKER}cut tool_result]"

_CUT_LINE = (
    CUT_PREFIX + " {shown:,} of the {total:,} characters of this tool result are shown "
    "(its head), {cut:,} are cut to fit the context budget; the session's log keeps it "
    "whole. Call the tool again with arguments that narrow it to read the rest."
)


#: The message id of the engine's line saying which steps of the newest turn are left out.
LEFT_OUT_ID = "pipeline-left-out"
#: How that line begins.
LEFT_OUT_PREFIX = f"{MARKER}left_out tool_steps]"

_LEFT_OUT_LINE = (
    LEFT_OUT_PREFIX + " The {steps:,} oldest tool steps of this turn ({calls:,} tool calls "
    "and their results{tools}) are left out to fit the context budget; the session's log "
    "keeps them. The newer steps follow. Call the tools again to read what you need of "
    "what they returned."
)
#: At most this many tools are named in that line (the rest are counted).
_NAMED_TOOLS = 10


@dataclass(frozen=True, slots=True)
class Cut:
    """What :func:`fit_newest_turn` cut: the ids of the results, and the characters;
    ``steps``: how many of the newest turn's oldest steps it left out."""

    ids: frozenset[str] = frozenset()
    chars: int = 0
    steps: int = 0


def head_on_line(content: str, keep: int) -> str:
    """The first ``keep`` characters of ``content``, ended on a whole line when one ends
    in their second half."""
    head = content[:keep]
    end = head.rfind("\n")
    return head[: end + 1] if end >= keep // 2 else head


def cut_text(content: str, keep: int) -> str:
    """``content`` cut to its head of at most ``keep`` characters: the engine's line
    saying how much is shown, then the head fenced as untrusted."""
    head = head_on_line(content, keep)
    line = _CUT_LINE.format(shown=len(head), total=len(content), cut=len(content) - len(head))
    if not head:
        return line
    return line + "\n" + wrap_untrusted(head, kind="tool-result")


def _cuttable(messages: Messages) -> list[int]:
    """The indices of the newest turn's tool results with text (what may be cut)."""
    turn = latest_turn(messages)
    return [
        index
        for index, message in enumerate(messages)
        if message.role == "tool" and message.turn == turn and message.content
    ]


def _at_line(message: ContextMessage) -> ContextMessage:
    """A tool result cut to the engine's line alone (unchanged when that is not shorter)."""
    text = cut_text(message.content, 0)
    if len(text) < len(message.content):
        return msgspec.structs.replace(message, content=text)
    return message


def cut_to_lines(messages: Messages) -> Messages:
    """``messages`` with every tool result of the newest turn cut to its line alone: the
    least the cut of :func:`fit_newest_turn` can make of them without leaving steps out."""
    cuttable = set(_cuttable(messages))
    return tuple(
        _at_line(message) if index in cuttable else message
        for index, message in enumerate(messages)
    )


def _steps(messages: Messages) -> tuple[int, list[int]] | None:
    """The index of the user message that opened the newest turn, and where each step
    after it begins (an assistant message; the tool results after it belong to it)."""
    opener = next(
        (index for index in range(len(messages) - 1, -1, -1) if messages[index].role == "user"),
        None,
    )
    if opener is None:
        return None
    starts = [index for index in range(opener + 1, len(messages)) if messages[index].role != "tool"]
    return opener, starts


def _left_out_line(opener: ContextMessage, steps: int, calls: Counter[str]) -> ContextMessage:
    """The engine's line saying how many steps and calls are left out, and of which tools."""
    named = [f"{safe_label(name)} x{count}" for name, count in calls.most_common(_NAMED_TOOLS)]
    more = len(calls) - len(named)
    tools = f"; tools: {', '.join(named)}" + (f" and {more} more" if more > 0 else "")
    return ContextMessage(
        message_id=LEFT_OUT_ID,
        seq=opener.seq,
        role="user",
        content=_LEFT_OUT_LINE.format(
            steps=steps, calls=calls.total(), tools=tools if named else ""
        ),
        turn=opener.turn,
    )


def _leave_out_steps(
    messages: Messages, room: int, estimator: TokenEstimator
) -> tuple[Messages, int]:
    """``messages`` without the fewest oldest steps of the newest turn that make them fit
    ``room`` with every result cut to its line (all but the newest step when none is
    enough), the engine's line saying so after the user's message, and how many steps
    that is; unchanged when they fit without."""
    floors = [estimator.raw(message) for message in cut_to_lines(messages)]
    total = sum(floors)
    found = _steps(messages)
    if math.ceil(total * estimator.factor) <= room or found is None or len(found[1]) < 2:
        return messages, 0
    opener, starts = found
    calls: Counter[str] = Counter()
    steps = 0
    while steps < len(starts) - 1:  # the newest step always stays
        start, end = starts[steps], starts[steps + 1]
        steps += 1
        total -= sum(floors[start:end])
        calls.update(call.name for call in messages[start].tool_calls)
        line = _left_out_line(messages[opener], steps, calls)
        if math.ceil((total + estimator.raw(line)) * estimator.factor) <= room:
            break
    before = messages[: starts[0]]  # up to the user's message that opened the turn
    return (*before, line, *messages[starts[steps] :]), steps


def fit_newest_turn(
    messages: Messages, room: int, estimator: TokenEstimator, *, target: int | None = None
) -> tuple[Messages, Cut]:
    """``messages`` as they fit ``room`` tokens: the newest turn's longest tool results
    cut to one length (see the module), after its oldest steps are left out when even
    every result cut to its line is not enough; unchanged when they fit already, and cut
    as far as they go (all but the newest step left out, every result of it cut to its
    line) when even that is not enough.

    ``target`` (at most ``room``): what messages over ``room`` are fitted to, when they
    can be: below ``room``, so the next steps of the turn fit behind the cache fence
    (sent as they were, read from the provider's cache) before it is cut again."""
    if _tokens(messages, estimator) <= room:
        return messages, Cut()
    if target is not None and target < room:
        out, cut = _fit(messages, target, estimator)
        if _tokens(out, estimator) <= target:
            return out, cut
    return _fit(messages, room, estimator)


def _tokens(messages: Messages, estimator: TokenEstimator) -> int:
    return math.ceil(sum(estimator.raw(message) for message in messages) * estimator.factor)


def _fit(messages: Messages, room: int, estimator: TokenEstimator) -> tuple[Messages, Cut]:
    """``messages`` with the oldest steps of the newest turn left out and its results
    cut as far as it takes to fit ``room`` (see :func:`fit_newest_turn`)."""
    messages, steps = _leave_out_steps(messages, room, estimator)
    out, cut = _cut_results(messages, room, estimator)
    return out, Cut(ids=cut.ids, chars=cut.chars, steps=steps)


def _cut_results(messages: Messages, room: int, estimator: TokenEstimator) -> tuple[Messages, Cut]:
    """``messages`` with the newest turn's tool results longer than one common length
    cut to it, the longest with which they fit ``room`` (to the line alone when none)."""
    raws = [estimator.raw(message) for message in messages]
    if math.ceil(sum(raws) * estimator.factor) <= room:
        return messages, Cut()
    cuttable = _cuttable(messages)
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
    shown = sum(len(head_on_line(messages[index].content, low)) for index in cut)
    total = sum(len(messages[index].content) for index in cut)
    ids = frozenset(messages[index].message_id for index in cut)
    return out, Cut(ids=ids, chars=total - shown)
