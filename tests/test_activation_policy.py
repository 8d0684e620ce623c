"""The activation fold and its pure policies: leases, expiry, backoff, wakes, interrupts."""

from __future__ import annotations

import msgspec
import pytest

from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    Event,
    LeaseExpired,
    LeaseRenewed,
    SessionRequiresAction,
    UserInterrupt,
    UserToolConfirmation,
)
from stalwart.state import (
    ACTIVATIONS,
    MESSAGES_KEPT,
    Activation,
    ActivationPolicy,
    ActivationsState,
    SeenMessage,
    WakeRefused,
    WakeResult,
    decide_interrupt,
    decide_lease,
    decide_message,
    decide_release,
    decide_settlement,
    decide_wake,
    due_hint,
    next_due,
    remember_message,
)

from ._log import FoldedLog

POLICY = ActivationPolicy(
    lease_ttl_ms=30_000,
    renew_every_ms=10_000,
    backoff_base_ms=2_000,
    backoff_cap_ms=30_000,
    max_attempts=5,
    max_pending_wakes=3,
    max_wake_horizon_ms=3_600_000,
)
FAIL = WakeResult(status="failed", error_class="overloaded", retryable=True)


def log() -> FoldedLog[ActivationsState]:
    return FoldedLog(ACTIVATIONS, "session:s")


def message(log: FoldedLog[ActivationsState], n: int, ts: float) -> None:
    log.add(ActivationReady(activation_id=f"a{n}", kind="message", message_id=f"m{n}"), ts)


def apply_all(log: FoldedLog[ActivationsState], events: list[Event], ts: float) -> None:
    for event in events:
        log.add(event, ts)


def test_a_ready_message_is_due_at_once_and_leased_at_the_next_epoch() -> None:
    folded = log()
    message(folded, 1, 10.0)
    assert next_due(folded.state, 10.0) is not None
    events = decide_lease(folded.state, "w1", 10.0, POLICY)
    assert events == [
        ActivationLeased(
            activation_id="a1", owner="w1", epoch=1, expires_at=40.0, covers=(), ttl_ms=30_000
        )
    ]
    apply_all(folded, events, 10.0)
    assert folded.state.lease is not None
    assert folded.state.epoch == 1
    assert decide_lease(folded.state, "w2", 39.999, POLICY) == []  # a live lease holds


def test_messages_queued_behind_are_covered_by_the_same_wake() -> None:
    folded = log()
    for n in (1, 2, 3):
        message(folded, n, 1.0)
    (leased,) = decide_lease(folded.state, "w", 1.0, POLICY)
    assert isinstance(leased, ActivationLeased)
    assert leased.covers == ("a2", "a3")
    folded.add(leased, 1.0)
    folded.add(ActivationAcked(activation_id="a1", epoch=1), 2.0)
    assert folded.state.queue == ()
    assert folded.state.last_outcome is not None
    assert folded.state.last_outcome.status == "acked"


def test_lease_expiry_boundary_and_takeover_records_the_expiry() -> None:
    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w1", 0.0, POLICY), 0.0)
    folded.add(LeaseRenewed(activation_id="a1", owner="w1", epoch=1, expires_at=45.0), 15.0)
    assert decide_lease(folded.state, "w2", 44.999, POLICY) == []
    events = decide_lease(folded.state, "w2", 45.0, POLICY)
    assert [type(e) for e in events] == [LeaseExpired, ActivationLeased]
    expired, leased = events
    assert isinstance(expired, LeaseExpired)
    assert expired.streak == 1
    assert expired.owner == "w1"
    assert isinstance(leased, ActivationLeased)
    assert leased.epoch == 2
    assert leased.owner == "w2"
    apply_all(folded, events, 45.0)
    held = folded.state.find("a1")
    assert held is not None
    assert held.streak == 1
    assert [c.ended for c in folded.state.history] == ["expired", None]


def test_a_released_lease_runs_again_at_once_with_no_failure_counted() -> None:
    """Only the live lease's holder, at its epoch, hands it back; the activation (and the
    messages its lease covered) stays queued with its streak, due at once."""
    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w1", 0.0, POLICY), 0.0)
    message(folded, 2, 1.0)
    assert decide_release(folded.state, "w2", 1) is None  # not the holder
    assert decide_release(folded.state, "w1", 2) is None  # not the live epoch
    released = decide_release(folded.state, "w1", 1)
    assert released == ActivationReleased(activation_id="a1", owner="w1", epoch=1, claimed=2)
    assert due_hint([(released, 5.0)]) == 5.0  # the work queue looks at once
    folded.add(released, 5.0)
    state = folded.state
    assert state.lease is None
    assert [(a.activation_id, a.streak) for a in state.queue] == [("a1", 0), ("a2", 0)]
    assert [c.ended for c in state.history] == ["released"]
    assert decide_release(state, "w1", 1) is None  # handed back already
    events = decide_lease(state, "w2", 5.0, POLICY)  # no TTL to wait out, no expiry
    # the release claimed epoch 2 (fencing its holder out): the next lease takes 3
    assert [(type(e), getattr(e, "epoch", None)) for e in events] == [(ActivationLeased, 3)]
    assert isinstance(events[0], ActivationLeased)
    assert events[0].covers == ("a2",)


def test_a_lease_that_keeps_expiring_is_abandoned_at_max_attempts() -> None:
    folded = log()
    message(folded, 1, 0.0)
    now = 0.0
    for attempt in range(1, 6):
        events = decide_lease(folded.state, f"w{attempt}", now, POLICY)
        apply_all(folded, events, now)
        now += 30.0
    events = decide_lease(folded.state, "w6", now, POLICY)
    assert [type(e) for e in events] == [LeaseExpired, ActivationAbandoned]
    abandoned = events[1]
    assert isinstance(abandoned, ActivationAbandoned)
    assert (abandoned.attempts, abandoned.error_class) == (5, "lease_expired")
    apply_all(folded, events, now)
    assert folded.state.queue == ()
    assert folded.state.abandoned == 1


@pytest.mark.parametrize("max_attempts", [7])
def test_backoff_sequence_is_2_4_8_16_30_30(max_attempts: int) -> None:
    long = msgspec.structs.replace(POLICY, max_attempts=max_attempts)
    folded = log()
    message(folded, 1, 0.0)
    now, delays = 0.0, []
    for _ in range(6):
        events = decide_lease(folded.state, "w", now, long)
        apply_all(folded, events, now)
        leased = events[-1]
        assert isinstance(leased, ActivationLeased)
        requeued = decide_settlement(folded.state, "a1", leased.epoch, FAIL, now + 1, long)
        assert isinstance(requeued, ActivationRequeued)
        delays.append(requeued.delay_ms // 1000)
        folded.add(requeued, now + 1)
        assert next_due(folded.state, requeued.run_at - 0.001) is None  # never a hot loop
        assert next_due(folded.state, requeued.run_at) is not None
        now = requeued.run_at
    assert delays == [2, 4, 8, 16, 30, 30]
    final = decide_lease(folded.state, "w", now, long)
    apply_all(folded, final, now)
    abandoned = decide_settlement(folded.state, "a1", folded.state.epoch, FAIL, now, long)
    assert isinstance(abandoned, ActivationAbandoned)
    assert abandoned.attempts == 7


def test_a_success_resets_the_streak_and_a_non_retryable_failure_abandons_at_once() -> None:
    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w", 0.0, POLICY), 0.0)
    requeued = decide_settlement(folded.state, "a1", 1, FAIL, 1.0, POLICY)
    folded.add(requeued, 1.0)
    apply_all(folded, decide_lease(folded.state, "w", 3.0, POLICY), 3.0)
    folded.add(ActivationAcked(activation_id="a1", epoch=2), 4.0)
    message(folded, 2, 5.0)  # a new activation starts with no streak
    apply_all(folded, decide_lease(folded.state, "w", 5.0, POLICY), 5.0)
    again = decide_settlement(folded.state, "a2", 3, FAIL, 6.0, POLICY)
    assert isinstance(again, ActivationRequeued)
    assert again.streak == 1
    assert again.delay_ms == 2000
    fatal = WakeResult(status="failed", error_class="bad_request", retryable=False)
    abandoned = decide_settlement(folded.state, "a2", 3, fatal, 6.0, POLICY)
    assert isinstance(abandoned, ActivationAbandoned)
    assert (abandoned.attempts, abandoned.retryable) == (1, False)


def test_jitter_is_added_and_recorded() -> None:
    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w", 0.0, POLICY), 0.0)
    requeued = decide_settlement(folded.state, "a1", 1, FAIL, 10.0, POLICY, jitter_ms=250)
    assert isinstance(requeued, ActivationRequeued)
    assert (requeued.delay_ms, requeued.jitter_ms, requeued.run_at) == (2000, 250, 12.25)


def test_a_blocked_session_runs_nothing_until_confirmed() -> None:
    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w", 0.0, POLICY), 0.0)
    folded.add(SessionRequiresAction(request_id="r1", kind="approval", tool="rm"), 1.0)
    folded.add(ActivationBlocked(activation_id="a1", epoch=1, request_id="r1"), 1.0)
    message(folded, 2, 2.0)
    assert folded.state.blocked_on == "r1"
    assert next_due(folded.state, 100.0) is None
    folded.add(UserToolConfirmation(request_id="other", allow=True), 3.0)
    assert folded.state.blocked_on == "r1"
    folded.add(UserToolConfirmation(request_id="r1", allow=True), 3.0)
    folded.add(ActivationReady(activation_id="r", kind="resume"), 3.0)
    due = next_due(folded.state, 3.0)
    assert due is not None
    assert due.activation_id == "a2"


def test_delayed_wakes_dedupe_caps_and_horizon() -> None:
    folded = log()
    ready = decide_wake(folded.state, "w1", 100.0, "daily", "check", 0.0, POLICY)
    assert isinstance(ready, ActivationReady)
    assert ready.wake_at == 100.0
    folded.add(ready, 0.0)
    same = decide_wake(folded.state, "w2", 200.0, "daily", "check", 0.0, POLICY)
    assert isinstance(same, Activation)
    assert same.activation_id == "w1"
    for n in (3, 4):
        wake = decide_wake(folded.state, f"w{n}", 50.0, None, "x", 0.0, POLICY)
        assert isinstance(wake, ActivationReady)
        folded.add(wake, 0.0)
    full = decide_wake(folded.state, "w5", 50.0, None, "x", 0.0, POLICY)
    assert full == WakeRefused(reason="too_many", limit=3)
    far = decide_wake(log().state, "w6", 3600.001, None, "x", 0.0, POLICY)
    assert far == WakeRefused(reason="too_far", limit=3_600_000)
    edge = decide_wake(log().state, "w7", 3600.0, None, "x", 0.0, POLICY)
    assert isinstance(edge, ActivationReady)
    assert next_due(folded.state, 49.999) is None
    due = next_due(folded.state, 50.0)
    assert due is not None
    assert due.activation_id == "w3"


def _recent(events: list[Event]) -> tuple[SeenMessage, ...]:
    recent: tuple[SeenMessage, ...] = ()
    for event in events:
        recent = remember_message(recent, event)
    return recent


def test_a_message_given_again_with_its_id_returns_the_activation_that_carries_it() -> None:
    first = decide_message((), "a1", "m1", "where is order 7?")
    assert first == ActivationReady(
        activation_id="a1", kind="message", message_id="m1", text="where is order 7?"
    )
    acked = ActivationAcked(activation_id="a1", epoch=1)  # settled: remembered all the same
    wake = ActivationReady(activation_id="w1", kind="wake", text="check")  # not a message
    recent = _recent([first, acked, wake])
    assert [seen.message_id for seen in recent] == ["m1"]
    assert decide_message(recent, "a2", "m1", "where is order 7?") == "a1"


def test_message_ids_are_remembered_for_the_newest_messages_only() -> None:
    recent = _recent(
        [
            ActivationReady(activation_id=f"a{n}", kind="message", message_id=f"m{n}")
            for n in range(MESSAGES_KEPT + 1)
        ]
    )
    assert len(recent) == MESSAGES_KEPT
    assert decide_message(recent, "again", "m1", "") == "a1"
    forgotten = decide_message(recent, "again", "m0", "")  # older than the window
    assert isinstance(forgotten, ActivationReady)
    assert forgotten.activation_id == "again"


def test_a_wake_does_not_wait_behind_a_retrying_message() -> None:
    folded = log()
    message(folded, 1, 0.0)
    folded.add(ActivationReady(activation_id="w", kind="wake", wake_at=1.0), 0.0)
    apply_all(folded, decide_lease(folded.state, "x", 0.0, POLICY), 0.0)
    folded.add(decide_settlement(folded.state, "a1", 1, FAIL, 0.5, POLICY), 0.5)
    due = next_due(folded.state, 1.0)
    assert due is not None
    assert due.activation_id == "w"


def test_an_interrupt_cancels_everything_unsettled_and_claims_the_next_epoch() -> None:
    folded = log()
    message(folded, 1, 0.0)
    message(folded, 2, 0.0)
    apply_all(folded, decide_lease(folded.state, "w", 0.0, POLICY), 0.0)
    folded.add(SessionRequiresAction(request_id="r", kind="custom_tool", tool="t"), 0.5)
    events = decide_interrupt(folded.state, "user")
    assert events[0] == UserInterrupt(reason="user", epoch=2)
    assert events[1:] == [
        ActivationCancelled(activation_id="a1"),
        ActivationCancelled(activation_id="a2"),
    ]
    apply_all(folded, events, 1.0)
    state = folded.state
    assert (state.queue, state.lease, state.blocked_on, state.epoch) == ((), None, None, 2)


def test_events_outside_activation_events_move_only_the_version() -> None:
    """Replay verification folds only ACTIVATION_EVENTS; every other event must leave the
    activations as they were but for the version."""
    from stalwart.events import ActivationLeaseLost, MessageAppended, TurnStarted
    from stalwart.state._activation import ACTIVATION_EVENTS

    folded = log()
    message(folded, 1, 0.0)
    apply_all(folded, decide_lease(folded.state, "w1", 1.0, POLICY), 1.0)
    before = folded.state
    others: list[Event] = [
        MessageAppended(message_id="m", role="user", content="hi"),
        TurnStarted(turn_id="t"),
        ActivationLeaseLost(activation_id="a1", owner="w0", epoch=1, current_epoch=2),
    ]
    for event in others:
        assert type(event) not in ACTIVATION_EVENTS
        after = folded.add(event, 2.0)
        assert msgspec.structs.replace(after, version=before.version) == before
