"""What the context engines work on: messages as stored, and the summarizer they call.

A :class:`ContextMessage` is one message exactly as the session recorded it (the
``message:appended`` event), with what the provider shape drops: its id, the turn it
belongs to, thinking blocks and their signatures. Engines never change a stored message;
they choose, summarize and render, and every choice can be undone from the log.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from stalwart.events import ToolCall

__all__ = ["ContextMessage", "Summarizer", "SummaryRequest", "ThinkingBlock"]


class ThinkingBlock(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A reasoning block as the provider returned it; ``signature`` is Anthropic's replay
    signature (None for providers that do not sign)."""

    text: str
    signature: str | None = None
    redacted: bool = False


class ContextMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One stored message. ``message_id`` is unique within a session; ``seq`` is its
    place in the session (0, 1, 2 ...); ``turn`` counts user turns (the n-th user
    message opens turn n).

    Never tracked by the garbage collector (``gc=False``, as :class:`ThinkingBlock`): a
    frozen message holds only strings, numbers and tuples of frozen structs made before
    it, so it is in no reference cycle, and a long session's conversation (an Agent's
    snapshot holds all of it) is not walked by every collection."""

    message_id: str
    seq: int
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    thinking: tuple[ThinkingBlock, ...] = ()
    images: tuple[str, ...] = ()
    turn: int = 0
    ts: float = 0.0


class SummaryRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a summarizer is asked to compress, and the most it may answer with."""

    messages: tuple[ContextMessage, ...]
    max_tokens: int
    depth: int = 0
    instructions: str = ""


class Summarizer(Protocol):
    """Writes a summary (an LLM call through the provider layer, or a deterministic
    stand-in). It may raise; the engine counts that as a summarizer failure."""

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        """The summary text, input tokens spent and output tokens spent."""
        ...
