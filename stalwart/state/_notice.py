"""A failure notice's path (seed 000): the announce send, then a direct send, then the
dead-letter queue.

A run that ended without success gets one notice (``announcement:queued``, kind
``failure_notice``). It is sent through the parent's announcement system first, bounded by
``dead_letters.announce_timeout_ms``; when that send fails the notice falls back to a
direct send on the run's channel (``announcement:fallback_direct``); when that fails too,
the send failed (``announcement:send_failed``) and the notice is handed to the dead-letter
queue. :func:`notice_outcome` is that rule for one send's outcome; :func:`next_notice`
folds how far the stream's latest notice got, which the supervisor and replay both read.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
)

from ._aggregate import FolderAggregate

#: How far a notice got: queued (the announce send), fallback (the direct send),
#: delivered, or failed (both sends failed: handed to the dead-letter queue).
NoticeStage = Literal["none", "queued", "fallback", "delivered", "failed"]
#: Which send: through the announcement system, or directly on the run's channel.
NoticePath = Literal["announce", "direct"]


#: The private channel a model-driven run's own Agent answers on (``subagent:<run>``): its
#: announcements are the run's internals, never the run's failure notice.
SUBSESSION_CHANNEL_PREFIX = "subagent:"


class Notice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A stream's latest failure notice: its id, text and stage."""

    announcement_id: str = ""
    text: str = ""
    stage: NoticeStage = "none"


def next_notice(notice: Notice, event: Event) -> Notice:
    """The notice after one more event of its stream (the same one when it is unmoved)."""
    match event:
        case AnnouncementQueued(kind="failure_notice") if not event.channel.startswith(
            SUBSESSION_CHANNEL_PREFIX
        ):
            return Notice(announcement_id=event.announcement_id, text=event.text, stage="queued")
        case AnnouncementFallbackDirect() if event.announcement_id == notice.announcement_id:
            return msgspec.structs.replace(notice, stage="fallback")
        case AnnouncementDelivered() if event.announcement_id == notice.announcement_id:
            return msgspec.structs.replace(notice, stage="delivered")
        case AnnouncementSendFailed() if event.announcement_id == notice.announcement_id:
            return msgspec.structs.replace(notice, stage="failed")
        case _:
            return notice


def batch_text(runs: tuple[tuple[str, str], ...]) -> str:
    """The one message of a batch of completions: each run's result, in completion order."""
    if len(runs) == 1:
        return f"Sub-agent task completed:\n{runs[0][1]}"
    parts = [f"{index}. {result}" for index, (_, result) in enumerate(runs, 1)]
    return f"{len(runs)} sub-agent tasks completed:\n" + "\n".join(parts)


def notice_outcome(
    announcement_id: str, path: NoticePath, error_class: str | None, *, timeout_ms: int
) -> AnnouncementDelivered | AnnouncementFallbackDirect | AnnouncementSendFailed:
    """What one send of the notice gives: delivered (``error_class`` None); a failed
    announce send falls back to a direct one; a failed direct send is a failed send."""
    if error_class is None:
        return AnnouncementDelivered(announcement_id=announcement_id, path=path)
    if path == "announce":
        return AnnouncementFallbackDirect(
            announcement_id=announcement_id, timeout_ms=timeout_ms, error_class=error_class
        )
    return AnnouncementSendFailed(announcement_id=announcement_id, error_class=error_class)


_MOVES: frozenset[type[Event]] = frozenset(
    {AnnouncementQueued, AnnouncementFallbackDirect, AnnouncementDelivered, AnnouncementSendFailed}
)


class NoticeFolder:
    """The fold of a stream's :class:`Notice`; other events cost one lookup."""

    __slots__ = ("_notice",)

    def __init__(self, notice: Notice) -> None:
        self._notice = notice

    def add(self, record: RecordedEvent) -> None:
        if type(record.event) in _MOVES:
            self._notice = next_notice(self._notice, record.event)

    def state(self) -> Notice:
        return self._notice


#: :class:`Notice` over a session stream (a run's)
NOTICES = FolderAggregate("notice", Notice, NoticeFolder, moves=_MOVES)
