"""The OpenAI Chat Completions wire format (and every server that speaks it)."""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.errors import ProviderError
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
from ._wire_ids import openai_id

_json_decode = msgspec.json.decode


def _message(message: Message) -> dict[str, Any]:
    if message.role == "tool":
        return {
            "role": "tool",
            "tool_call_id": openai_id(message.tool_call_id or ""),
            "content": message.content,
        }
    out: dict[str, Any] = {"role": message.role}
    if message.images:
        parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}]
        parts += [{"type": "image_url", "image_url": {"url": url}} for url in message.images]
        out["content"] = parts
    else:
        out["content"] = message.content or (None if message.tool_calls else "")
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": openai_id(c.id),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in message.tool_calls
        ]
    return out


class OpenAIWire:
    """Builds requests and reads replies of ``POST {base_url}/chat/completions``."""

    api = "openai"
    errors = STREAM_ERRORS  #: how an error reported in a reply is classed

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
        choices = data.get("choices")
        if not choices:  # no answer at all, not an empty one
            raise WrongShape("expected a reply with a choice, found none")
        choice = choices[0]
        message = choice.get("message") or {}
        calls = tuple(
            ToolCall(
                id=text(c.get("id")),
                name=text((c.get("function") or {}).get("name")),
                arguments=text((c.get("function") or {}).get("arguments")) or "{}",
            )
            for c in message.get("tool_calls") or ()
        )
        usage = data.get("usage") or {}
        return (
            text(message.get("content")),
            text(message.get("reasoning_content") or message.get("reasoning")),
            calls,
            text(choice.get("finish_reason")) or "stop",
            Usage(
                input_tokens=number(usage.get("prompt_tokens")),
                output_tokens=number(usage.get("completion_tokens")),
            ),
        )


class OpenAIStream:
    """Turns ``chat.completion.chunk`` frames into neutral stream events."""

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.done = False
        self._finish = "stop"
        # a wire index streams one tool call at a time: the slot it streams now (None:
        # calls sent without ``index``), and each slot's call id ("" until one is sent)
        self._open: dict[int | None, int] = {}
        self._ids: list[str] = []

    def feed(self, frame: SseEvent) -> list[StreamEvent]:
        if frame.data == "[DONE]":
            self.done = True
            return [Done(self._finish)]
        try:
            chunk = _json_decode(frame.data)
        except JSON_ERRORS:
            raise self._malformed() from None
        if not isinstance(chunk, dict):
            raise self._malformed()
        error = chunk.get("error")
        if error:  # some servers send ``"error": null`` in every chunk (Foundry Local)
            raise classify_stream_error(error, provider=self.provider, model=self.model)
        out: list[StreamEvent] = []
        for choice in chunk.get("choices") or ():
            self._choice(choice, out)
        usage = chunk.get("usage")
        if usage:
            out.append(
                Usage(
                    input_tokens=number(usage.get("prompt_tokens")),
                    output_tokens=number(usage.get("completion_tokens")),
                )
            )
        return out

    def _choice(self, choice: dict[str, Any], out: list[StreamEvent]) -> None:
        delta = choice.get("delta") or {}
        thinking = text(delta.get("reasoning_content") or delta.get("reasoning"))
        if thinking:
            out.append(ThinkingDelta(thinking))
        content = text(delta.get("content"))
        if content:
            out.append(TextDelta(content))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            call_id = label(call.get("id"))
            index = call.get("index")
            out.append(
                ToolCallDelta(
                    index=self._slot(None if index is None else number(index), call_id),
                    id=call_id,
                    name=label(function.get("name")),
                    arguments=text(function.get("arguments")),
                )
            )
        finish = text(choice.get("finish_reason"))
        if finish:
            self._finish = finish

    def _slot(self, index: int | None, call_id: str | None) -> int:
        """The call's accumulator slot, in the order the calls came. A wire index streams
        one call at a time: a delta with a new id opens a new slot even on an index already
        taken (Ollama and LiteLLM send every parallel call as index 0); one without an id,
        or with the same id, continues it. Calls sent whole without ``index`` are told
        apart by their ids the same way."""
        slot = self._open.get(index)
        if slot is None or (call_id and self._ids[slot] not in ("", call_id)):
            slot = len(self._ids)
            self._ids.append("")
            self._open[index] = slot
        if call_id:
            self._ids[slot] = call_id
        return slot

    def _malformed(self) -> ProviderError:
        return stream_error(
            "malformed",
            "an event-stream frame is not valid JSON",
            provider=self.provider,
            model=self.model,
        )
