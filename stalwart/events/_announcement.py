"""Announcement and dead-letter events (streams ``session:<id>`` and ``deadletter``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity


class AnnouncementQueued(Event, frozen=True, tag="announcement:queued"):
    announcement_id: str
    channel: str
    kind: Literal["completion", "failure_notice", "static_reply"] = "completion"
    text: str = ""
    #: a batch of completions records its text once, in its first run's stream: the
    #: others' records name that run here and carry no text (None: the text is this
    #: record's; logs written before it have the batch's text in every run's record)
    text_run: str | None = None


class AnnouncementDelivered(Event, frozen=True, tag="announcement:delivered"):
    announcement_id: str
    path: Literal["announce", "direct"] = "announce"


class AnnouncementSendFailed(Event, frozen=True, tag="announcement:send_failed"):
    announcement_id: str
    error_class: str
    #: the dead-letter entry this was a retry of (None: a first send, not a retry)
    entry_id: str | None = None
    #: the receiver's Retry-After (ms) with the failure: the queue waits at least that long
    #: before the entry's next retry (None: no hint; logs written before it have none)
    retry_after_ms: int | None = None
    severity: ClassVar[Severity] = "warning"


class AnnouncementResent(Event, frozen=True, tag="announcement:resent"):
    """A sender sends ``announcement_id`` again: its earlier send has no outcome in the log
    and is older than a send can take (a crash or a close cut it short). Appended,
    expecting the stream's version, before the send: a sender in another runtime on the
    log measures from it, so it does not send the announcement beside this one."""

    announcement_id: str
    severity: ClassVar[Severity] = "warning"


class AnnouncementFallbackDirect(Event, frozen=True, tag="announcement:fallback_direct"):
    """The announce send of ``announcement_id`` (bounded by ``timeout_ms``) failed with
    ``error_class``: the notice goes directly to its channel. Records written before
    ``error_class`` was recorded have it None (not re-derived)."""

    announcement_id: str
    timeout_ms: int
    error_class: str | None = None
    #: the receiver's Retry-After (ms) with the announce send's failure: a direct send to
    #: the same receiver waits that long (None: no hint; logs written before it have none)
    retry_after_ms: int | None = None
    severity: ClassVar[Severity] = "warning"


class AnnouncementDeadLettered(Event, frozen=True, tag="announcement:dead_lettered"):
    entry_id: str
    announcement_id: str
    channel: str
    text: str
    reason: str
    #: where a retry delivers it (added after v1: an older event has no conversation)
    conversation: str = ""
    thread: str | None = None
    #: the channel message's kind a retry sends it as (``failure_notice``, ...); "reply"
    #: in logs written before it
    kind: str = "reply"
    #: the receiver's Retry-After (ms) with the failed send that queued it: its first retry
    #: waits at least that long (None: no hint; logs written before it have none)
    retry_after_ms: int | None = None
    severity: ClassVar[Severity] = "warning"


class AnnouncementDeadLetterRetried(Event, frozen=True, tag="announcement:dead_letter_retried"):
    """The dead-letter queue sends entry ``entry_id`` again, its ``attempt``-th retry:
    because its backoff came (``backoff``) or because ``provider`` recovered (``drain``:
    every entry at once, whatever its backoff). Appended before the send; the send's
    outcome follows as ``announcement:send_failed`` or ``..._delivered``. ``runtime``:
    the runtime instance whose queue sends it (a queue of another runtime on the same
    store leaves the entry alone while the send may still be under way)."""

    entry_id: str
    attempt: int
    reason: Literal["backoff", "drain"] = "backoff"
    provider: str | None = None
    runtime: str | None = None


class AnnouncementDeadLetterDelivered(Event, frozen=True, tag="announcement:dead_letter_delivered"):
    entry_id: str
    attempts: int


class AnnouncementDeadLetterExpired(Event, frozen=True, tag="announcement:dead_letter_expired"):
    entry_id: str
    age_ms: int
    max_age_ms: int
    attempts: int = 0
    #: ``rejected``: the last send's failure was final (added later; older logs have none)
    reason: Literal["max_age", "retries_exhausted", "rejected"] = "max_age"
    max_retries: int = 0
    severity: ClassVar[Severity] = "error"
