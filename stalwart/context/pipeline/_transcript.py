"""Transcript mechanics every layer shares: sizes, pair-safe removal, validity and repair.

*Provider-valid* here means what both OpenAI Chat Completions and Anthropic Messages
accept: every tool result answers a call of the nearest assistant message before it, with
only other results of that message in between; every call of an assistant message has
exactly one result in that block; no call id appears twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec

from stalwart.context._types import ContextMessage

__all__ = [
    "NO_RESULT",
    "chars",
    "digest",
    "latest_turn",
    "message_chars",
    "remove",
    "repair",
    "to_provider",
    "violations",
]

T = TypeVar("T")
Messages = tuple[ContextMessage, ...]

#: The content of the synthetic result a call with no recorded result gets.
NO_RESULT = "[context engine: no result was recorded for this tool call]"

_replace = msgspec.structs.replace


def message_chars(message: ContextMessage) -> int:
    """Characters of a message: its text, its tool calls' names and arguments, and its
    thinking (what the observation masker's trigger and the logs count)."""
    total = len(message.content)
    for call in message.tool_calls:
        total += len(call.name) + len(call.arguments)
    for block in message.thinking:
        total += len(block.text)
    return total


def chars(messages: Iterable[ContextMessage]) -> int:
    return sum(message_chars(message) for message in messages)


def latest_turn(messages: Iterable[ContextMessage]) -> int:
    """The newest user turn among ``messages`` (0 if there is none)."""
    return max((message.turn for message in messages), default=0)


def digest(ids: Sequence[str]) -> str:
    """A short hash of a sequence of message ids (no content)."""
    hasher = hashlib.blake2b(digest_size=16)
    for message_id in ids:
        hasher.update(message_id.encode("utf-8", "surrogatepass"))
        hasher.update(b"\x00")
    return hasher.hexdigest()


def _is_empty(message: ContextMessage) -> bool:
    """An assistant message a provider would refuse as empty: no text, call or image
    (thinking does not count: the provider shape does not carry it)."""
    return message.role == "assistant" and not (
        message.content or message.tool_calls or message.images
    )


def remove(
    messages: Sequence[ContextMessage],
    *,
    message_ids: Iterable[str] = (),
    call_ids: Iterable[str] = (),
) -> Messages:
    """``messages`` without ``message_ids`` and without the tool calls ``call_ids``,
    keeping pairs whole: a removed assistant message takes its calls' results with it, a
    removed result takes its call out of the assistant message, and an assistant message
    left with nothing at all goes too."""
    drop = set(message_ids)
    calls = set(call_ids)
    if not drop and not calls:
        return tuple(messages)
    for message in messages:
        if message.message_id in drop:
            calls.update(call.id for call in message.tool_calls)
            if message.role == "tool" and message.tool_call_id is not None:
                calls.add(message.tool_call_id)
    out: list[ContextMessage] = []
    for message in messages:
        if message.message_id in drop:
            continue
        if message.role == "tool" and message.tool_call_id in calls:
            continue
        if message.tool_calls and any(call.id in calls for call in message.tool_calls):
            kept = tuple(call for call in message.tool_calls if call.id not in calls)
            trimmed = _replace(message, tool_calls=kept)
            if not _is_empty(trimmed):
                out.append(trimmed)
            continue
        out.append(message)
    return tuple(out)


def _synthetic(owner: ContextMessage, call_id: str, name: str) -> ContextMessage:
    return ContextMessage(
        message_id=f"synthetic-result:{call_id}",
        seq=owner.seq,
        role="tool",
        content=NO_RESULT,
        tool_call_id=call_id,
        name=name,
        turn=owner.turn,
        ts=owner.ts,
    )


def repair(messages: Sequence[ContextMessage]) -> tuple[Messages, int]:
    """A provider-valid transcript and how many fixes it took: each call's first result
    moves right after its assistant message (parallel calls keep their order), a call with
    no result gets a synthetic, marked one, a repeated call id is dropped from the later
    message, a result with no earlier call is dropped, and so is an assistant message
    with no text, call or image."""
    issued: set[str] = set()
    results: dict[str, ContextMessage] = {}
    for message in messages:
        if message.role == "tool":
            key = message.tool_call_id
            if key is not None and key in issued and key not in results:
                results[key] = message
        issued.update(call.id for call in message.tool_calls)
    out: list[ContextMessage] = []
    seen: set[str] = set()
    fixes = 0
    for original in messages:
        if original.role == "tool":
            continue
        message = original
        if message.tool_calls:
            calls = tuple(call for call in message.tool_calls if call.id not in seen)
            if len(calls) != len(message.tool_calls):
                fixes += len(message.tool_calls) - len(calls)
                message = _replace(message, tool_calls=calls)
                if _is_empty(message):
                    continue
            seen.update(call.id for call in calls)
            out.append(message)
            for call in calls:
                result = results.get(call.id)
                if result is None:
                    fixes += 1
                    result = _synthetic(message, call.id, call.name)
                out.append(result)
        elif _is_empty(message):
            fixes += 1  # nothing a provider would accept
        else:
            out.append(message)
    placed = sum(1 for key in seen if key in results)
    fixes += sum(1 for message in messages if message.role == "tool") - placed
    if fixes == 0 and tuple(out) != tuple(messages):
        fixes = 1  # results moved next to their call
    return tuple(out), fixes


def violations(messages: Sequence[ContextMessage]) -> list[str]:
    """What would make a provider reject ``messages`` (empty when valid); no content."""
    found: list[str] = []
    pending: list[str] = []
    seen: set[str] = set()
    for index, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id in pending:
                pending.remove(message.tool_call_id)
            else:
                found.append(f"#{index}: tool result {message.tool_call_id!r} has no open call")
            continue
        if pending:
            found.append(f"#{index}: calls {pending} have no result before this message")
            pending = []
        for call in message.tool_calls:
            if call.id in seen:
                found.append(f"#{index}: tool call id {call.id!r} repeated")
            seen.add(call.id)
            pending.append(call.id)
        if _is_empty(message):
            found.append(f"#{index}: empty assistant message")
    if pending:
        found.append(f"end: calls {pending} have no result")
    return found


def to_provider(messages: Sequence[ContextMessage], factory: Callable[..., T]) -> tuple[T, ...]:
    """The messages in a provider's shape: ``factory`` is called with ``role``,
    ``content``, ``tool_calls``, ``tool_call_id`` and ``images`` (for example
    ``stalwart.providers.Message``, which this package may not import)."""
    return tuple(
        factory(
            role=message.role,
            content=message.content,
            tool_calls=message.tool_calls,
            tool_call_id=message.tool_call_id,
            images=message.images,
        )
        for message in messages
    )
