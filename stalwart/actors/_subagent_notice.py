"""The static failure notice of a sub-agent run (seed 000): its texts and its sends.

A notice never makes an LLM call and never carries an error's text: it is the start of
the task (as it was asked: a later attempt's continuation context, which tells the next
attempt what the last one did and saved, is not the user's), one fixed sentence per way
the run ended, and how long it ran. The sentences are module constants;
:func:`failure_notice` only fills in those three parts.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Literal

import msgspec

from stalwart.state import asked_task

__all__ = [
    "FAILED_SENTENCE",
    "NOTICE_TEMPLATE",
    "SWEPT_SENTENCE",
    "TASK_EXCERPT_CHARS",
    "TIMED_OUT_SENTENCE",
    "UNRECORDED_TASK",
    "NoticeSent",
    "failure_notice",
]

#: The fixed sentence of a run force-failed by its watchdog.
TIMED_OUT_SENTENCE = "The sub-agent task did not complete in time and was stopped."
#: The fixed sentence of a run that ended in an error.
FAILED_SENTENCE = "The sub-agent task did not complete successfully."
#: The fixed sentence of a run found still running long past its limit (a ghost).
SWEPT_SENTENCE = "The sub-agent task stopped responding and was ended."
#: The notice: task excerpt, fixed sentence, runtime.
NOTICE_TEMPLATE = 'Sub-agent task "{task}": {sentence} (ran {runtime})'
#: What a notice quotes for the task of a run whose spawn the log never recorded.
UNRECORDED_TASK = "(not recorded)"
#: How much of the task a notice quotes.
TASK_EXCERPT_CHARS = 60

_SENTENCES = {
    "timed_out": TIMED_OUT_SENTENCE,
    "failed": FAILED_SENTENCE,
    "swept": SWEPT_SENTENCE,
}

Path = Literal["announce", "direct"]


def _excerpt(task: str) -> str:
    flat = " ".join(asked_task(task).split())
    if len(flat) <= TASK_EXCERPT_CHARS:
        return flat
    return flat[: TASK_EXCERPT_CHARS - 3].rstrip() + "..."


def _runtime(ms: int) -> str:
    seconds = max(0, ms) // 1000
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"


def failure_notice(task: str, outcome: str, runtime_ms: int) -> str:
    """The static notice of a run that ended ``timed_out``, ``failed`` or ``swept``."""
    sentence = _SENTENCES.get(outcome, FAILED_SENTENCE)
    return NOTICE_TEMPLATE.format(
        task=_excerpt(task), sentence=sentence, runtime=_runtime(runtime_ms)
    )


class NoticeSent(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one send of a run's notice; ``error_class`` is content-free."""

    stream: str
    announcement_id: str
    path: Path
    ok: bool
    error_class: str | None = None
    #: which send of the announcement this was (a resend may be under way beside a late
    #: outcome of the send before it)
    send_id: str = ""
    #: the receiver's Retry-After (ms) with the failure, if it sent one
    retry_after_ms: int | None = None


def sent(
    stream: str, announcement_id: str, path: Path, send_id: str, future: Future[str | None]
) -> NoticeSent:
    """The message a finished send makes (a done-callback: cheap, never raises)."""
    error: str | None
    if future.cancelled():
        error = "cancelled"
    else:
        exc = future.exception()
        error = type(exc).__name__ if exc is not None else future.result()
    return NoticeSent(
        stream=stream, announcement_id=announcement_id, path=path, ok=error is None,
        error_class=error, send_id=send_id,
    )  # fmt: skip
