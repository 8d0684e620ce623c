"""A wake registered again with its key while its last holder's lease has expired (s35).

A real LMDB store: the wake scheduled with ``schedule_wake``, a worker's lease appended as
a worker records it, the holder dies (its lease runs out), and the host registers its
wake again at start, as a host that re-arms its wakes does."""

from __future__ import annotations

from stalwart.clock import FakeClock
from stalwart.events import ActivationLeased, SessionCreated
from stalwart.runtime import schedule_wake
from stalwart.state import ACTIVATIONS
from stalwart.store import EventStore, NewEvent, load_state
from tests.test_activation_policy import POLICY


# Was: DEFECT: the wake of an expired lease counted as running, so the same key added a
# second wake: both ran once a worker took the session over
def test_a_wake_registered_again_after_its_holder_died_is_the_same_wake(
    store: EventStore, clock: FakeClock
) -> None:
    store.append("session:s1", [NewEvent(event=SessionCreated(), ts=clock.now())])
    now = clock.now()
    first = schedule_wake(
        store, "s1", now + 60, now=now, policy=POLICY, text="digest", dedupe_key="daily"
    )
    clock.advance(60)
    now = clock.now()
    leased = ActivationLeased(activation_id=first, owner="w1", epoch=1, expires_at=now + 30)
    store.append("session:s1", [NewEvent(event=leased, ts=now)])
    clock.advance(120)  # the holder died: its lease ran out, nobody took over yet
    now = clock.now()
    again = schedule_wake(
        store, "s1", now + 5, now=now, policy=POLICY, text="digest", dedupe_key="daily"
    )
    assert again == first  # its wake runs again after the takeover: nothing added
    wakes = [a for a in load_state(store, "session:s1", ACTIVATIONS).queue if a.kind == "wake"]
    assert [w.activation_id for w in wakes] == [first]


def test_a_wake_re_armed_by_its_own_runtime_with_its_renewal_overdue_is_a_new_wake(
    store: EventStore, clock: FakeClock
) -> None:
    # the holder still runs it here (a late renewal): its ack will settle it, so the
    # re-armed schedule must be a wake of its own, or it is lost with that ack
    store.append("session:s1", [NewEvent(event=SessionCreated(), ts=clock.now())])
    now = clock.now()
    first = schedule_wake(
        store, "s1", now + 60, now=now, policy=POLICY, text="digest", dedupe_key="daily"
    )
    clock.advance(60)
    now = clock.now()
    leased = ActivationLeased(activation_id=first, owner="w1", epoch=1, expires_at=now + 30)
    store.append("session:s1", [NewEvent(event=leased, ts=now)])
    clock.advance(45)  # past its lease: the renewal is overdue
    now = clock.now()
    again = schedule_wake(
        store,
        "s1",
        now + 1_800,
        now=now,
        policy=POLICY,
        text="digest",
        dedupe_key="daily",
        owner="w1",
    )
    assert again != first
