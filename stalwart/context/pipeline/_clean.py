"""Layers 1-4: what is cleaned inside messages (thinking, signatures, surrogates, tags)."""

from __future__ import annotations

import re
from bisect import bisect_left

import msgspec

from stalwart._text import scrub_surrogates
from stalwart.context._types import ContextMessage, ThinkingBlock
from stalwart.events import ToolCall

from ._run import Outcome, Run
from ._transcript import latest_turn, remove

__all__ = [
    "clean_thinking",
    "guard_surrogates",
    "scrub_signatures",
    "scrub_surrogates",
    "strip_reasoning_tags",
]

_replace = msgspec.structs.replace


def clean_thinking(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 1: thinking blocks stay on the newest ``thinking_keep_turns`` user turns
    (turn > newest - keep) and are dropped from every older message."""
    cutoff = latest_turn(messages) - run.config.thinking_keep_turns
    return Outcome(
        tuple(
            _replace(message, thinking=())
            if message.thinking and message.turn <= cutoff
            else message
            for message in messages
        )
    )


def scrub_signatures(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 2: during a cache-break replay (``run.replay``), every thinking block loses
    its signature and redacted blocks (opaque, only valid where they were signed) go."""
    if not run.replay:
        return Outcome(messages)
    out: list[ContextMessage] = []
    for message in messages:
        blocks = tuple(
            _replace(block, signature=None) if block.signature is not None else block
            for block in message.thinking
            if not block.redacted
        )
        out.append(message if blocks == message.thinking else _replace(message, thinking=blocks))
    return Outcome(tuple(out))


def _guard_block(block: ThinkingBlock) -> ThinkingBlock:
    text = scrub_surrogates(block.text)
    if text == block.text:
        return block
    return _replace(block, text=text, signature=None)  # the signature no longer matches


def _guard_call(call: ToolCall) -> ToolCall:
    arguments = scrub_surrogates(call.arguments)
    return call if arguments == call.arguments else _replace(call, arguments=arguments)


def _guard(message: ContextMessage) -> ContextMessage:
    if (
        message.content.isascii()
        and not message.thinking
        and all(call.arguments.isascii() for call in message.tool_calls)
    ):
        return message
    content = scrub_surrogates(message.content)
    thinking = tuple(_guard_block(block) for block in message.thinking)
    calls = tuple(_guard_call(call) for call in message.tool_calls)
    if content == message.content and thinking == message.thinking and calls == message.tool_calls:
        return message
    return _replace(message, content=content, thinking=thinking, tool_calls=calls)


def guard_surrogates(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 3: no lone UTF-16 surrogate half survives in text, tool-call arguments or
    thinking blocks (a thinking block whose text changed loses its signature)."""
    return Outcome(tuple(_guard(message) for message in messages))


_NAMES = r"think|thinking|reasoning|thought"
# Tags are found at every ``<`` (overlapping, as a regex that tries each position would),
# each try bounded (no tag's attributes run past 256 characters), so finding them all is
# one pass over the text however many tags are left open.
_OPEN_AT = re.compile(rf"(?=(<({_NAMES})\b[^>]{{0,256}}>))", re.IGNORECASE)
_CLOSE_AT = re.compile(rf"(?=(</({_NAMES})\s{{0,256}}>))", re.IGNORECASE)
_CLOSE = re.compile(rf"</(?:{_NAMES})\s{{0,256}}>", re.IGNORECASE)
_OPEN = re.compile(rf"<(?:{_NAMES})\b[^>]{{0,256}}>", re.IGNORECASE)


def _without_pairs(text: str) -> str:
    """``text`` without its opening-to-closing tag pairs: from each opening (left to
    right, past the pairs already cut) to the first closing tag of its name after it."""
    closes: dict[str, list[tuple[int, int]]] = {}
    for found in _CLOSE_AT.finditer(text):
        closes.setdefault(found[2].lower(), []).append((found.start(), found.end(1)))
    if not closes:
        return text
    starts = {name: [start for start, _ in spans] for name, spans in closes.items()}
    parts: list[str] = []
    done = 0
    for found in _OPEN_AT.finditer(text):
        if found.start() < done:
            continue  # inside a pair already cut
        name = found[2].lower()
        spans = closes.get(name)
        if spans is None:
            continue
        at = bisect_left(starts[name], found.end(1))
        if at == len(spans):
            continue  # never closed: the last step cuts from the first such opening
        parts.append(text[done : found.start()])
        done = spans[at][1]
    parts.append(text[done:])
    return "".join(parts)


def strip_tags(text: str) -> str:
    """Visible text without inline reasoning: ``<think>...</think>`` pairs (also
    ``thinking``, ``reasoning``, ``thought``; any case), a close tag with no opening
    (everything before it was reasoning), and an opening tag never closed (everything
    after it is). Linear in the text (a message of unclosed tags used to take minutes)."""
    if "<" not in text:
        return text
    stripped = _without_pairs(text)
    close = _CLOSE.search(stripped)
    if close is not None:
        stripped = stripped[close.end() :]
    opening = _OPEN.search(stripped)
    if opening is not None:
        stripped = stripped[: opening.start()]
    return text if stripped == text else stripped.strip()


def strip_reasoning_tags(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 4: on providers other than Anthropic, inline reasoning tags are cut out of
    assistant text; an assistant message left with nothing goes (with no tool calls it
    has no pair to break)."""
    if run.provider.lower().startswith("anthropic"):
        return Outcome(messages)
    out: list[ContextMessage] = []
    emptied: list[str] = []
    for message in messages:
        text = strip_tags(message.content) if message.role == "assistant" else message.content
        if text == message.content:
            out.append(message)
            continue
        out.append(_replace(message, content=text))
        if not (text or message.tool_calls or message.images):
            emptied.append(message.message_id)
    return Outcome(remove(out, message_ids=emptied) if emptied else tuple(out))
