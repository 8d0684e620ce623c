"""Replay verification of the activation decisions (leases, takeovers, settlements,
interrupts) and the lease-expiry deadline.

- ``activation:leased`` and a takeover's ``lease:expired`` (and the abandonment an expiry
  can make): :func:`decide_lease` at the event's time, for the owner the event names;
- ``activation:requeued`` / ``activation:abandoned`` / ``activation:acked`` /
  ``activation:blocked``: :func:`decide_settlement` for the wake result the event records
  (its error class, whether it was retryable, the jitter drawn), and only under the lease
  in force: a settlement by a holder whose epoch is not the live lease's is a mismatch
  (the fence should have refused it);
- ``user:interrupt`` and the ``activation:cancelled`` that follow it: :func:`decide_interrupt`;
- ``activation:released`` (a clean stop handing its lease back): :func:`decide_release`,
  only by the live lease's holder at its epoch, claiming the next epoch (``claimed``; 0
  in logs written before a release claimed one);
- the **lease expiry** deadline: once a lease has run out, the next worker owes its
  takeover within ``activations.poll_ms`` (a worker that polls) and
  ``activations.claim_hold_ms`` (a worker that claimed it and died before deciding); it
  survives a restart (any worker owes it), and a log whose end cuts it off is not flagged.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationLeased,
    ActivationReleased,
    ActivationRequeued,
    Event,
    LeaseExpired,
    LeaseRenewed,
    RecordedEvent,
    UserInterrupt,
)

from ._activation import ACTIVATION_EVENTS, ACTIVATIONS, ActivationsState
from ._activation_policy import (
    ActivationPolicy,
    WakeResult,
    activation_backoff_ms,
    decide_interrupt,
    decide_lease,
    decide_release,
    decide_settlement,
)
from ._verify_registry import Deadline, Knobs, Selective, Verifier, moment

__all__ = ["ACTIVATION_RULES"]

_SESSIONS = "session:"
#: the activations fold as verification runs it over every session stream: only the
#: events that change it (its version, which every event moves, is not kept)
_FOLD = Selective(ACTIVATIONS, ACTIVATION_EVENTS)


#: the knobs each verified decision reads: a lease (and a takeover) its lifetime and the
#: attempts an expiry may spend; a failed wake's settlement the attempts, and a retryable
#: one's the backoff too (an ack or a block reads none)
_LEASE_KNOBS = ("lease_ttl_ms", "max_attempts")
_FAILED_KNOBS = ("max_attempts",)
_RETRY_KNOBS = ("max_attempts", "backoff_base_ms", "backoff_cap_ms")


def policy(
    knobs: Knobs, names: Iterable[str] = ActivationPolicy.__struct_fields__
) -> ActivationPolicy:
    """The activation policy of the config in force, its knobs ``names`` read (every one
    by default); the others stand at 0: a decision that does not read a knob (a wake's
    limits, the renewal period) is re-derived whatever the config records there."""
    read = {name: knobs.get_int(f"activations.{name}") for name in names}
    return ActivationPolicy(
        **{name: read.get(name, 0) for name in ActivationPolicy.__struct_fields__}
    )


def _leased(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ActivationLeased | LeaseExpired | ActivationAbandoned)
    # an expiry (and the abandonment it may bring) does not depend on who takes over
    owner = event.owner if isinstance(event, ActivationLeased) else ""
    return decide_lease(state, owner, record.ts, policy(knobs, _LEASE_KNOBS))


def _leased_why(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> str:
    lease = state.lease
    if lease is not None and record.ts < lease.expires_at:
        return (
            f"epoch {lease.epoch} held by {lease.owner} was live until "
            f"{moment(lease.expires_at)}: nobody may lease before then"
        )
    if state.blocked_on is not None:
        return f"the session waits for request {state.blocked_on}: nothing may run"
    due = [a for a in state.queue if a.run_at <= record.ts]
    if not due:
        return "no activation was due at that time"
    return f"the due activation was {due[0].activation_id}, at epoch {state.epoch + 1}"


def _under_lease(state: ActivationsState, activation_id: str, epoch: int) -> bool:
    lease = state.lease
    return lease is not None and lease.epoch == epoch and lease.activation_id == activation_id


def _settled(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    if isinstance(event, ActivationAcked):
        result = WakeResult(status="ok", outcome=event.outcome)
    elif isinstance(event, ActivationBlocked):
        result = WakeResult(status="blocked", request_id=event.request_id)
    elif isinstance(event, ActivationRequeued):
        result = WakeResult(status="failed", error_class=event.error_class, retryable=True)
    else:
        assert isinstance(event, ActivationAbandoned)
        result = WakeResult(
            status="failed", error_class=event.error_class, retryable=event.retryable
        )
    if not _under_lease(state, event.activation_id, event.epoch):
        return []
    jitter = event.jitter_ms if isinstance(event, ActivationRequeued) else 0
    rules = policy(knobs, _settlement_knobs(result))
    decided = decide_settlement(
        state, event.activation_id, event.epoch, result, record.ts, rules, jitter_ms=jitter
    )
    return [decided]


def _settlement_knobs(result: WakeResult) -> tuple[str, ...]:
    if result.status != "failed":
        return ()
    return _RETRY_KNOBS if result.retryable else _FAILED_KNOBS


def _settled_why(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> str:
    event = record.event
    assert isinstance(
        event, ActivationAcked | ActivationBlocked | ActivationRequeued | ActivationAbandoned
    )
    lease = state.lease
    if not _under_lease(state, event.activation_id, event.epoch):
        held = "no lease" if lease is None else f"epoch {lease.epoch} on {lease.activation_id}"
        return f"settled at epoch {event.epoch} while the live lease was {held}"
    held_activation = state.find(event.activation_id)
    streak = (held_activation.streak if held_activation else 0) + 1
    rules = policy(knobs, _RETRY_KNOBS)
    if isinstance(event, ActivationRequeued) and streak < rules.max_attempts:
        delay = activation_backoff_ms(streak, rules.backoff_base_ms, rules.backoff_cap_ms)
        return (
            f"failure {streak} of {rules.max_attempts} waits {delay} ms (base "
            f"{rules.backoff_base_ms} ms x 2^{streak - 1}, cap {rules.backoff_cap_ms} ms) "
            f"plus the recorded jitter; it waited {event.delay_ms} ms"
        )
    if streak >= rules.max_attempts:
        return f"failure {streak} reached max_attempts {rules.max_attempts}: abandoned"
    return f"failure {streak} of {rules.max_attempts}"


def _not_on_expiry(event: Event) -> bool:
    return not (isinstance(event, ActivationAbandoned) and event.error_class == "lease_expired")


def _interrupted(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, UserInterrupt)
    return decide_interrupt(state, event.reason)


def _cancelled(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    """A cancellation follows its interrupt in one append: the state before it has the
    interrupt folded, and the activation still queued."""
    return [
        e
        for e in decide_interrupt(state, "")[1:]
        if getattr(e, "activation_id", None) == getattr(record.event, "activation_id", "")
    ]


def _released(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    """Only the live lease's holder hands it back, at its epoch, claiming the next one (a
    release recorded before releases claimed one says ``claimed`` 0, and is checked as
    it was decided then)."""
    event = record.event
    assert isinstance(event, ActivationReleased)
    decided = decide_release(state, event.owner, event.epoch, reason=event.reason)
    if decided is None:
        return []
    if event.claimed == 0:
        decided = msgspec.structs.replace(decided, claimed=0)
    return [decided]


def _released_why(state: ActivationsState, record: RecordedEvent, knobs: Knobs) -> str:
    event = record.event
    assert isinstance(event, ActivationReleased)
    lease = state.lease
    if lease is None:
        return f"no lease was live when {event.owner} released epoch {event.epoch}"
    if lease.epoch == event.epoch and lease.owner == event.owner:
        return f"a release claims epoch {state.epoch + 1}, not epoch {event.claimed}"
    return (
        f"the live lease was epoch {lease.epoch} held by {lease.owner}, "
        f"not epoch {event.epoch} held by {event.owner}"
    )


def _takeover_slack_ms(knobs: Knobs) -> int:
    """How late a takeover may come: a poll, and the claim hold of a worker that claimed
    the session and died before deciding (its claim, in the work queue and not in the
    log, keeps the other workers off the session that long)."""
    return knobs.get_int("activations.poll_ms") + knobs.get_int("activations.claim_hold_ms")


def _lease_due(state: ActivationsState, knobs: Knobs) -> float | None:
    lease = state.lease
    return lease.expires_at if lease is not None else None


ACTIVATION_RULES: tuple[Verifier[ActivationsState] | Deadline[ActivationsState], ...] = (
    Verifier("activation:leased", _FOLD, _leased, _SESSIONS, why=_leased_why),
    Verifier("lease:expired", _FOLD, _leased, _SESSIONS, why=_leased_why),
    Verifier(
        "activation:abandoned",
        _FOLD,
        _leased,
        _SESSIONS,
        why=_leased_why,
        when=lambda e: not _not_on_expiry(e),
    ),
    Verifier(
        "activation:abandoned",
        _FOLD,
        _settled,
        _SESSIONS,
        why=_settled_why,
        when=_not_on_expiry,
    ),
    Verifier("activation:requeued", _FOLD, _settled, _SESSIONS, why=_settled_why),
    Verifier("activation:acked", _FOLD, _settled, _SESSIONS, why=_settled_why),
    Verifier("activation:blocked", _FOLD, _settled, _SESSIONS, why=_settled_why),
    Verifier("user:interrupt", _FOLD, _interrupted, _SESSIONS),
    Verifier("activation:cancelled", _FOLD, _cancelled, _SESSIONS),
    Verifier("activation:released", _FOLD, _released, _SESSIONS, why=_released_why),
    Deadline(
        "lease expiry",
        "lease:expired",
        _FOLD,
        _lease_due,
        _SESSIONS,
        slack_ms=_takeover_slack_ms,
        survives_restart=True,
        moves=frozenset(
            {
                ActivationLeased,
                LeaseRenewed,
                LeaseExpired,
                ActivationAcked,
                ActivationBlocked,
                ActivationRequeued,
                ActivationAbandoned,
                ActivationReleased,
                UserInterrupt,
            }
        ),
    ),
)
