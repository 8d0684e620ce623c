"""The OpenAI Chat Completions wire format (and every server that speaks it)."""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.errors import ProviderError
from stalwart.events import ToolCall

from ._classify import stream_error
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

_json_decode = msgspec.json.decode


def _message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    out: dict[str, Any] = {"role": message.role}
    if message.images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}]
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in message.images]
        out["content"] = parts
    else:
        out["content"] = message.content or (None if message.tool_calls else "")
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return out


class OpenAIWire:
    """Builds requests and reads replies of ``POST {base_url}/chat/completions``."""

    api = "openai"

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + "/chat/completions"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def body(self, model: str, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [_message(m) for m in request.messages],
            "max_tokens": request.max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in request.tools
            ]
        return body

    def stream_decoder(self, provider: str, model: str) -> OpenAIStream:
        return OpenAIStream(provider, model)

    def response(self, data: dict[str, Any]) -> tuple[str, str, tuple[ToolCall, ...], str, Usage]:
        """(text, thinking, tool calls, finish reason, usage) of a non-streamed reply."""
        choice = (data.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        calls = tuple(
            ToolCall(
                id=c.get("id", ""),
                name=(c.get("function") or {}).get("name", ""),
                arguments=(c.get("function") or {}).get("arguments") or "{}",
            )
            for c in message.get("tool_calls") or ()
        )
        usage = data.get("usage") or {}
        return (
            message.get("content") or "",
            message.get("reasoning_content") or message.get("reasoning") or "",
            calls,
            choice.get("finish_reason") or "stop",
            Usage(
                input_tokens=usage.get("prompt_tokens", 0),
                output_tokens=usage.get("completion_tokens", 0),
            ),
        )


class OpenAIStream:
    """Turns ``chat.completion.chunk`` frames into neutral stream events."""

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.done = False
        self._finish = "stop"
        # tool calls sent without ``index`` (some compatible servers send each call
        # whole): a slot per call id
        self._slots: dict[str, int] = {}
        self._last_slot = -1

    def feed(self, frame: SseEvent) -> list[StreamEvent]:
        if frame.data == "[DONE]":
            self.done = True
            return [Done(self._finish)]
        try:
            chunk = _json_decode(frame.data)
        except msgspec.DecodeError:
            raise self._malformed() from None
        if not isinstance(chunk, dict):
            raise self._malformed()
        if "error" in chunk:
            raise self._error(chunk["error"])
        out: list[StreamEvent] = []
        for choice in chunk.get("choices") or ():
            self._choice(choice, out)
        usage = chunk.get("usage")
        if usage:
            out.append(
                Usage(
                    input_tokens=usage.get("prompt_tokens") or 0,
                    output_tokens=usage.get("completion_tokens") or 0,
                )
            )
        return out

    def _choice(self, choice: dict[str, Any], out: list[StreamEvent]) -> None:
        delta = choice.get("delta") or {}
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        if thinking:
            out.append(ThinkingDelta(thinking))
        if delta.get("content"):
            out.append(TextDelta(delta["content"]))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            out.append(
                ToolCallDelta(
                    index=self._slot(call),
                    id=call.get("id"),
                    name=function.get("name"),
                    arguments=function.get("arguments") or "",
                )
            )
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]

    def _slot(self, call: dict[str, Any]) -> int:
        """The call's accumulator slot: its ``index``; without one, a slot per call id
        (in the order the ids came), and a delta without an id continues the last."""
        index = call.get("index")
        if index is not None:
            self._last_slot = int(index)
        elif call.get("id"):
            self._last_slot = self._slots.setdefault(call["id"], len(self._slots))
        return max(self._last_slot, 0)

    def _malformed(self) -> ProviderError:
        return stream_error(
            "malformed",
            "an event-stream frame is not valid JSON",
            provider=self.provider,
            model=self.model,
        )

    def _error(self, error: Any) -> ProviderError:
        del error  # the provider's words stay out of errors and events
        return stream_error(
            "stream_error",
            "the stream reported an error",
            provider=self.provider,
            model=self.model,
        )
