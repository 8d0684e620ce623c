"""Reading transcripts: OpenAI-style chat messages or Anthropic content blocks.

Accepts a JSON array or JSON Lines of messages ``{role, content, tool_calls,
tool_call_id}`` (content a string or a list of parts), or Anthropic messages whose
content is a list of ``text`` / ``image`` / ``tool_use`` / ``tool_result`` / ``thinking``
blocks; a user message carrying tool results becomes one ``tool`` message per result
(then the user's own text, if any). Optional ``id`` and ``ts`` fields are kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

from stalwart._text import scrub_surrogates
from stalwart.errors import StalwartError
from stalwart.events import MessageAppended, RecordedEvent, ToolCall

from ._types import ContextMessage

__all__ = [
    "SessionMessages",
    "TranscriptError",
    "messages_from_records",
    "parse_transcript",
    "read_transcript",
]

_ROLES = ("system", "user", "assistant", "tool")


class TranscriptError(StalwartError):
    """A transcript that cannot be read; the message says where."""


def read_transcript(text: str, *, source: str = "transcript") -> list[ContextMessage]:
    """Messages from a JSON array or JSON Lines text."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except ValueError as exc:
            raise TranscriptError(f"{source} is not JSON or JSON Lines: {exc}") from None
    else:
        items = list(_json_lines(text, source))
    return parse_transcript(items, source=source)


def _json_lines(text: str, source: str) -> Iterator[Any]:
    """The values of JSON Lines text. Lines end at ``\\n`` only (and ``\\r\\n``): JSON
    strings may hold U+2028, U+0085 and the other breaks ``str.splitlines`` splits at."""
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError as exc:
            raise TranscriptError(
                f"{source} is not JSON or JSON Lines: line {number}: {exc}"
            ) from None


def parse_transcript(items: Iterable[Any], *, source: str = "transcript") -> list[ContextMessage]:
    """Messages from already-parsed items, numbered in order, turns counted."""
    out: list[ContextMessage] = []
    turn = 0
    for index, given in enumerate(items):
        item = _scrubbed(given)
        if not isinstance(item, dict) or item.get("role") not in _ROLES:
            raise TranscriptError(
                f"{source}: item {index} must be an object with a role in {list(_ROLES)}"
            )
        for part, fields in enumerate(_fields(item, f"{source}: item {index}")):
            if fields["role"] == "user":
                turn += 1
            base = str(item.get("id") or f"m{index}")
            fields.update(
                message_id=base if part == 0 else f"{base}.{part}",
                seq=len(out),
                turn=turn,
                ts=_ts(item.get("ts"), source, index),
            )
            try:  # a field of the wrong type (a numeric tool_call_id, say) is named
                out.append(msgspec.convert(fields, ContextMessage))
            except msgspec.ValidationError as exc:
                raise TranscriptError(f"{source}: item {index}: {exc}") from None
    return out


def _ts(value: Any, source: str, index: int) -> float:
    """A message's ``ts`` (unix seconds; absent: 0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TranscriptError(f"{source}: item {index}: ts must be a number (unix seconds)")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise TranscriptError(f"{source}: item {index}: ts must be a finite number")
    return seconds


def _scrubbed(value: Any) -> Any:
    """``value`` with every string made valid Unicode: a surrogate pair JSON escaped as
    two ``\\u`` escapes becomes its character, a lone surrogate (a log cut mid-emoji)
    becomes U+FFFD, so the messages can be stored and printed."""
    if isinstance(value, str):
        return scrub_surrogates(value)
    if isinstance(value, dict):
        return {_scrubbed(key): _scrubbed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrubbed(item) for item in value]
    return value


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(
            _text(part.get("text")) if isinstance(part, dict) else str(part) for part in value
        )
    return json.dumps(value, ensure_ascii=False)


def _objects(value: Any, where: str, what: str) -> list[dict[str, Any]]:
    """``value`` (absent: empty) as the list of objects ``what`` must be."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise TranscriptError(f"{where}: {what} must be a list of objects")
    return value


def _object(value: Any, where: str, what: str) -> dict[str, Any]:
    """``value`` (absent: empty) as the object ``what`` must be."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TranscriptError(f"{where}: {what} must be an object")
    return value


def _images(parts: list[Any], where: str) -> tuple[str, ...]:
    found: list[str] = []
    for part in parts:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "image_url":
            url = part.get("image_url")
            found.append(url.get("url", "") if isinstance(url, dict) else str(url))
        elif part.get("type") == "image":
            src = _object(part.get("source"), where, "an image's source")
            if src.get("type") == "base64":
                found.append(f"data:{src.get('media_type')};base64,{src.get('data')}")
            else:
                found.append(str(src.get("url", "")))
    return tuple(found)


def _fields(item: dict[str, Any], where: str) -> Iterator[dict[str, Any]]:
    """Each message an item holds, as ``ContextMessage`` fields (TranscriptError naming
    ``where`` for a part of the wrong shape)."""
    role = item["role"]
    content = item.get("content")
    if not isinstance(content, list):
        openai_calls: list[ToolCall] = []
        for call in _objects(item.get("tool_calls"), where, "tool_calls"):
            function = _object(call.get("function"), where, "a tool call's function")
            name = function.get("name", call.get("name", ""))
            arguments = _arguments(function.get("arguments", "{}"))
            openai_calls.append(
                ToolCall(id=str(call.get("id")), name=str(name), arguments=arguments)
            )
        yield {
            "role": role,
            "content": _text(content),
            "tool_calls": tuple(openai_calls),
            "tool_call_id": item.get("tool_call_id"),
            "name": item.get("name"),
        }
        return
    blocks = [block for block in content if isinstance(block, dict)]
    for block in blocks:
        if block.get("type") == "tool_result":
            yield {
                "role": "tool",
                "content": _text(block.get("content")),
                "tool_call_id": str(block.get("tool_use_id")),
            }
    text = "".join(
        _text(block.get("text")) for block in blocks if block.get("type") in ("text", "input_text")
    )
    calls = tuple(
        ToolCall(
            id=str(block.get("id")),
            name=str(block.get("name", "")),
            arguments=_arguments(block.get("input", {})),
        )
        for block in blocks
        if block.get("type") == "tool_use"
    )
    thinking = tuple(
        {  # checked as a ThinkingBlock with the message (its signature is a string)
            "text": str(block.get("thinking") or block.get("data") or ""),
            "signature": block.get("signature"),
            "redacted": block.get("type") == "redacted_thinking",
        }
        for block in blocks
        if block.get("type") in ("thinking", "redacted_thinking")
    )
    images = _images(blocks, where)
    if (
        text
        or calls
        or thinking
        or images
        or not any(b.get("type") == "tool_result" for b in blocks)
    ):
        yield {
            "role": role,
            "content": text,
            "tool_calls": calls,
            "thinking": thinking,
            "images": images,
        }


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class SessionMessages:
    """A session's stored messages as the engines take them, folded record by record from
    its ``session:<id>`` stream (``message:appended`` events, in order; ``seq`` numbers
    them, ``turn`` counts user messages); other records are skipped. Given the messages
    folded so far (a snapshot's), it goes on from them."""

    __slots__ = ("messages", "turn")

    def __init__(self, messages: Iterable[ContextMessage] = ()) -> None:
        self.messages: list[ContextMessage] = list(messages)
        self.turn = self.messages[-1].turn if self.messages else 0

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        if not isinstance(event, MessageAppended):
            return
        if event.role == "user":
            self.turn += 1
        self.messages.append(
            ContextMessage(
                message_id=event.message_id,
                seq=len(self.messages),
                role=event.role,
                content=event.content,
                tool_calls=event.tool_calls,
                tool_call_id=event.tool_call_id,
                name=event.name,
                turn=self.turn,
                ts=record.ts,
            )
        )


def messages_from_records(records: Iterable[RecordedEvent]) -> list[ContextMessage]:
    """A session's stored messages from its stream (see :class:`SessionMessages`)."""
    folded = SessionMessages()
    for record in records:
        folded.add(record)
    return folded.messages
