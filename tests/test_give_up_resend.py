"""A give-up notice (``GAVE_UP_TEXT``) whose send a crash or a close cut short: the
``runtime`` stream holds it queued with no outcome, and no session's Agent says it (it is
not in the session's stream). A later supervisor's sweep sends it again, once, to the
session's recorded conversation, with the same idempotency key; of two runtimes on one
log, one sends. (The end-to-end case, with a real process killed mid-send, is in
``tests/test_crash_scenarios_s33.py``.)

Real parts: an LMDB store in tmp_path, the supervisor tree of ``tests/test_supervisor.py``
on a FakeClock-driven Scheduler, MemoryChannels."""

from __future__ import annotations

from stalwart.actors import GAVE_UP_TEXT, IoPortal, Scheduler, Sweep
from stalwart.actors._restarts import RESEND_WITHIN_S, Crashed, Restarts
from stalwart.actors._send import RESEND_GRACE_S
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import SupervisionSettings
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    SessionCreated,
    SupervisorGaveUp,
)
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import advance_until
from tests.test_supervisor import ANNOUNCE_MS, WAIT, grown, of, until

QUIET_S = ANNOUNCE_MS / 1000 + RESEND_GRACE_S


def _cut_short(store: EventStore, clock: FakeClock, crash_id: str = "c1") -> None:
    """What a process killed while sending its give-up notice left in the log."""
    store.append(
        "session:s1",
        [SessionCreated(agent="worker", channel="chat", conversation="conv-9", thread="t-2")],
    )
    at = clock.now()
    store.append(
        "runtime",
        [
            NewEvent(
                event=SupervisorGaveUp(
                    actor="session:s1", restarts=3, window_ms=60_000, session="s1",
                    crash_id=crash_id,
                ),
                ts=at,
            ),
            NewEvent(
                event=AnnouncementQueued(
                    announcement_id=f"{crash_id}-notice", channel="chat",
                    kind="failure_notice", text=GAVE_UP_TEXT,
                ),
                ts=at,
            ),
        ],
    )  # fmt: skip


def _runtime(store: EventStore) -> list[object]:
    return [record.event for record in store.read_stream("runtime")]


# Was: DEFECT: a give-up notice cut short by a crash was never resent
def test_a_notice_cut_short_is_sent_again_once_after_a_send_could_have_ended(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    _cut_short(lmdb_store, clock)
    with grown(lmdb_store, clock) as tree:
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        assert tree.chat.attempted == []  # its sender may still be at it
        clock.advance(QUIET_S + 1)
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        until(lmdb_store, lambda: of(_runtime(lmdb_store), AnnouncementDelivered))
        (sent,) = tree.chat.messages
        assert (sent.conversation, sent.thread, sent.text) == ("conv-9", "t-2", GAVE_UP_TEXT)
        assert sent.idempotency_key == "c1-notice"
        clock.advance(QUIET_S + 1)
        tree.supervisor.ask(Sweep(), timeout=WAIT)
    events = _runtime(lmdb_store)
    assert [type(e).__name__ for e in events[2:]] == ["AnnouncementResent", "AnnouncementDelivered"]
    assert len(tree.chat.attempted) == 1


def test_of_two_runtimes_on_one_log_one_sends(lmdb_store: EventStore, clock: FakeClock) -> None:
    _cut_short(lmdb_store, clock)
    with grown(lmdb_store, clock) as first, grown(lmdb_store, clock) as second:
        clock.advance(QUIET_S + 1)
        first.supervisor.ask(Sweep(), timeout=WAIT)
        second.supervisor.ask(Sweep(), timeout=WAIT)
        until(lmdb_store, lambda: of(_runtime(lmdb_store), AnnouncementDelivered))
        second.supervisor.ask(Sweep(), timeout=WAIT)
        first.supervisor.ask(Sweep(), timeout=WAIT)
        assert len(first.chat.attempted) + len(second.chat.attempted) == 1
    assert len(of(_runtime(lmdb_store), AnnouncementResent)) == 1


def test_a_notice_older_than_an_hour_is_not_sent_any_more(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    _cut_short(lmdb_store, clock)
    clock.advance(RESEND_WITHIN_S + 1)
    with grown(lmdb_store, clock) as tree:
        tree.supervisor.ask(Sweep(), timeout=WAIT)
        assert tree.chat.attempted == []
    assert not of(_runtime(lmdb_store), AnnouncementResent)


# Was: DEFECT: the in-flight mark was cleared when the send ended, before its outcome was
# recorded: a sweep in between took the notice for one a crash cut short and sent it again.
def test_a_notice_whose_outcome_is_not_recorded_yet_is_not_sent_again(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    chat = MemoryChannel("chat")
    told: list[object] = []  # the outcomes, as the supervisor's mailbox would hold them
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        restarts = Restarts(
            store=lmdb_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": chat},
            dead_letters=None,
            settings=SupervisionSettings(max_restarts=0),
            send_timeout_s=ANNOUNCE_MS / 1000,
            default_channel="chat",
            tell=told.append,
            key="test",
        )
        lmdb_store.append("session:s1", [SessionCreated(channel="chat", conversation="c")])
        restarts.crashed(
            Crashed(actor="session:s1", reason="E", restart=lambda: None, session="s1")
        )
        advance_until(clock, lambda: told, 0.05)  # sent; its outcome not recorded yet
        clock.advance(QUIET_S + 1)
        restarts.resend_cut_short()
        assert len(chat.attempted) == 1
        (outcome,) = told
        restarts.notice_sent(outcome)  # type: ignore[arg-type]
        clock.advance(QUIET_S + 1)
        restarts.resend_cut_short()
        assert len(chat.attempted) == 1
    assert not of(_runtime(lmdb_store), AnnouncementResent)
