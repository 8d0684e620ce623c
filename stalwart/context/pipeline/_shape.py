"""Layers 5-7: what is dropped or masked wholesale (old turns, superseded and old results)."""

from __future__ import annotations

import msgspec

from stalwart.context._types import ContextMessage

from ._config import ObservationTier, PipelineConfig
from ._run import Outcome, Run
from ._transcript import answered_by, chars, latest_turn, remove
from ._wrap import safe_label

__all__ = ["MASK_PREFIX", "evict_dead_content", "mask_observations", "window_history"]

#: How a masked tool result begins (the rest names the tool and the size it had).
MASK_PREFIX = "[MASKED_TOOL_RESULT"


def window_history(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 5: the newest ``history_turns`` user turns (turn > newest - N) and the
    system messages that open the transcript are kept; every older message is dropped,
    pairs with it."""
    cutoff = latest_turn(messages) - run.config.history_turns
    if cutoff < 0:
        return Outcome(messages)
    preamble = 0
    while preamble < len(messages) and messages[preamble].role == "system":
        preamble += 1
    old = [m.message_id for m in messages[preamble:] if m.turn <= cutoff]
    return Outcome(remove(messages, message_ids=old) if old else messages)


def _call_key(name: str, arguments: str) -> tuple[str, str]:
    """The identity of a call: its tool and its arguments as canonical JSON (key order
    and spacing ignored); arguments that are not JSON (or nested too deeply to read)
    compare as stripped text."""
    try:
        canonical = msgspec.json.encode(msgspec.json.decode(arguments or "{}"), order="sorted")
    except (msgspec.DecodeError, TypeError, RecursionError):
        return name, arguments.strip()
    return name, canonical.decode()


def evict_dead_content(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 6: a tool call and its result go when a later call of the same tool with the
    same arguments has a result too, once the old result is ``eviction_min_age``
    messages old (newest seq - its seq >= the knob)."""
    owners = answered_by(messages)  # paired by position: call ids may be reused
    results = {(owners[i], messages[i].tool_call_id or ""): messages[i] for i in owners}
    newest_seq = max((m.seq for m in messages), default=0)
    answered: list[tuple[tuple[str, str], tuple[int, str]]] = [
        (_call_key(call.name, call.arguments), (index, call.id))
        for index, message in enumerate(messages)
        for call in message.tool_calls
        if (index, call.id) in results
    ]
    newer: set[tuple[str, str]] = set()
    dead: list[tuple[str, str]] = []
    for key, call in reversed(answered):
        if key in newer and newest_seq - results[call].seq >= run.config.eviction_min_age:
            dead.append((messages[call[0]].message_id, call[1]))
        newer.add(key)
    return Outcome(remove(messages, calls=dead) if dead else messages)


def tier_of(config: PipelineConfig, tool: str | None) -> ObservationTier:
    if tool is None:
        return config.default_tier
    return config.observation_tiers.get(tool, config.default_tier)


def mask_text(tool: str | None, content: str) -> str:
    """The mask of a result: the tool's name (a model wrote it: reduced to a safe label,
    so it cannot close the marker or start a line) and the size the result had."""
    return f"{MASK_PREFIX} tool={safe_label(tool) if tool else 'unknown'} chars={len(content)}]"


def mask_observations(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 7: once the transcript is over ``observation_trigger_chars`` characters,
    tool results are aged by how many results are newer (0 for the newest): ``protected``
    tools are never touched, ``standard`` results aged ``observation_keep_window`` or
    more keep their call and metadata but their content becomes a (shorter) mask naming
    the tool and the size it had, ``ephemeral``
    results aged ``ephemeral_keep_window`` or more go with their call."""
    config = run.config
    if chars(messages) <= config.observation_trigger_chars:
        return Outcome(messages)
    owners = answered_by(messages)  # a result's call, by position (ids may be reused)

    def name_of(index: int, call_id: str | None) -> str | None:
        owner = owners.get(index)
        calls = messages[owner].tool_calls if owner is not None else ()
        return next((call.name for call in calls if call.id == call_id), None)

    results = [i for i, m in enumerate(messages) if m.role == "tool"]
    out = list(messages)
    gone: list[str] = []
    for age, index in enumerate(reversed(results)):
        message = messages[index]
        tool = message.name or name_of(index, message.tool_call_id)
        tier = tier_of(config, tool)
        if tier == "ephemeral" and age >= config.ephemeral_keep_window:
            gone.append(message.message_id)
        elif tier == "standard" and age >= config.observation_keep_window:
            # by age and tier alone: the layers run over the stored messages, which are never
            # masked, so a result that starts like a mask is a tool's text (maybe forged)
            masked = mask_text(tool, message.content)
            if len(masked) < len(message.content):
                out[index] = msgspec.structs.replace(message, content=masked)
    return Outcome(remove(out, message_ids=gone) if gone else tuple(out))
