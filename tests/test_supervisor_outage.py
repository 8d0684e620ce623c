"""The supervisor when the store fails what it records: a notice's outcome, a run's end
after a give-up, a give-up notice's send. Each is told again a second later (on the
clock) instead of killing the supervisor, and what an earlier try already wrote is not
written twice; the dead-letter queue keeps one entry per announcement.

Real parts: PostgreSQL behind a TCP relay that the test cuts (``tests/_relay.py``), an
LMDB store in a tmp dir, MemoryChannels, the fake clock. Real-time waits only for work
on other threads, with guards."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import msgspec
import pytest
import structlog.testing

from stalwart.actors import (
    Crashed,
    DeadLetterActor,
    Enqueue,
    IoPortal,
    NoticeSent,
    QueueState,
    RestartNoticeSent,
    Scheduler,
)
from stalwart.actors._restarts import Restarts
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import SupervisionSettings
from stalwart.errors import StoreError
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    Event,
    SupervisorGaveUp,
)
from stalwart.state import DeadLetterState
from stalwart.store import EventStore, PostgresEventStore
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import advance_until
from tests.test_supervisor import ANNOUNCE_MS, WAIT, Tree, grown, timed_out

GUARD = 10.0


def _wait(check: Callable[[], Any], what: str) -> Any:
    give_up = time.monotonic() + GUARD
    while not (found := check()):
        assert time.monotonic() < give_up, what
        time.sleep(0.02)  # real-time: the outcome is handled on other threads
    return found


def _events(store: EventStore, stream: str, kind: type[Any]) -> list[Any]:
    return [r.event for r in store.read_stream(stream) if isinstance(r.event, kind)]


def _logged(captured: list[Any], event: str) -> bool:
    return any(entry.get("event") == event for entry in list(captured))


@pytest.fixture
def tree(lmdb_store: EventStore, clock: FakeClock) -> Iterator[Tree]:
    with grown(lmdb_store, clock) as built:
        yield built


@pytest.fixture
def relayed_tree(relayed_store: PostgresEventStore, clock: FakeClock) -> Iterator[Tree]:
    """A supervisor and a dead-letter queue whose store goes through the relay."""
    with grown(relayed_store, clock) as built:
        yield built


@pytest.mark.timeout(90)
def test_a_notice_outcome_met_by_an_outage_is_recorded_once_the_store_is_back(
    relayed_tree: Tree, pg_store: EventStore, relay: CuttingRelay, clock: FakeClock
) -> None:
    """The announce send of a failed run's notice times out while the database is away:
    recording its fallback used to raise out of the supervisor, which died with the
    direct send never made. It is told again each second until the store answers, then
    the fallback is recorded once and the notice goes out directly."""
    tree = relayed_tree
    tree.announcer.hang_next()
    with structlog.testing.capture_logs() as captured:
        timed_out(tree)
        _wait(lambda: _events(pg_store, "session:r1", AnnouncementQueued), "no notice queued")
        _wait(lambda: tree.announcer.attempted, "the announce send never started")
        relay.cut_now()  # the database goes away ... and the announce send times out
        # (its deadline is armed on the clock when the send starts: step past it)
        deferred = partial(_logged, captured, "supervisor.record_deferred")
        advance_until(clock, deferred, ANNOUNCE_MS / 1000)
        relay.restore()
        _wait(lambda: reachable(tree.store), "the store never reconnected")
        advance_until(
            clock, partial(_events, pg_store, "session:r1", AnnouncementFallbackDirect), 1.0
        )
        advance_until(clock, partial(_events, pg_store, "session:r1", AnnouncementDelivered), 0.1)
    assert tree.supervisor.is_alive()
    assert len(_events(pg_store, "session:r1", AnnouncementFallbackDirect)) == 1
    [done] = _events(pg_store, "session:r1", AnnouncementDelivered)
    assert done.path == "direct"
    [message] = tree.chat.messages
    assert message.idempotency_key == done.announcement_id


def test_a_notice_outcome_told_twice_is_recorded_once(tree: Tree) -> None:
    """An outcome is told again when its append raised, though the append may have been
    written (a connection lost after the commit): the second telling finds the notice
    already past that send and records nothing, sends nothing again."""
    timed_out(tree)
    [message] = _wait(lambda: tree.announcer.messages, "the notice was never announced")
    _wait(lambda: _events(tree.store, "session:r1", AnnouncementDelivered), "not recorded")
    [queued] = _events(tree.store, "session:r1", AnnouncementQueued)
    again = NoticeSent(
        stream="session:r1", announcement_id=queued.announcement_id, path="announce", ok=True
    )
    failed_again = msgspec.structs.replace(again, path="direct", ok=False, error_class="connect")
    tree.supervisor.tell(again)
    tree.supervisor.tell(failed_again)
    tree.barrier()
    assert len(_events(tree.store, "session:r1", AnnouncementDelivered)) == 1
    assert _events(tree.store, "deadletter", AnnouncementDeadLettered) == []
    assert tree.chat.attempted == []
    assert [m.text for m in tree.announcer.messages] == [message.text]


def test_a_give_up_notice_outcome_told_twice_is_recorded_once(tree: Tree) -> None:
    outcome = RestartNoticeSent(
        announcement_id="crash-1-notice", channel="chat", conversation="conv-1"
    )
    tree.supervisor.tell(outcome)
    tree.supervisor.tell(outcome)
    tree.barrier()
    delivered = _events(tree.store, "runtime", AnnouncementDelivered)
    assert [d.announcement_id for d in delivered] == ["crash-1-notice"]


def test_a_give_up_whose_run_end_met_the_store_is_ended_when_told_again(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Ending the run of an actor supervision gave up on appends to the run's stream; a
    store error there used to kill the supervisor after the give-up was recorded, and the
    run stayed "running" until a ghost sweep. The crash is told again a second later: its
    recorded give-up is found (not decided twice) and the run is ended then."""
    ended: list[str] = []
    retold: list[Crashed] = []

    def end_run(run: str, gave_up: SupervisorGaveUp) -> None:
        if not ended:
            ended.append("refused")
            raise StoreError("the database went away")
        ended.append(run)

    settings = SupervisionSettings(max_restarts=0)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        restarts = Restarts(
            store=lmdb_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": MemoryChannel("chat")},
            dead_letters=None,
            settings=settings,
            send_timeout_s=1.0,
            default_channel="chat",
            tell=lambda _message: None,
            key="test",
            end_run=end_run,
            retry=retold.append,
        )
        crash = Crashed(actor="subagent:r1", reason="E", restart=lambda: None, run="session:r1")
        restarts.crashed(crash)
        assert ended == ["refused"]
        advance_until(clock, lambda: retold, 0.5)
        [again] = retold
        assert (again.crash_id, again.retry) == (crash.crash_id, True)
        restarts.crashed(again)
    assert ended == ["refused", "session:r1"]
    gave_up = _events(lmdb_store, "runtime", SupervisorGaveUp)
    assert [g.crash_id for g in gave_up] == [crash.crash_id]


# -- the dead-letter queue: one entry per announcement --------------------------------------


def _enqueue(announcement_id: str, reason: str = "connect") -> Enqueue:
    return Enqueue(
        announcement_id=announcement_id,
        channel="chat",
        conversation="conv-1",
        text="Sorry, that failed.",
        reason=reason,
    )


def test_an_announcement_queued_twice_has_one_entry(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A sender told again after a store error (or a resend that failed again) queues
    the same announcement a second time: it used to get a second entry, so the user
    would be sent it twice. The queue answers with the entry it has."""
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        queue = DeadLetterActor.start(
            store=lmdb_store, clock=clock, scheduler=scheduler, portal=portal, channels={}
        )
        try:
            first = queue.ask(_enqueue("a-1"), timeout=WAIT)
            second = queue.ask(_enqueue("a-1", reason="timeout"), timeout=WAIT)
            other = queue.ask(_enqueue("a-2"), timeout=WAIT)
            state = queue.ask(QueueState(), timeout=WAIT)
        finally:
            queue.stop()
    assert second == first
    assert other != first
    assert isinstance(state, DeadLetterState)
    assert [e.announcement_id for e in state.entries] == ["a-1", "a-2"]
    queued: list[Event] = _events(lmdb_store, "deadletter", AnnouncementDeadLettered)
    assert len(queued) == 2
