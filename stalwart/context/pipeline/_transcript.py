"""Transcript mechanics the layers share: sizes, ids, and pair-safe removal.

Every layer that removes something goes through :func:`remove`, which keeps a tool call
and its result together; the engine then runs the DAG engine's
:func:`stalwart.context.repair` over the result as the last guarantee of validity for
both providers (it only has work when the input itself was damaged).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec

from stalwart.context._types import ContextMessage

__all__ = [
    "answered_by",
    "chars",
    "digest",
    "latest_turn",
    "message_chars",
    "remove",
    "to_provider",
]

T = TypeVar("T")
Messages = tuple[ContextMessage, ...]

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


def digest(ids: Sequence[str], *, prefix: int | None = None) -> tuple[str, str]:
    """Short hashes (no content) of ``ids[:prefix]`` and of all ``ids``, in one pass;
    the first is ``""`` when ``prefix`` is None or longer than ``ids``."""
    hasher = hashlib.blake2b(digest_size=16)
    head = ""
    for index, message_id in enumerate(ids):
        if index == prefix:
            head = hasher.hexdigest()
        hasher.update(message_id.encode("utf-8", "surrogatepass"))
        hasher.update(b"\x00")
    if prefix == len(ids):
        head = hasher.hexdigest()
    return head, hasher.hexdigest()


def _is_empty(message: ContextMessage) -> bool:
    """An assistant message a provider would refuse as empty: no text, call or image
    (thinking does not count: the provider shape does not carry it)."""
    return message.role == "assistant" and not (
        message.content or message.tool_calls or message.images
    )


def answered_by(messages: Sequence[ContextMessage]) -> dict[int, int]:
    """Which call each tool result answers: the index of a result -> the index of the
    nearest assistant message before it with a call of its ``tool_call_id``. Pairing by
    position, not by id alone: a provider that numbers calls per response (``call_0`` on
    every turn) reuses ids across the transcript. A result with no such call is absent."""
    latest: dict[str, int] = {}
    owners: dict[int, int] = {}
    for index, message in enumerate(messages):
        for call in message.tool_calls:
            latest[call.id] = index
        if message.role == "tool" and message.tool_call_id is not None:
            owner = latest.get(message.tool_call_id)
            if owner is not None:
                owners[index] = owner
    return owners


def remove(
    messages: Sequence[ContextMessage],
    *,
    message_ids: Iterable[str] = (),
    calls: Iterable[tuple[str, str]] = (),
) -> Messages:
    """``messages`` without ``message_ids`` and without ``calls`` (each the id of the
    assistant message that made it and the call's id), keeping pairs whole: a removed
    assistant message takes its calls' results with it, a removed result takes its call
    out of the assistant message, and an assistant message left with nothing at all goes
    too. Results are paired with their calls by :func:`answered_by`, so a reused call id
    elsewhere in the transcript is left alone."""
    drop = set(message_ids)
    strip = set(calls)
    if not drop and not strip:
        return tuple(messages)
    owners = answered_by(messages)
    gone: set[int] = set()
    for index, owner in owners.items():
        result, caller = messages[index], messages[owner]
        key = (caller.message_id, result.tool_call_id or "")
        if result.message_id in drop:
            strip.add(key)
        elif caller.message_id in drop or key in strip:
            gone.add(index)
    out: list[ContextMessage] = []
    for index, message in enumerate(messages):
        if message.message_id in drop or index in gone:
            continue
        if any((message.message_id, call.id) in strip for call in message.tool_calls):
            kept = tuple(c for c in message.tool_calls if (message.message_id, c.id) not in strip)
            trimmed = _replace(message, tool_calls=kept)
            if not _is_empty(trimmed):
                out.append(trimmed)
            continue
        out.append(message)
    return tuple(out)


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
