"""The Anthropic Messages wire format."""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.events import ToolCall

from ._classify import STREAM_ERRORS, classify_stream_error, stream_error
from ._shape import JSON_ERRORS, WrongShape, label, number, text
from ._sse import SseEvent
from ._types import (
    Done,
    Message,
    ProviderRequest,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    Usage,
)
from ._wire_ids import anthropic_id

API_VERSION = "2023-06-01"
_json_decode = msgspec.json.decode
#: an ``overloaded_error`` event is ``overloaded`` (as a 529 is); ``api_error`` and
#: ``timeout_error`` are ``stream_error``, retryable
ERRORS = (("overloaded", "overloaded", True), *STREAM_ERRORS)


def _image(url: str) -> dict[str, Any]:
    if url.startswith("data:") and ";base64," in url:
        media, _, data = url[5:].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _arguments(text: str) -> Any:
    try:
        return _json_decode(text or "{}")
    except JSON_ERRORS:
        return {"_raw": text}


def _blocks(message: Message) -> list[dict[str, Any]]:
    if message.role == "tool":
        return [
            {
                "type": "tool_result",
                "tool_use_id": anthropic_id(message.tool_call_id or ""),
                "content": message.content,
            }
        ]
    blocks: list[dict[str, Any]] = []
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    blocks += [_image(url) for url in message.images]
    blocks += [
        {
            "type": "tool_use",
            "id": anthropic_id(c.id),
            "name": c.name,
            "input": _arguments(c.arguments),
        }
        for c in message.tool_calls
    ]
    return blocks


#: Anthropic allows at most this many ``cache_control`` breakpoints per request.
MAX_BREAKPOINTS = 4
_EPHEMERAL = {"type": "ephemeral"}


def _messages(
    messages: tuple[Message, ...],
) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    """The system (text, or one cached block), and the turns with consecutive same-role
    blocks merged; a message marked ``cache`` puts ``cache_control`` on its last block
    (the first ``MAX_BREAKPOINTS`` marks count)."""
    budget = MAX_BREAKPOINTS
    systems = [m for m in messages if m.role == "system"]
    text = "\n\n".join(m.content for m in systems)
    system: str | list[dict[str, Any]] = text
    if text and any(m.cache for m in systems):
        system = [{"type": "text", "text": text, "cache_control": _EPHEMERAL}]
        budget -= 1
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "system":
            continue
        role = "assistant" if message.role == "assistant" else "user"
        blocks = _blocks(message)
        if message.cache and blocks and budget > 0:
            blocks[-1] = {**blocks[-1], "cache_control": _EPHEMERAL}
            budget -= 1
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": role, "content": blocks})
    return system, turns


def prompt_tokens(usage: dict[str, Any]) -> int:
    """The whole prompt's tokens: Anthropic counts the cached part apart (read from the
    cache, or written to it) from ``input_tokens``; OpenAI's ``prompt_tokens`` includes it."""
    return sum(
        number(usage.get(field))
        for field in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )


class AnthropicWire:
    """Builds requests and reads replies of ``POST {base_url}/v1/messages``."""

    api = "anthropic"
    errors = ERRORS  #: how an error reported in a reply is classed

    def url(self, base_url: str) -> str:
        base = base_url.rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def body(self, model: str, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        system, turns = _messages(request.messages)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": request.max_tokens,
            "messages": turns,
            "stream": stream,
        }
        if system:
            body["system"] = system
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in request.tools
            ]
        return body

    def stream_decoder(self, provider: str, model: str) -> AnthropicStream:
        return AnthropicStream(provider, model)

    def response(self, data: dict[str, Any]) -> tuple[str, str, tuple[ToolCall, ...], str, Usage]:
        """(text, thinking, tool calls, stop reason, usage) of a non-streamed reply."""
        texts, thinking, calls = [], [], []
        for block in data.get("content") or ():
            kind = block.get("type")
            if kind == "text":
                texts.append(text(block.get("text")))
            elif kind == "thinking":
                thinking.append(text(block.get("thinking")))
            elif kind == "tool_use":
                arguments = msgspec.json.encode(block.get("input") or {}).decode()
                calls.append(
                    ToolCall(
                        id=text(block.get("id")), name=text(block.get("name")), arguments=arguments
                    )
                )
        usage = data.get("usage") or {}
        return (
            "".join(texts),
            "".join(thinking),
            tuple(calls),
            text(data.get("stop_reason")) or "end_turn",
            Usage(
                input_tokens=prompt_tokens(usage),
                output_tokens=number(usage.get("output_tokens")),
            ),
        )


class AnthropicStream:
    """Turns Messages stream frames into neutral stream events."""

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.done = False
        self._finish = "end_turn"
        self._tool_index: dict[int, int] = {}

    def feed(self, frame: SseEvent) -> list[StreamEvent]:
        try:
            data = _json_decode(frame.data)
        except JSON_ERRORS:
            raise stream_error(
                "malformed",
                "an event-stream frame is not valid JSON",
                provider=self.provider,
                model=self.model,
            ) from None
        if not isinstance(data, dict):
            raise stream_error(
                "malformed",
                "an event-stream frame is not a JSON object",
                provider=self.provider,
                model=self.model,
            )
        kind = data.get("type") or frame.event
        if kind == "content_block_delta":
            return self._delta(data)
        if kind == "content_block_start":
            return self._start(data)
        if kind == "message_start":
            usage = (data.get("message") or {}).get("usage") or {}
            return [Usage(input_tokens=prompt_tokens(usage))]
        if kind == "message_delta":
            self._finish = text((data.get("delta") or {}).get("stop_reason")) or self._finish
            usage = data.get("usage") or {}
            return [Usage(output_tokens=number(usage.get("output_tokens")))] if usage else []
        if kind == "message_stop":
            self.done = True
            return [Done(self._finish)]
        if kind == "error":
            raise classify_stream_error(
                data.get("error"), provider=self.provider, model=self.model, classes=ERRORS
            )
        return []

    def _start(self, data: dict[str, Any]) -> list[StreamEvent]:
        block = data.get("content_block") or {}
        if block.get("type") == "tool_use":
            index = len(self._tool_index)
            self._tool_index[data.get("index", 0)] = index
            name = label(block.get("name"))
            return [ToolCallDelta(index=index, id=label(block.get("id")), name=name)]
        if block.get("type") == "text":
            started = text(block.get("text"))
            return [TextDelta(started)] if started else []
        return []

    def _delta(self, data: dict[str, Any]) -> list[StreamEvent]:
        """The delta's events; one that carries nothing (an empty text) yields none, so it
        is not taken for activity."""
        delta = data.get("delta") or {}
        kind = delta.get("type")
        if kind == "text_delta":
            piece = text(delta.get("text"))
            return [TextDelta(piece)] if piece else []
        if kind == "thinking_delta":
            piece = text(delta.get("thinking"))
            return [ThinkingDelta(piece)] if piece else []
        if kind == "input_json_delta":
            piece = text(delta.get("partial_json"))
            if not piece:
                return []
            index = self._tool_index.get(data.get("index", 0))
            if index is None:  # not the arguments of any call: a nameless call, if kept
                raise WrongShape("expected a tool_use block to stream arguments to, found none")
            return [ToolCallDelta(index=index, arguments=piece)]
        return []
