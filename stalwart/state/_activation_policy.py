"""The pure policies of activations, deciding on :class:`ActivationsState`, ``now`` and
an :class:`ActivationPolicy` alone:

- :func:`next_due`: which activation a worker should run now (none while a lease is live
  or the session waits for a human);
- :func:`decide_lease`: the events of leasing it (``lease:expired`` first when taking over
  a dead holder's lease, or ``activation:abandoned`` when that expiry used up its
  attempts);
- :func:`decide_settlement`: how a wake that ended settles (acked, blocked, requeued with
  backoff 2, 4, 8, 16, 30, 30 s ..., or abandoned);
- :func:`decide_wake`: whether a delayed wake may be scheduled (dedupe key, count and
  horizon caps);
- :func:`decide_interrupt`: what an interrupt cancels;
- :func:`decide_release`: a clean stop handing its live lease back (no failure counted).

Replay re-runs each of them on the state just before its event (``replay --verify``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from stalwart.backoff import backoff_ceiling_ms
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
    UserInterrupt,
)

from ._activation import Activation, ActivationsState, SeenMessage, expired_lease

__all__ = [
    "ActivationPolicy",
    "WakeRefused",
    "WakeResult",
    "activation_backoff_ms",
    "decide_interrupt",
    "decide_lease",
    "decide_message",
    "decide_settlement",
    "decide_wake",
    "lease_expired",
    "next_due",
]


class ActivationPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The knobs the policies read (the config's ``activations`` section gives them)."""

    lease_ttl_ms: int
    renew_every_ms: int
    backoff_base_ms: int
    backoff_cap_ms: int
    max_attempts: int
    max_pending_wakes: int
    max_wake_horizon_ms: int


def lease_expired(state: ActivationsState, now: float) -> bool:
    """Whether the live lease has run out at ``now`` (a lease ends at ``expires_at``)."""
    return state.lease is not None and now >= state.lease.expires_at


def next_due(state: ActivationsState, now: float) -> Activation | None:
    """The activation to run at ``now``: none while a lease is live or the session waits
    for a confirmation or a tool result. User messages and resumes run in arrival order
    (a retrying one holds back those behind it); delayed wakes run when due, in due order.
    """
    if state.blocked_on is not None:
        return None
    if state.lease is not None and now < state.lease.expires_at:
        return None
    ordered = next((a for a in state.queue if a.kind != "wake"), None)
    if ordered is not None and ordered.run_at <= now:
        return ordered
    wakes = [a for a in state.queue if a.kind == "wake" and a.run_at <= now]
    if wakes:
        return min(wakes, key=lambda a: (a.run_at, a.version))
    return None


def _covers(state: ActivationsState, head: Activation) -> tuple[str, ...]:
    """The user messages queued right behind ``head`` that the same wake answers, and a
    resume among them: a wake continues the paused step whatever its kind (a message
    sent while the session waited for the answer is queued before the resume), so the
    resume's work is that wake's too, and run again on its own it would only call the
    model once more for a second, unasked reply."""
    if head.kind != "message":
        return ()
    covers: list[str] = []
    started = False
    for activation in state.queue:
        if activation.activation_id == head.activation_id:
            started = True
            continue
        if not started or activation.kind == "wake":
            continue
        if activation.kind not in ("message", "resume") or activation.streak:
            break
        covers.append(activation.activation_id)
    return tuple(covers)


def decide_lease(
    state: ActivationsState, owner: str, now: float, policy: ActivationPolicy
) -> list[Event]:
    """What leasing the due activation at ``now`` appends ([] when nothing is due).

    Taking over an expired lease first records ``lease:expired`` (a failure of that
    activation); when that failure uses up ``max_attempts`` the activation is abandoned
    instead of leased again. The new lease's epoch is one above the stream's.
    """
    events: list[Event] = []
    lease = state.lease
    if lease is not None:
        if now < lease.expires_at:
            return []
        held = state.find(lease.activation_id)
        streak = (held.streak if held is not None else 0) + 1
        expired = LeaseExpired(
            activation_id=lease.activation_id,
            owner=lease.owner,
            epoch=lease.epoch,
            expired_at=lease.expires_at,
            streak=streak,
        )
        events.append(expired)
        state = expired_lease(state, expired)
    spent = _spent_by_expiry(state, policy)
    if spent is not None:
        # decided from the state with the expiry folded, so that replay re-derives it
        # from the state just before it (the expiry precedes it in the same append)
        events.append(
            ActivationAbandoned(
                activation_id=spent.activation_id,
                attempts=spent.streak,
                error_class="lease_expired",
                max_attempts=policy.max_attempts,
                epoch=state.epoch + 1,  # claimed: the dead holder stays fenced out
            )
        )
        return events
    due = next_due(state, now)
    if due is None:
        return events
    events.append(
        ActivationLeased(
            activation_id=due.activation_id,
            owner=owner,
            epoch=state.epoch + 1,
            expires_at=now + policy.lease_ttl_ms / 1000,
            covers=_covers(state, due),
            ttl_ms=policy.lease_ttl_ms,
        )
    )
    return events


def decide_release(
    state: ActivationsState, owner: str, epoch: int, *, reason: str = "shutdown"
) -> ActivationReleased | None:
    """Hand back the lease ``owner`` holds at ``epoch`` (its process stops cleanly with
    the wake unsettled); None when that lease is no longer the live one (the wake
    settled it, or it was taken over). The release claims the next epoch (appended with
    ``Fence(claimed, claim=True)``), so the holder's wake, should it still run, has
    every later append fenced out as after a takeover."""
    lease = state.lease
    if lease is None or lease.epoch != epoch or lease.owner != owner:
        return None
    return ActivationReleased(
        activation_id=lease.activation_id,
        owner=owner,
        epoch=epoch,
        reason=reason,
        claimed=state.epoch + 1,
    )


def _spent_by_expiry(state: ActivationsState, policy: ActivationPolicy) -> Activation | None:
    """The activation whose lease expiry used up its ``max_attempts`` (the expiry folded:
    it is abandoned in the same append, so no other state holds one)."""
    for activation in state.queue:
        if activation.last_error == "lease_expired" and activation.streak >= policy.max_attempts:
            return activation
    return None


class WakeResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a wake ended: ``ok`` (``outcome`` says how the turn ended), ``blocked`` on
    ``request_id``, or ``failed`` with ``error_class`` and whether a retry may help."""

    status: Literal["ok", "blocked", "failed"]
    outcome: str = "answered"
    request_id: str | None = None
    error_class: str | None = None
    retryable: bool = False


def activation_backoff_ms(streak: int, base_ms: int, cap_ms: int) -> int:
    """The delay after failure number ``streak``: base x 2^(streak-1), capped."""
    return backoff_ceiling_ms(streak, base_ms, cap_ms)


def decide_settlement(
    state: ActivationsState,
    activation_id: str,
    epoch: int,
    result: WakeResult,
    now: float,
    policy: ActivationPolicy,
    *,
    jitter_ms: int = 0,
) -> Event:
    """The one event that settles a wake (appended fenced with ``epoch``).

    A retryable failure requeues with backoff until the failure count reaches
    ``max_attempts``, then abandons; a failure that is not retryable abandons at once.
    ``jitter_ms`` (chosen by the caller, recorded) is added to the delay.
    """
    if result.status == "ok":
        return ActivationAcked(activation_id=activation_id, epoch=epoch, outcome=result.outcome)
    if result.status == "blocked":
        return ActivationBlocked(
            activation_id=activation_id, epoch=epoch, request_id=result.request_id or ""
        )
    held = state.find(activation_id)
    streak = (held.streak if held is not None else 0) + 1
    error_class = result.error_class or "internal"
    if not result.retryable or streak >= policy.max_attempts:
        return ActivationAbandoned(
            activation_id=activation_id,
            attempts=streak,
            error_class=error_class,
            retryable=result.retryable,
            max_attempts=policy.max_attempts,
            epoch=epoch,
        )
    delay_ms = activation_backoff_ms(streak, policy.backoff_base_ms, policy.backoff_cap_ms)
    return ActivationRequeued(
        activation_id=activation_id,
        epoch=epoch,
        delay_ms=delay_ms,
        streak=streak,
        run_at=now + (delay_ms + jitter_ms) / 1000,
        error_class=error_class,
        jitter_ms=jitter_ms,
        base_ms=policy.backoff_base_ms,
        cap_ms=policy.backoff_cap_ms,
        max_attempts=policy.max_attempts,
    )


class WakeRefused(msgspec.Struct, frozen=True, kw_only=True):
    """Why a delayed wake was not scheduled: ``too_many`` pending, ``too_far`` ahead, or
    ``in_the_past`` never (a past ``wake_at`` runs at once)."""

    reason: Literal["too_many", "too_far"]
    limit: int


def decide_wake(
    state: ActivationsState,
    activation_id: str,
    wake_at: float,
    dedupe_key: str | None,
    text: str,
    now: float,
    policy: ActivationPolicy,
    owner: str | None = None,
) -> ActivationReady | Activation | WakeRefused:
    """Schedule a delayed wake: the ``activation:ready`` to append, the pending wake with
    the same ``dedupe_key`` (nothing to append), or why it is refused. The wake a live
    lease runs is not pending: a wake that re-arms itself (same key) gets a new one. Nor
    is the wake of a lease ``owner`` (the deciding runtime's worker) holds, live or late:
    its renewal may be overdue while it still runs here and acks. The wake of another
    holder's expired lease is pending (that holder died: the next worker runs it again),
    so a host that registers its wake again at start (same key) before the takeover adds
    none."""
    lease = state.lease
    running: set[str] = set()
    if lease is not None and (now < lease.expires_at or lease.owner == owner):
        running = {lease.activation_id, *lease.covers}
    waiting = [a for a in state.queue if a.kind == "wake" and a.activation_id not in running]
    if dedupe_key is not None:
        for activation in waiting:
            if activation.dedupe_key == dedupe_key:
                return activation
    pending = len(waiting)
    if pending >= policy.max_pending_wakes:
        return WakeRefused(reason="too_many", limit=policy.max_pending_wakes)
    if (wake_at - now) * 1000 > policy.max_wake_horizon_ms:
        return WakeRefused(reason="too_far", limit=policy.max_wake_horizon_ms)
    return ActivationReady(
        activation_id=activation_id,
        kind="wake",
        wake_at=max(wake_at, now),
        dedupe_key=dedupe_key,
        text=text,
    )


def decide_message(
    recent: Sequence[SeenMessage], activation_id: str, message_id: str, text: str
) -> ActivationReady | str:
    """A user message: the ``activation:ready`` to append, or the id of the activation
    that already carries ``message_id`` among the session's newest messages (``recent``,
    see :func:`remember_message`; nothing to append): a message delivered twice is run
    once."""
    for seen in recent:
        if seen.message_id == message_id:
            return seen.activation_id
    return ActivationReady(
        activation_id=activation_id, kind="message", message_id=message_id, text=text
    )


def decide_interrupt(state: ActivationsState, reason: str) -> list[Event]:
    """An interrupt: itself (claiming the next epoch, which fences out a running wake),
    then one ``activation:cancelled`` per unsettled activation, in queue order."""
    events: list[Event] = [UserInterrupt(reason=reason, epoch=state.epoch + 1)]
    events.extend(
        ActivationCancelled(activation_id=a.activation_id, reason="interrupt") for a in state.queue
    )
    return events
