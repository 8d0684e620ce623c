"""Second review of the recorded resends (``announcement:resent``): a defect a review
found, shown by a test that failed before its fix.

Real parts only: PostgreSQL from the fixtures (a relay in front of it that the test cuts
and restores: a database that goes away for a while), ``MemoryChannel``s, the fake clock
that drives every send deadline and retry. Each docstring says what is wrong, why it
matters, and what is expected."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pykka
import structlog

from stalwart.actors import IoPortal, Scheduler, Sweep
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementResent,
)
from stalwart.store import EventStore, PostgresEventStore
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import attempted_on, flush
from tests.test_resend_and_dedupe_review import supervisor
from tests.test_supervisor import T0, run_timed_out

GUARD = 10.0
ANNOUNCE_MS = 5_000  # the supervisor's send timeout (on the FakeClock)
RETRY_S = 1.0  # DECISION_RETRY_S: a record that met a store error is told again then


def _logged(
    logs: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool], count: int
) -> None:
    """Wait (real time: the supervisor's thread does it) until ``count`` entries match."""
    give_up = time.monotonic() + GUARD
    while sum(1 for entry in list(logs) if match(entry)) < count:
        assert time.monotonic() < give_up, f"never logged: {[e['event'] for e in logs]}"
        time.sleep(0.01)  # real-time: another thread's work


def test_a_late_announce_outcome_does_not_send_the_notice_beside_its_resend(
    pg_store: EventStore,
    relayed_store: PostgresEventStore,
    relay: CuttingRelay,
    clock: FakeClock,
) -> None:
    """Defect: ``SupervisorActor._sending`` is a set of announcement ids, and
    ``_notice_sent`` (stalwart/actors/_supervisor.py) discards the id whatever send of
    it ended. When the announce send's outcome meets a store error (a database failover:
    ``supervisor.record_deferred``) it is told again every ``DECISION_RETRY_S``; while
    it waits, the id is not in ``_sending``, so once the outage outlasted
    ``announce_timeout_ms + RESEND_GRACE_S`` the next sweep's ``_settle`` finds the
    notice "interrupted" (``notice_interrupted``), records ``announcement:resent`` and
    sends it directly. The retold announce outcome then lands: ``_notice_sent`` discards
    the id again (the resend is still in flight), records ``fallback_direct`` and, seeing
    nothing in ``_sending``, starts a second direct send beside the resend. The user gets
    the failure notice twice, from one supervisor, which is what ``announcement:resent``
    was added to stop ("does not send a notice twice while its sender, or another
    resender, is at it", docs/resilience.md). Expected: a notice with a send under way
    in this supervisor is not sent again; the late announce outcome is recorded (or
    dropped) without a second direct send. Fixed: the supervisor counts each send of an
    announcement apart (``NoticeSent.send_id``), and a failed outcome of a send whose
    resend is under way is moot."""
    run_timed_out(pg_store)
    clock.set(T0 + 130)
    with (
        structlog.testing.capture_logs() as logs,
        Scheduler(clock) as scheduler,
        IoPortal() as portal,
    ):
        try:
            announcer, chat = MemoryChannel("parent"), MemoryChannel("chat")
            announcer.hang_next(1)  # the announce send times out on the Clock
            chat.hang_next(1)  # the resend is still on its way when the retell lands
            ref = supervisor(
                relayed_store,
                clock,
                scheduler,
                portal,
                chat,
                announce_ms=ANNOUNCE_MS,
                announcer=announcer,
            )
            attempted_on(portal, announcer, 1)  # the first sweep queued the notice, sent it
            relay.cut_now()  # the database goes away
            deferred = lambda e: e["event"] == "supervisor.record_deferred"  # noqa: E731
            clock.advance(ANNOUNCE_MS / 1000)  # the announce send times out
            _logged(logs, deferred, 1)  # its outcome could not be recorded: told again
            clock.advance(ANNOUNCE_MS / 1000)  # still away at the retell
            _logged(logs, deferred, 2)
            relay.restore()
            give_up = time.monotonic() + GUARD
            while not reachable(relayed_store):
                assert time.monotonic() < give_up, "the database never came back"
                time.sleep(0.05)  # real-time: the pool reconnects
            ref.ask(Sweep(), timeout=GUARD)  # past announce timeout + grace: resent
            attempted_on(portal, chat, 1)
            records = list(pg_store.read_stream("session:r9"))
            assert [r.event for r in records if isinstance(r.event, AnnouncementResent)]
            clock.advance(RETRY_S)  # the announce outcome is told again, and lands
            _logged(
                logs,
                lambda e: e["event"] == "supervisor.notice_sent" and e.get("path") == "announce",
                1,
            )
            ref.ask(Sweep(), timeout=GUARD)  # what the outcome started has begun
            flush(portal)
            sent = [m.idempotency_key for m in chat.attempted]
        finally:
            pykka.ActorRegistry.stop_all(timeout=GUARD)
    assert len(sent) == 1, f"the notice was sent {len(sent)} times directly: {sent}"
