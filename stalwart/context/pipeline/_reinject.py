"""Layers 9-10: what is put back after compaction (files read again, the objective)."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from stalwart.context._types import ContextMessage

from ._compaction import is_summary
from ._run import Outcome, Run
from ._wrap import MARKER, wrap_untrusted

__all__ = ["PATH_KEYS", "referenced_paths", "rehydrate", "reinforce_objective"]

#: Tool-call argument keys whose string value is taken as a file path.
PATH_KEYS = ("path", "file", "file_path", "filepath", "filename")

REHYDRATION_ID = "pipeline-rehydration"
OBJECTIVE_ID = "pipeline-objective"


def _paths(arguments: str) -> Iterator[str]:
    try:
        decoded = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        return
    if isinstance(decoded, dict):
        for key in PATH_KEYS:
            value = decoded.get(key)
            if isinstance(value, str) and value:
                yield value


def referenced_paths(original: tuple[ContextMessage, ...], kept: set[str], limit: int) -> list[str]:
    """Paths named in the tool-call arguments of messages no longer in the transcript
    (summarized or dropped), newest first, each once, at most ``limit``."""
    found: list[str] = []
    for message in reversed(original):
        if message.message_id in kept or not message.tool_calls:
            continue
        for call in message.tool_calls:
            for path in _paths(call.arguments):
                if path not in found:
                    found.append(path)
                    if len(found) == limit:
                        return found
    return found


def _section(path: str, text: str, limit: int, *, trusted: bool) -> str:
    clipped = text[:limit]
    note = f" (first {limit} of {len(text)} characters)" if len(text) > limit else ""
    if trusted:
        return f"--- {path}{note} ---\n{clipped}"
    return f"--- {path}{note} ---\n" + wrap_untrusted(clipped, kind="file", label=path)


def rehydrate(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 9: when the transcript holds a compaction summary, a user message right after
    it carries, read through the engine's reader, the agent's instructions file (as the
    operator wrote it) and the files that summarized or dropped tool calls referenced
    (wrapped as untrusted), each clipped to ``rehydrate_max_chars``."""
    config = run.config
    at = next((i for i, m in enumerate(messages) if is_summary(m)), None)
    if at is None or run.reader is None:
        return Outcome(messages)
    kept = {message.message_id for message in messages}
    sections: list[str] = []
    instructions = config.instructions_file
    if instructions:
        text = run.reader(instructions)
        if text is not None:
            sections.append(_section(instructions, text, config.rehydrate_max_chars, trusted=True))
    for path in referenced_paths(run.original, kept, config.rehydrate_max_files):
        if path == instructions:
            continue
        text = run.reader(path)
        if text is not None:
            sections.append(_section(path, text, config.rehydrate_max_chars, trusted=False))
    if not sections:
        return Outcome(messages)
    summary = messages[at]
    message = ContextMessage(
        message_id=REHYDRATION_ID,
        seq=summary.seq,
        role="user",
        content=f"{MARKER}rehydrated] Files read again after compaction:\n" + "\n\n".join(sections),
        turn=summary.turn,
    )
    return Outcome((*messages[: at + 1], message, *messages[at + 1 :]))


def reinforce_objective(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 10: when the session's first user message (its objective) is no longer in
    the transcript (summarized by compaction or dropped by the history window), it is
    restated as a user message just before the newest user message, which stays last."""
    objective = next((m for m in run.original if m.role == "user"), None)
    if objective is None or any(m.message_id == objective.message_id for m in messages):
        return Outcome(messages)
    at = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].role == "user" and not messages[i].message_id.startswith("pipeline-")
        ),
        None,
    )
    if at is None:
        at = 0
        while at < len(messages) and messages[at].role == "system":
            at += 1
    anchor = messages[at] if at < len(messages) else objective
    message = ContextMessage(
        message_id=OBJECTIVE_ID,
        seq=anchor.seq,
        role="user",
        content=(
            f"{MARKER}objective] The original objective of this session, restated because "
            f"earlier turns were summarized or dropped:\n{objective.content}"
        ),
        turn=anchor.turn,
    )
    return Outcome((*messages[:at], message, *messages[at:]))
