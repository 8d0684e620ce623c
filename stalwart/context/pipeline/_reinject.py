"""Layer 9: rehydration, the files read again after compaction."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from stalwart._text import scrub_surrogates
from stalwart.context._repair import repair
from stalwart.context._types import ContextMessage

from ._compaction import is_summary
from ._objective import objective_tokens
from ._run import Outcome, Run
from ._wrap import MARKER, safe_label, wrap_untrusted

__all__ = ["PATH_KEYS", "referenced_paths", "rehydrate"]

#: Tool-call argument keys whose string value is taken as a file path.
PATH_KEYS = ("path", "file", "file_path", "filepath", "filename")

REHYDRATION_ID = "pipeline-rehydration"
#: Below this many tokens of room left in the budget, no more files are re-read.
MIN_ROOM = 64


def _paths(arguments: str) -> Iterator[str]:
    try:
        decoded = msgspec.json.decode(arguments or "{}")
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deeply
        return
    if isinstance(decoded, dict):
        for key in PATH_KEYS:
            value = decoded.get(key)
            if isinstance(value, str) and value:
                yield value


def referenced_paths(original: tuple[ContextMessage, ...], kept: set[str], limit: int) -> list[str]:
    """Paths named in the tool-call arguments of messages no longer in the transcript
    (summarized or dropped), newest first, each once, at most ``limit`` (0: none)."""
    found: list[str] = []
    if limit <= 0:
        return found
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
    clipped = scrub_surrogates(text[:limit])  # written after the surrogate guard ran
    note = f" (first {limit} of {len(text)} characters)" if len(text) > limit else ""
    if trusted:  # the operator's own instructions file, named in the config
        return f"--- {path}{note} ---\n{clipped}"
    header = f"--- {safe_label(path)}{note} ---\n"  # a path a tool call named: untrusted
    return header + wrap_untrusted(clipped, kind="file", label=path)


def _fitted(path: str, text: str, room: int, run: Run, *, trusted: bool) -> str | None:
    """The section for ``path`` clipped until it costs at most ``room`` tokens."""
    limit = run.config.rehydrate_max_chars
    while limit >= MIN_ROOM:
        section = _section(path, text, limit, trusted=trusted)
        if run.estimator.text(section) <= room:
            return section
        limit //= 2
    return None


def _files(messages: tuple[ContextMessage, ...], run: Run) -> list[tuple[str, bool]]:
    """(path, trusted) to re-read: the instructions file first, then referenced files."""
    instructions = run.config.instructions_file
    wanted = [(instructions, True)] if instructions else []
    kept = {message.message_id for message in messages}
    paths = referenced_paths(run.original, kept, run.config.rehydrate_max_files)
    return wanted + [(path, False) for path in paths if path != instructions]


def rehydrate(messages: tuple[ContextMessage, ...], run: Run) -> Outcome:
    """Layer 9: when the transcript holds a compaction summary, a user message right after
    it carries, read through the engine's reader, the agent's instructions file (as the
    operator wrote it) and the files that summarized or dropped tool calls referenced
    (wrapped as untrusted), each clipped to ``rehydrate_max_chars``. They never push the
    transcript (with layer 10's restated objective) past the budget: a file is clipped
    further to the room left, and skipped when too little is left."""
    at = next((i for i, m in enumerate(messages) if is_summary(m)), None)
    if at is None or run.reader is None:
        return Outcome(messages)
    room = run.budget - run.estimator.messages(messages) - objective_tokens(messages, run) - 16
    sections: list[str] = []
    for path, trusted in _files(messages, run):
        if room < MIN_ROOM:
            break
        text = run.reader(path)  # one that raises fails the layer (its breaker counts it)
        section = None if text is None else _fitted(path, text, room, run, trusted=trusted)
        if section is not None:
            sections.append(section)
            room -= run.estimator.text(section) + 2
    summary = messages[at]
    # the sections' estimates leave out the message's own frame and the opening the
    # final repair adds before a summary that comes first: check the whole as it will
    # be sent, and leave out the last file until it fits
    limit = run.budget - objective_tokens(messages, run)
    while sections:
        message = ContextMessage(
            message_id=REHYDRATION_ID,
            seq=summary.seq,
            role="user",
            content=f"{MARKER}rehydrated] Files read again after compaction:\n"
            + "\n\n".join(sections),
            turn=summary.turn,
        )
        out = (*messages[: at + 1], message, *messages[at + 1 :])
        if run.estimator.messages(repair(out)[0]) <= limit:
            return Outcome(out)
        sections.pop()
    return Outcome(messages)
