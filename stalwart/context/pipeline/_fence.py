"""The pipeline engine's cache fence: what was sent before it is sent again unchanged.

A provider's prompt cache serves a request's prefix when it is byte for byte what an
earlier request sent. The layers look at ages (turns, newer results), so left alone they
would reshape old messages on every call: the history window drops a turn, the masker
masks one more result, and the cache misses from there on.

After each call the fence sits after the last message sent. On the next call the
messages behind it are the ones sent last time, and the layers' output counts only for
the messages added since: the fence moves up to the end each time, so inside a long tool
loop every call reads the whole previous request from the cache. What was held is shaped
again (a *cache break*: the layers' output is sent whole, and the provider reads it
uncached from the first message that changed) only for a reason, which the call
records:

- ``new``: no fence yet; ``rebuilt``: the engine was rebuilt from the log, which says
  where the fence was but does not hold the messages behind it;
- ``replay``: the provider changed or the history was rewritten (nothing is cached);
- ``budget``: the budget changed;
- ``late_result``: a tool result came for a call the fence holds with the placeholder
  ``repair`` gave it when it had none (the model must see the real one);
- ``compaction``: layer 8 made a new summary (it replaces what is behind the fence);
- ``step``: the fence has held for ``cache_fence_turns`` user turns, so the window,
  the masks, the thinking cleaner and the restated objective catch up (meanwhile the
  window keeps up to that many turns more, and the objective stays where it was sent);
- ``threshold``: what the fence holds would bring the transcript to the compaction
  threshold where the freshly shaped one stays under it, or past the budget (only past
  the budget when the fresh one's newest turn had to be cut to fit: it is cut under the
  threshold, so that the next steps are held).
"""

from __future__ import annotations

from typing import Literal

from stalwart.context._types import ContextMessage
from stalwart.state import PipelineState

from ._transcript import answered_by

__all__ = [
    "CacheBreak",
    "added_since",
    "breakpoints",
    "cache_break",
    "late_results",
    "over_threshold",
]

CacheBreak = Literal[
    "new", "rebuilt", "replay", "budget", "late_result", "compaction", "step", "threshold"
]

Messages = tuple[ContextMessage, ...]


def added_since(shaped: Messages, original: Messages, fence_input: int) -> Messages:
    """What the layers made (in ``shaped``) of the input that came after the fence
    (``original[fence_input:]``): what a held call sends after the held messages."""
    after = {message.message_id for message in original[fence_input:]}
    return tuple(message for message in shaped if message.message_id in after)


def late_results(held: Messages, added: Messages) -> bool:
    """Whether ``added`` (what the layers made of the messages added since the fence)
    answers a call the fence holds with ``repair``'s placeholder result. Paired by
    position (:func:`answered_by`), not by id alone: a provider that numbers its calls
    per response (``call_0`` every turn) answers a new call with a reused id, not the
    held one."""
    owners = answered_by(held)
    placeholders = {
        (held[owner].message_id, held[index].tool_call_id)
        for index, owner in owners.items()
        if held[index].message_id.startswith("synthetic:")
    }
    if not placeholders:
        return False
    joined = (*held, *added)
    return any(
        index >= len(held)
        and owner < len(held)
        and (joined[owner].message_id, joined[index].tool_call_id) in placeholders
        for index, owner in answered_by(joined).items()
    )


def cache_break(
    state: PipelineState,
    *,
    held: bool,
    replay: bool,
    budget: int,
    late: bool,
    compacted: bool,
    turn: int,
    step: int,
) -> CacheBreak | None:
    """Why this call shapes again what is behind the fence, or None to hold it (the
    threshold is checked after, on the held transcript). ``held``: the engine has the
    messages behind the previous fence in memory (none are needed when it was at 0)."""
    if state.assemblies == 0 or (state.fence == 0 and state.fence_turn == 0):
        return "new"  # no fence before (or no user turn yet)
    if not held and state.fence > 0:
        return "rebuilt"
    if replay:
        return "replay"
    if budget != state.last_budget:
        return "budget"
    if late:
        return "late_result"
    if compacted:
        return "compaction"
    if turn - state.fence_turn >= step:
        return "step"
    return None


def over_threshold(
    held: int, fresh: int, *, limit: float, budget: int, fitted: bool = False
) -> bool:
    """Whether a held transcript of ``held`` tokens must give way to the freshly shaped
    one of ``fresh``: it reaches the compaction ``limit`` where the fresh one stays
    under it, or it is over the budget. (Right after a compaction, rehydration fills the
    fresh one up to the budget: holding it then is no bigger and keeps the cache.)
    ``fitted``: the fresh one is under the limit only because its newest turn was cut
    to fit (see ``_fit``), with room left for the next steps: the held one gives way
    only past the budget (else every step of a long turn would cut it again)."""
    if fitted:
        return held > budget
    return held >= limit and (fresh < limit or held > budget)


def breakpoints(messages: Messages, previous: int) -> tuple[int, ...]:
    """The message indices a request marks ``cache_control`` (Anthropic): the first
    message, the last one the previous request sent when it is held (where that request
    wrote the cache: the provider looks back only so far from a mark), and the last."""
    if not messages:
        return ()
    return tuple(sorted({0, previous - 1, len(messages) - 1} - {-1}))
