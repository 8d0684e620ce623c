"""The fake provider's side of both wires: event-stream frames and whole JSON replies.

A renderer is made per request; it keeps what the wire needs to stay well formed (the
Anthropic content block that is open, the OpenAI completion id) so a script can stop
anywhere and what was sent before is still exactly what a real provider sends.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from ._script import Answer, FakeToolCall

__all__ = ["AnthropicFrames", "Frames", "OpenAIFrames", "error_body", "frames_for"]


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _call_id(call: FakeToolCall, index: int, prefix: str) -> str:
    return call.id or f"{prefix}_{index:04d}"


def _input(call: FakeToolCall) -> Any:
    """A tool call's input as an object (malformed argument text is kept under ``_raw``)."""
    try:
        return json.loads(call.arguments_text() or "{}")
    except ValueError:
        return {"_raw": call.arguments_text()}


class Frames(Protocol):
    """Renders one streamed reply, piece by piece."""

    def open(self, input_tokens: int) -> bytes: ...
    def thinking(self, text: str) -> bytes: ...
    def text(self, text: str) -> bytes: ...
    def tool_calls(self, calls: tuple[FakeToolCall, ...]) -> bytes: ...
    def close(self, finish: str | None, input_tokens: int, output_tokens: int) -> bytes: ...
    def error(self, error_type: str) -> bytes: ...
    def truncated(self) -> bytes: ...
    def complete(self, step: Answer, output_tokens: int) -> dict[str, Any]: ...


class OpenAIFrames:
    """``chat.completion.chunk`` frames, ending in a usage chunk and ``[DONE]``."""

    def __init__(self, model: str, request_id: str) -> None:
        self.model = model
        self.id = f"chatcmpl-{request_id}"

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return _sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "model": self.model,
                "choices": [choice],
            }
        )

    def open(self, input_tokens: int) -> bytes:
        del input_tokens  # OpenAI reports usage at the end
        return self._chunk({"role": "assistant", "content": ""})

    def thinking(self, text: str) -> bytes:
        return self._chunk({"reasoning_content": text})

    def text(self, text: str) -> bytes:
        return self._chunk({"content": text})

    def tool_calls(self, calls: tuple[FakeToolCall, ...]) -> bytes:
        out = b""
        for index, call in enumerate(calls):
            head = {
                "index": index,
                "id": _call_id(call, index, "call"),
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            out += self._chunk({"tool_calls": [head]})
            arguments = call.arguments_text()
            middle = len(arguments) // 2  # arguments arrive in parts, as they really do
            for part in (arguments[:middle], arguments[middle:]):
                if part:
                    piece = {"index": index, "function": {"arguments": part}}
                    out += self._chunk({"tool_calls": [piece]})
        return out

    def close(self, finish: str | None, input_tokens: int, output_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        }
        tail = {"id": self.id, "object": "chat.completion.chunk", "choices": [], "usage": usage}
        return self._chunk({}, finish or "stop") + _sse(tail) + b"data: [DONE]\n\n"

    def error(self, error_type: str) -> bytes:
        return _sse({"error": {"message": "The server had an error.", "type": error_type}})

    def truncated(self) -> bytes:
        return b'data: {"id":"' + self.id.encode() + b'","choices":[{"index":0,"delta":{"con\n\n'

    def complete(self, step: Answer, output_tokens: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": step.text or None}
        if step.thinking:
            message["reasoning_content"] = step.thinking
        if step.tool_calls:
            message["tool_calls"] = [
                {
                    "id": _call_id(call, index, "call"),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_text()},
                }
                for index, call in enumerate(step.tool_calls)
            ]
        finish = step.finish_reason or ("tool_calls" if step.tool_calls else "stop")
        return {
            "id": self.id,
            "object": "chat.completion",
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": step.input_tokens,
                "completion_tokens": output_tokens,
                "total_tokens": step.input_tokens + output_tokens,
            },
        }


class AnthropicFrames:
    """Messages stream events: message_start, content blocks, message_delta, message_stop."""

    def __init__(self, model: str, request_id: str) -> None:
        self.model = model
        self.id = f"msg_{request_id}"
        self._index = -1
        self._open: str | None = None

    def _block(self, kind: str, block: dict[str, Any]) -> bytes:
        """Closes the open block unless it is of ``kind``; opens a new one if needed."""
        if self._open == kind:
            return b""
        out = self._stop_block()
        self._index += 1
        self._open = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + _sse(start, "content_block_start")

    def _stop_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        stop = {"type": "content_block_stop", "index": self._index}
        return _sse(stop, "content_block_stop")

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return _sse(body, "content_block_delta")

    def open(self, input_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1},
        }
        return _sse({"type": "message_start", "message": message}, "message_start") + _sse(
            {"type": "ping"}, "ping"
        )

    def thinking(self, text: str) -> bytes:
        head = self._block("thinking", {"type": "thinking", "thinking": ""})
        return head + self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> bytes:
        head = self._block("text", {"type": "text", "text": ""})
        return head + self._delta({"type": "text_delta", "text": text})

    def tool_calls(self, calls: tuple[FakeToolCall, ...]) -> bytes:
        out = b""
        for index, call in enumerate(calls):
            block = {"type": "tool_use", "id": _call_id(call, index, "toolu"), "name": call.name}
            out += self._block("tool_use", {**block, "input": {}})
            arguments = call.arguments_text()
            middle = len(arguments) // 2
            for part in (arguments[:middle], arguments[middle:]):
                if part:
                    out += self._delta({"type": "input_json_delta", "partial_json": part})
            out += self._stop_block()
        return out

    def close(self, finish: str | None, input_tokens: int, output_tokens: int) -> bytes:
        del input_tokens  # Anthropic reports it in message_start
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": finish or "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        }
        return (
            self._stop_block()
            + _sse(delta, "message_delta")
            + _sse({"type": "message_stop"}, "message_stop")
        )

    def error(self, error_type: str) -> bytes:
        body = {"type": "error", "error": {"type": error_type, "message": "Overloaded"}}
        return _sse(body, "error")

    def truncated(self) -> bytes:
        return b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"ty\n\n'

    def complete(self, step: Answer, output_tokens: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if step.thinking:
            content.append({"type": "thinking", "thinking": step.thinking, "signature": "fake"})
        if step.text:
            content.append({"type": "text", "text": step.text})
        for index, call in enumerate(step.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": _call_id(call, index, "toolu"),
                    "name": call.name,
                    "input": _input(call),
                }
            )
        stop = step.finish_reason or ("tool_use" if step.tool_calls else "end_turn")
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "usage": {"input_tokens": step.input_tokens, "output_tokens": output_tokens},
        }


def frames_for(api: str, model: str, request_id: str) -> Frames:
    if api == "anthropic":
        return AnthropicFrames(model, request_id)
    return OpenAIFrames(model, request_id)


_OPENAI_ERRORS = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "model_not_found",
    429: "rate_limit_exceeded",
}
_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(api: str, status: int, error_type: str | None) -> bytes:
    """The error body a real provider sends for ``status``."""
    if api == "anthropic":
        kind = error_type or _ANTHROPIC_ERRORS.get(status, "api_error")
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": kind, "message": f"fake provider: {kind}"},
        }
    else:
        kind = error_type or _OPENAI_ERRORS.get(status, "server_error")
        body = {
            "error": {
                "message": f"fake provider: {kind}",
                "type": kind,
                "code": kind if status < 500 else None,
            }
        }
    return json.dumps(body).encode()
