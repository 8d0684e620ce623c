"""The afternoon's last changes, reviewed again (session 35): the tenant ledger's time
when one host's clock is far ahead, the health actor's follower on a busy store, and a
part given up on while tells race its hand-over.

Real parts only: LMDB in ``tmp_path``, the store ledger, the health actor, the runtime's
``LiveRef``, the fake clock. A test marked ``# Was: DEFECT:`` failed on the code before
its fix.
"""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from typing import Any

from stalwart.actors import (
    HealthReport,
    HealthView,
    ProviderHealthActor,
    Scheduler,
    StoreLedger,
    ledger_stream,
)
from stalwart.clock import FakeClock
from stalwart.context import ended
from stalwart.events import MessageAppended, ProviderCallSucceeded
from stalwart.runtime._handles import LiveRef
from stalwart.state import SummarizerVerdict, decide_summarizer
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import until

T0 = 1_800_000_000.0
TENANT = "acme"
HOUR_CAP = 1_000  # tokens a tenant may spend in an hour in the ledger tests
CALL = 100  # tokens each call projects and spends


def admit_capped(governor: Any, now: float) -> SummarizerVerdict:
    return decide_summarizer(
        governor,
        now,
        projected=CALL,
        per_hour=HOUR_CAP,
        per_day=0,
        failure_threshold=5,
        reset_timeout_ms=60_000,
    )


def one_call(ledger: StoreLedger) -> bool:
    """Admit one call and release it having spent ``CALL`` tokens: whether it was admitted."""
    verdict, reservation = ledger.admit(TENANT, "s", CALL, admit_capped)
    if reservation is None:
        return False
    ledger.release(
        ended(
            reservation, input_tokens=CALL - 10, output_tokens=10, error_class=None, duration_ms=5
        )
    )
    return verdict.allowed


# -- the ledger's time when a host's clock is far ahead -------------------------------------


# Was: DEFECT: one record from a host a day ahead froze the ledger's time: caps refused every call
def test_a_host_clock_far_ahead_does_not_freeze_the_ledgers_windows(
    lmdb_store: EventStore, logs: list[MutableMapping[str, Any]]
) -> None:
    """A host whose clock is a day ahead records one call. The others followed the
    ledger's newest time without bound: every later call was recorded at that one time,
    the hour never moved on, and once an hour's cap was spent every call was refused for
    the day the clock was off. Now they follow it at most ``MAX_LEAD_S`` past their clock
    (said once), so the hour moves with their clocks: ten minutes apart, six calls an
    hour fit under a cap of ten."""
    wrong = StoreLedger(lmdb_store, FakeClock(start=T0 + 86_400), lease_ms=300_000)
    assert one_call(wrong)
    clock = FakeClock(start=T0)
    ledger = StoreLedger(lmdb_store, clock, lease_ms=300_000)
    admitted = []
    for _ in range(18):  # three hours, a call every ten minutes
        admitted.append(one_call(ledger))
        clock.advance(600)
    assert all(admitted), admitted
    times = [r.ts for r in lmdb_store.read_stream(ledger_stream(TENANT))][
        3:
    ]  # after the day-ahead call
    assert times[-1] - times[0] >= 17 * 600  # the ledger's time moved with the clock
    ahead = [entry for entry in logs if entry["event"] == "context_ledger.clock_ahead"]
    assert len(ahead) == 1
    assert ahead[0]["log_level"] == "warning"


def test_a_clock_a_little_behind_still_decides_at_the_ledgers_time(
    lmdb_store: EventStore,
) -> None:
    """Within the bound the ledger's time still wins: a worker a minute behind records at
    the newest record's time, so it counts the other's spend (the earlier fix holds)."""
    ahead = StoreLedger(lmdb_store, FakeClock(start=T0 + 60), lease_ms=300_000)
    assert one_call(ahead)
    behind = StoreLedger(lmdb_store, FakeClock(start=T0), lease_ms=300_000)
    assert one_call(behind)
    times = [r.ts for r in lmdb_store.read_stream(ledger_stream(TENANT))]
    assert times[-1] == T0 + 60


# -- the health actor's follower on a busy store --------------------------------------------


class CountingView(HealthView):
    """A health view that counts what the actor published (once per look at its stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[HealthReport] = []

    def publish(self, report: HealthReport) -> None:
        self.published.append(report)
        super().publish(report)


# Was: DEFECT: the health actor looked at its stream again for every append to any stream
def test_the_health_follower_wakes_its_actor_only_when_its_stream_moved(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler
) -> None:
    """A store busy with 400 appends to sessions' streams: the health actor's follower
    woke it for each head move (a read of its stream, a snapshot check, a publish: a
    thread kept busy by every other writer on the store, once per provider). The
    dead-letter queue's follower looks at its stream's version first; so does health's
    now: one append to ``provider:p`` wakes it once."""
    view = CountingView()
    ref = ProviderHealthActor.start(lmdb_store, clock, scheduler, "p", view=view)
    try:
        until(lambda: view.published, 10.0)  # real-time: its start publishes once
        for n in range(400):
            lmdb_store.append(
                "session:busy", [NewEvent(event=MessageAppended(message_id=str(n), role="user"))]
            )
        lmdb_store.append(
            "provider:p",
            [NewEvent(event=ProviderCallSucceeded(provider="p", model="m", agent="a"))],
        )
        # real-time: the follower's wake is handled on the actor's thread
        until(lambda: view.published[-1].version == 1, 10.0)
        assert len(view.published) <= 3, len(view.published)
    finally:
        ref.stop(timeout=10.0)


# -- a part given up on while tells race its hand-over --------------------------------------


class SlowStandIn:
    """What stands in for a part given up on: records what it is handed, and holds the
    first one until ``go`` is set (as recording a dead-letter entry in the store takes a
    while), saying ``busy`` meanwhile."""

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.busy = threading.Event()
        self.go = threading.Event()

    def __call__(self, message: Any) -> None:
        if not self.busy.is_set():  # the first one handed over
            self.busy.set()
            self.go.wait(10.0)  # real-time: the test tells from its own thread meanwhile
        self.got.append(message)


# Was: DEFECT: a tell racing give_up reached the stand-in before the older tells kept for it
def test_a_tell_while_the_kept_tells_are_handed_to_the_stand_in_goes_behind_them() -> None:
    """Three tells are kept while the part is down; it is given up on, and while the
    stand-in takes the first (slowly), a fourth is told from another thread. It went to
    the stand-in at once, ahead of the second and third (a dead-letter entry recorded
    before older ones of its conversation: retried first). Now it goes behind them, and
    the tell still returns at once."""
    ref = LiveRef(lambda: None, "deadletter", hold=True)
    for n in (1, 2, 3):
        ref.tell(n)
    stand_in = SlowStandIn()
    giving_up = threading.Thread(target=ref.give_up, args=(stand_in,), daemon=True)
    giving_up.start()
    assert stand_in.busy.wait(10.0)  # real-time: give_up runs on its own thread
    told = threading.Thread(target=ref.tell, args=(4,), daemon=True)
    told.start()
    told.join(10.0)  # real-time: a tell never waits for the stand-in
    assert not told.is_alive()
    stand_in.go.set()
    giving_up.join(10.0)  # real-time: the stand-in is let go
    until(lambda: len(stand_in.got) == 4, 10.0)  # real-time: handed on by give_up's thread
    assert stand_in.got == [1, 2, 3, 4]
