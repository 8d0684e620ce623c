"""Provider validity: repair an assembled transcript, and say what a provider would reject.

Both OpenAI Chat Completions and Anthropic Messages insist that tool calls and results
pair up. :func:`repair` makes a transcript acceptable to both:

- every tool result sits right after the assistant message that made its call, results
  in the order of the calls (parallel calls keep their order);
- a call with no result gets a synthetic result, marked as such (this is how a dangling
  final call is answered), and a result whose call is not in the transcript is dropped,
  so a pair is always kept or dropped together;
- messages with nothing in them (no text, call or image) are dropped, and when the first
  non-system message is not the user's, a marked placeholder opens the conversation
  (Anthropic requires a user turn first).

:func:`validity_violations` checks a transcript against each provider's rules as its wire
format sees them (for Anthropic: system text lifted out and consecutive same-role
messages merged), and returns what is wrong; an empty list means the provider accepts it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol

from ._types import ContextMessage

__all__ = [
    "SYNTHETIC_RESULT",
    "Provider",
    "Turn",
    "answers_of",
    "repair",
    "results_by_call",
    "validity_violations",
]

Provider = Literal["openai", "anthropic"]

SYNTHETIC_RESULT = (
    "[stalwart: no result was recorded for this tool call; it may not have run. "
    "This placeholder was added by the context engine.]"
)
OPENING = "[stalwart: the conversation continues from earlier messages not shown here.]"


def _empty(message: ContextMessage) -> bool:
    return not (message.content or message.tool_calls or message.images)


def _synthetic(call_id: str, name: str, seq: int) -> ContextMessage:
    return ContextMessage(
        message_id=f"synthetic:{call_id}",
        seq=seq,
        role="tool",
        content=SYNTHETIC_RESULT,
        tool_call_id=call_id,
        name=name,
    )


class _Call(Protocol):
    @property
    def id(self) -> str: ...


class Turn(Protocol):
    """What pairing reads of a message (a ``ContextMessage``, a provider ``Message``)."""

    @property
    def role(self) -> str: ...

    @property
    def tool_call_id(self) -> str | None: ...

    @property
    def tool_calls(self) -> Sequence[_Call]: ...


def results_by_call(messages: Sequence[Turn]) -> dict[tuple[int, str], int]:
    """Which result answers each call: (the index of the assistant message that made
    it, the call's id) -> the index of its result. A result answers the nearest call
    before it with its id (a result recorded further on, after a user message, still
    finds it); a provider that numbers calls per response (``call_0`` on every turn)
    reuses ids, so an id alone would give a later call's result to an earlier,
    unanswered one. A call's first result counts; one with no call before it is none."""
    latest: dict[str, int] = {}
    answers: dict[tuple[int, str], int] = {}
    for index, message in enumerate(messages):
        for call in message.tool_calls:
            latest[call.id] = index
        if message.role == "tool" and message.tool_call_id:
            owner = latest.get(message.tool_call_id)
            if owner is not None:
                answers.setdefault((owner, message.tool_call_id), index)
    return answers


def answers_of(
    messages: Sequence[Turn], index: int, answers: Mapping[tuple[int, str], int]
) -> Iterator[tuple[int, int | None]]:
    """Each call of the assistant message at ``index`` (its place in ``tool_calls``; an
    id repeated within the message once) with the index of its result, or None."""
    seen: set[str] = set()
    for place, call in enumerate(messages[index].tool_calls):
        if call.id not in seen:
            seen.add(call.id)
            yield place, answers.get((index, call.id))


def repair(messages: Sequence[ContextMessage]) -> tuple[list[ContextMessage], int]:
    """A provider-valid transcript from ``messages``, and how many changes it took."""
    answers = results_by_call(messages)
    tool_count = sum(1 for message in messages if message.role == "tool")
    out: list[ContextMessage] = []
    changes = 0
    placed = 0
    opened = False
    for index, message in enumerate(messages):
        if message.role == "tool":
            continue
        if _empty(message):
            changes += 1
            continue
        if message.role != "system" and not opened:
            opened = True
            if message.role != "user":
                out.append(
                    ContextMessage(
                        message_id="synthetic:opening",
                        role="user",
                        seq=message.seq,
                        content=OPENING,
                    )
                )
                changes += 1
        out.append(message)
        if message.role != "assistant" or not message.tool_calls:
            continue
        for place, answer in answers_of(messages, index, answers):
            if answer is not None:
                out.append(messages[answer])
                placed += 1
            else:
                call = message.tool_calls[place]
                out.append(_synthetic(call.id, call.name, message.seq))
                changes += 1
    changes += tool_count - placed
    return out, changes


def _openai(messages: Sequence[ContextMessage]) -> list[str]:
    problems: list[str] = []
    pending: list[str] = []
    for index, message in enumerate(messages):
        if message.role == "tool":
            if not message.tool_call_id:
                problems.append(f"#{index}: a tool message without tool_call_id")
            elif message.tool_call_id not in pending:
                problems.append(f"#{index}: tool result {message.tool_call_id!r} has no call")
            else:
                pending.remove(message.tool_call_id)
            continue
        if pending:
            problems.append(f"#{index}: calls {pending} are not answered before this message")
            pending = []
        if message.role in ("user", "assistant") and _empty(message):
            problems.append(f"#{index}: an empty {message.role} message")
        if message.role == "assistant":
            ids = [call.id for call in message.tool_calls]
            if len(set(ids)) != len(ids):
                problems.append(f"#{index}: duplicate tool call ids")
            pending = list(dict.fromkeys(ids))
    if pending:
        problems.append(f"end: calls {pending} are not answered")
    return problems


def _anthropic(messages: Sequence[ContextMessage]) -> list[str]:
    turns: list[tuple[str, list[ContextMessage]]] = []
    for message in messages:
        if message.role == "system":
            continue
        role = "assistant" if message.role == "assistant" else "user"
        if turns and turns[-1][0] == role:
            turns[-1][1].append(message)
        else:
            turns.append((role, [message]))
    problems: list[str] = []
    if turns and turns[0][0] != "user":
        problems.append("turn 0: the first turn must be the user's")
    expected: list[str] = []
    for index, (role, parts) in enumerate(turns):
        if all(_empty(part) and part.role != "tool" for part in parts):
            problems.append(f"turn {index}: an empty {role} turn")
        if role == "assistant":
            if expected:
                problems.append(f"turn {index}: tool_use {expected} has no tool_result")
            expected = [call.id for part in parts for call in part.tool_calls]
            continue
        answered = [part.tool_call_id for part in parts if part.role == "tool"]
        leading = 0
        while leading < len(parts) and parts[leading].role == "tool":
            leading += 1
        if leading != len(answered):
            problems.append(f"turn {index}: tool_result blocks must come first")
        for call_id in answered:
            if call_id not in expected:
                problems.append(f"turn {index}: tool_result {call_id!r} has no tool_use before it")
        missing = [call_id for call_id in expected if call_id not in answered]
        if missing:
            problems.append(f"turn {index}: tool_use {missing} has no tool_result")
        expected = []
    if expected:
        problems.append(f"end: tool_use {expected} has no tool_result")
    return problems


def validity_violations(
    messages: Sequence[ContextMessage], provider: Provider | None = None
) -> list[str]:
    """What ``provider`` (both when None) would reject in ``messages``."""
    problems: list[str] = []
    if provider in (None, "openai"):
        problems += [f"openai {problem}" for problem in _openai(messages)]
    if provider in (None, "anthropic"):
        problems += [f"anthropic {problem}" for problem in _anthropic(messages)]
    return problems
