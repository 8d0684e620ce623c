"""One neutral shape for requests, replies and stream events, converted at the edge."""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import ToolCall, ToolSpec

__all__ = [
    "Done",
    "Message",
    "ProviderRequest",
    "ProviderResponse",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
]


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """A chat message. Images are URLs or ``data:`` URLs and make a request a vision one.

    ``cache`` marks a prompt-cache breakpoint: the prefix up to and including this message
    is meant to stay the same on the next request (Anthropic: ``cache_control`` on its last
    block; OpenAI caches prefixes by itself and ignores it)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[str, ...] = ()
    cache: bool = False


class ProviderRequest(msgspec.Struct, frozen=True, kw_only=True):
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 1024
    temperature: float | None = None

    @property
    def needs_vision(self) -> bool:
        return any(message.images for message in self.messages)


class TextDelta(msgspec.Struct, frozen=True):
    text: str


class ThinkingDelta(msgspec.Struct, frozen=True):
    text: str


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of the ``index``-th tool call: id and name come first, arguments in parts."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    input_tokens: int = 0
    output_tokens: int = 0


class Done(msgspec.Struct, frozen=True):
    """The terminal event: the stream ended as the provider meant it to."""

    finish_reason: str


StreamEvent = TextDelta | ThinkingDelta | ToolCallDelta | Usage | Done


class ProviderResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A whole reply, streamed or not."""

    provider: str
    model: str
    text: str = ""
    thinking: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    input_tokens: int = 0
    output_tokens: int = 0
