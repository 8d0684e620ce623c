"""`NEXT RUN` in the operator's views says when a worker may next run something (s35).

A real LMDB store: messages recorded with ``send_message``, a worker's lease and requeue
appended as a worker records them, the activations folded from the log."""

from __future__ import annotations

from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationBlocked,
    ActivationLeased,
    ActivationRequeued,
    SessionRequiresAction,
)
from stalwart.runtime import send_message
from stalwart.state import ACTIVATIONS, retry_posture
from stalwart.store import EventStore, NewEvent, load_state

BACKOFF_S = 16.0


def _requeued_first(store: EventStore, clock: FakeClock) -> tuple[str, float]:
    """Message 1 leased and failed (its retry in 16 s); message 2 sent since."""
    first = send_message(store, "s1", "one")
    now = clock.now()
    leased = ActivationLeased(activation_id=first, owner="w1", epoch=1, expires_at=now + 30)
    run_at = now + BACKOFF_S
    requeued = ActivationRequeued(
        activation_id=first,
        epoch=1,
        delay_ms=int(BACKOFF_S * 1000),
        streak=1,
        run_at=run_at,
        error_class="provider_timeout",
    )
    store.append("session:s1", [NewEvent(event=leased, ts=now), NewEvent(event=requeued, ts=now)])
    clock.advance(1)
    send_message(store, "s1", "two", ts=clock.now())
    return first, run_at


# Was: DEFECT: a message queued behind a retrying one showed NEXT RUN at its own arrival
# ("1s ago", which the docs read as "no worker is polling this store"); messages run in
# order, so nothing runs before the retry
def test_a_message_behind_a_retry_shows_the_retrys_time(
    store: EventStore, clock: FakeClock
) -> None:
    first, run_at = _requeued_first(store, clock)
    posture = retry_posture(load_state(store, "session:s1", ACTIVATIONS))
    assert (posture.retrying, posture.attempt) == (first, 2)
    assert posture.next_run_at == run_at


# Was: DEFECT: a session waiting for an operator's answer showed a NEXT RUN in the past
def test_a_session_waiting_for_a_human_has_no_next_run(store: EventStore, clock: FakeClock) -> None:
    first = send_message(store, "s1", "one")
    now = clock.now()
    leased = ActivationLeased(activation_id=first, owner="w1", epoch=1, expires_at=now + 30)
    asked = SessionRequiresAction(request_id="r1", kind="approval", tool="x", call_id="c1")
    store.append("session:s1", [NewEvent(event=leased, ts=now)])
    blocked = ActivationBlocked(activation_id=first, epoch=1, request_id="r1")
    store.append("session:s1", [NewEvent(event=asked, ts=now), NewEvent(event=blocked, ts=now)])
    clock.advance(5)
    send_message(store, "s1", "are you there?", ts=clock.now())
    assert retry_posture(load_state(store, "session:s1", ACTIVATIONS)).next_run_at is None
