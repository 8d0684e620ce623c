"""Session 33: a review of the second half of today's changes (cross-cutting): each
defect proven by a test that failed on the code before its fix.

Real parts only: a real LMDB store in tmp_path, the real Announcer with its Scheduler and
IoPortal, a channel whose sends wait on the test, and a ``FakeClock`` for every deadline.
Waits are on a channel, the log or an actor, each bounded by ``GUARD``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pykka
import pytest

from stalwart.actors import Announcer, GetBatches, IoPortal, RunEnded, Scheduler
from stalwart.clock import FakeClock
from stalwart.events import AnnouncementDelivered, AnnouncementQueued
from stalwart.store import EventStore
from tests._runtime_support import GUARD, of, until
from tests.test_channels_review_s33 import DEBOUNCE_S, GatedChannel, track
from tests.test_supervisor import succeeded


@pytest.fixture
def stopped_actors() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all(timeout=GUARD)


# -- the announcer: what comes back to it after it crashed -------------------------------------


# Was: DEFECT: a send under way when the announcer crashed had its outcome dropped
# (told to the dead actor): the completion stayed queued with no outcome, so the
# supervisor's sweep sent the delivered batch again
def test_a_send_that_ends_after_the_announcer_crashed_still_has_its_outcome_recorded(
    lmdb_store: EventStore, clock: FakeClock, stopped_actors: None
) -> None:
    succeeded(lmdb_store, "r1", announce=True, result="42 invoices")
    chat = GatedChannel("chat")
    crashes: list[str] = []
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        announcer = Announcer.start(
            store=lmdb_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": chat},
            on_crash=crashes.append,
        )
        announcer.tell(track("r1"))
        announcer.tell(RunEnded(run_id="r1", outcome="succeeded", result="42 invoices"))
        announcer.ask(GetBatches(), timeout=GUARD)
        clock.advance(DEBOUNCE_S)
        assert chat.started.wait(GUARD)  # queued, and with the channel
        announcer.tell(object())  # a message it does not understand: it crashes on it
        until(lambda: not announcer.is_alive(), what="the announcer crashed")
        chat.gate.set()  # the send ends: delivered
        records = until(
            lambda: (
                (rs := list(lmdb_store.read_stream("session:r1")))
                and of(AnnouncementDelivered, rs)
                and rs
            ),
            what="the delivered batch's outcome in the run's stream",
        )
    [queued] = of(AnnouncementQueued, records)
    [outcome] = of(AnnouncementDelivered, records)
    assert outcome.announcement_id == queued.announcement_id
    assert crashes == ["TypeError"]
