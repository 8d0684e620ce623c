"""Activations: the fold of a session's work queue and leases, and its pure policies.

A session's activations live in its stream. :func:`apply_activations` folds them into
:class:`ActivationsState`: the unsettled activations in order, the live lease, the lease
epoch, what the session is blocked on, the last outcome and a short claim history.

The policies decide, from that state, ``now`` and an :class:`ActivationPolicy` alone:

- :func:`next_due`: which activation a worker should run now (none while a lease is live
  or the session waits for a human);
- :func:`decide_lease`: the events of leasing it (``lease:expired`` first when taking over
  a dead holder's lease, or ``activation:abandoned`` when that expiry used up its
  attempts);
- :func:`decide_settlement`: how a wake that ended settles (acked, blocked, requeued with
  backoff 2, 4, 8, 16, 30, 30 s ..., or abandoned);
- :func:`decide_wake`: whether a delayed wake may be scheduled (dedupe key, count and
  horizon caps);
- :func:`decide_interrupt`: what an interrupt cancels.

Replay re-runs each of them on the state just before its event (``replay --verify``).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
    ActivationRequeued,
    Event,
    LeaseExpired,
    LeaseRenewed,
    RecordedEvent,
    SessionRequiresAction,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)

from ._aggregate import ApplyFolder

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "ActivationOutcome",
    "ActivationPolicy",
    "ActivationsAggregate",
    "ActivationsState",
    "Claim",
    "Lease",
    "WakeRefused",
    "WakeResult",
    "activation_backoff_ms",
    "apply_activations",
    "decide_interrupt",
    "decide_lease",
    "decide_settlement",
    "decide_wake",
    "lease_expired",
    "next_due",
]

HISTORY_KEPT = 20


class ActivationPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The knobs the policies read (the config's ``activations`` section gives them)."""

    lease_ttl_ms: int
    renew_every_ms: int
    backoff_base_ms: int
    backoff_cap_ms: int
    max_attempts: int
    max_pending_wakes: int
    max_wake_horizon_ms: int


class Activation(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An unsettled activation. ``streak`` counts its failures so far (requeues and
    expired leases); ``run_at`` is when it may run (its ``wake_at``, or a retry's time)."""

    activation_id: str
    kind: str
    ready_at: float
    run_at: float
    version: int
    message_id: str | None = None
    text: str = ""
    dedupe_key: str | None = None
    streak: int = 0
    last_error: str | None = None


class Lease(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    activation_id: str
    owner: str
    epoch: int
    expires_at: float
    leased_at: float
    covers: tuple[str, ...] = ()


class ActivationOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    activation_id: str
    status: str
    at: float
    error_class: str | None = None


class Claim(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One entry of the claim history: who leased what, at which epoch, how it ended."""

    activation_id: str
    owner: str
    epoch: int
    at: float
    ended: str | None = None


class ActivationsState(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    version: int = 0
    epoch: int = 0
    queue: tuple[Activation, ...] = ()
    lease: Lease | None = None
    blocked_on: str | None = None
    last_outcome: ActivationOutcome | None = None
    history: tuple[Claim, ...] = ()
    acked: int = 0
    requeued: int = 0
    abandoned: int = 0
    expired: int = 0

    def find(self, activation_id: str) -> Activation | None:
        for activation in self.queue:
            if activation.activation_id == activation_id:
                return activation
        return None

    @property
    def backlog(self) -> int:
        return len(self.queue)


# -- the fold -------------------------------------------------------------------------------


def _settle(
    state: ActivationsState,
    activation_id: str,
    status: str,
    at: float,
    error_class: str | None = None,
    *,
    counter: str | None = None,
) -> ActivationsState:
    """Remove ``activation_id`` (and the messages its lease covers) from the queue."""
    lease = state.lease
    ids = {activation_id}
    history = state.history
    if lease is not None and lease.activation_id == activation_id:
        ids.update(lease.covers)
        if history:
            history = (*history[:-1], msgspec.structs.replace(history[-1], ended=status))
        lease = None
    outcome = ActivationOutcome(
        activation_id=activation_id, status=status, at=at, error_class=error_class
    )
    changes: dict[str, object] = {
        "queue": tuple(a for a in state.queue if a.activation_id not in ids),
        "lease": lease,
        "history": history,
        "last_outcome": outcome,
    }
    if counter is not None:
        changes[counter] = getattr(state, counter) + 1
    return msgspec.structs.replace(state, **changes)


def apply_activations(state: ActivationsState, record: RecordedEvent) -> ActivationsState:
    """The activations after ``record`` (other events only move the version)."""
    event = record.event
    state = msgspec.structs.replace(state, version=record.version)
    match event:
        case ActivationReady():
            run_at = event.wake_at if event.wake_at is not None else record.ts
            activation = Activation(
                activation_id=event.activation_id,
                kind=event.kind,
                ready_at=record.ts,
                run_at=run_at,
                version=record.version,
                message_id=event.message_id,
                text=event.text,
                dedupe_key=event.dedupe_key,
            )
            return msgspec.structs.replace(state, queue=(*state.queue, activation))
        case ActivationLeased():
            lease = Lease(
                activation_id=event.activation_id,
                owner=event.owner,
                epoch=event.epoch,
                expires_at=event.expires_at,
                leased_at=record.ts,
                covers=event.covers,
            )
            claim = Claim(
                activation_id=event.activation_id,
                owner=event.owner,
                epoch=event.epoch,
                at=record.ts,
            )
            history = (*state.history, claim)[-HISTORY_KEPT:]
            epoch = max(state.epoch, event.epoch)
            return msgspec.structs.replace(state, lease=lease, epoch=epoch, history=history)
        case LeaseRenewed():
            held = state.lease
            if held is None or held.epoch != event.epoch:
                return state
            renewed = msgspec.structs.replace(held, expires_at=event.expires_at)
            return msgspec.structs.replace(state, lease=renewed)
        case ActivationAcked():
            return _settle(state, event.activation_id, "acked", record.ts, counter="acked")
        case ActivationBlocked():
            settled = _settle(state, event.activation_id, "blocked", record.ts)
            return msgspec.structs.replace(settled, blocked_on=event.request_id)
        case ActivationRequeued():
            return _requeued(state, event, record.ts)
        case ActivationAbandoned():
            error = event.error_class
            settled = _settle(
                state, event.activation_id, "abandoned", record.ts, error, counter="abandoned"
            )
            return msgspec.structs.replace(settled, epoch=max(settled.epoch, event.epoch))
        case ActivationCancelled():
            return _settle(state, event.activation_id, "cancelled", record.ts)
        case LeaseExpired():
            return _expired(state, event, record.ts)
        case ActivationLeaseLost():
            return state  # an observation of the old holder; the takeover already moved on
        case SessionRequiresAction():
            return msgspec.structs.replace(state, blocked_on=event.request_id)
        case UserToolConfirmation() | UserCustomToolResult():
            if state.blocked_on == event.request_id:
                return msgspec.structs.replace(state, blocked_on=None)
            return state
        case UserInterrupt():
            history = state.history
            if state.lease is not None and history and history[-1].ended is None:
                history = (*history[:-1], msgspec.structs.replace(history[-1], ended="interrupted"))
            return msgspec.structs.replace(
                state,
                blocked_on=None,
                lease=None,
                history=history,
                epoch=max(state.epoch, event.epoch),
            )
        case _:
            return state


def _requeued(state: ActivationsState, event: ActivationRequeued, at: float) -> ActivationsState:
    """The activation waits until ``run_at``; messages its lease covered stay queued
    behind it and are covered again by its next lease."""
    lease = state.lease
    queue = []
    for activation in state.queue:
        if activation.activation_id == event.activation_id:
            queue.append(
                msgspec.structs.replace(
                    activation,
                    run_at=event.run_at,
                    streak=event.streak,
                    last_error=event.error_class,
                )
            )
        else:
            queue.append(activation)
    history = state.history
    if lease is not None and history:
        history = (*history[:-1], msgspec.structs.replace(history[-1], ended="requeued"))
    outcome = ActivationOutcome(
        activation_id=event.activation_id, status="requeued", at=at, error_class=event.error_class
    )
    return msgspec.structs.replace(
        state,
        queue=tuple(queue),
        lease=None,
        history=history,
        last_outcome=outcome,
        requeued=state.requeued + 1,
    )


def _expired(state: ActivationsState, event: LeaseExpired, at: float) -> ActivationsState:
    lease = state.lease
    if lease is None or lease.epoch != event.epoch:
        return state
    queue = tuple(
        msgspec.structs.replace(a, streak=event.streak, last_error="lease_expired")
        if a.activation_id == event.activation_id
        else a
        for a in state.queue
    )
    history = state.history
    if history:
        history = (*history[:-1], msgspec.structs.replace(history[-1], ended="expired"))
    return msgspec.structs.replace(
        state, queue=queue, lease=None, history=history, expired=state.expired + 1
    )


class ActivationsAggregate:
    """The activations fold as an :class:`~stalwart.state.Aggregate`."""

    name = "activations"
    version = 1
    state_type = ActivationsState

    def initial(self, stream: str) -> ActivationsState:
        return ActivationsState(stream=stream)

    def apply(self, state: ActivationsState, record: RecordedEvent) -> ActivationsState:
        return apply_activations(state, record)

    def folder(self, state: ActivationsState) -> ApplyFolder[ActivationsState]:
        return ApplyFolder(apply_activations, state)


ACTIVATIONS = ActivationsAggregate()


# -- the policies -----------------------------------------------------------------------------


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
    """The user messages queued right behind ``head`` that the same wake answers."""
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
        if activation.kind != "message" or activation.streak:
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
        if held is not None and streak >= policy.max_attempts:
            events.append(
                ActivationAbandoned(
                    activation_id=held.activation_id,
                    attempts=streak,
                    error_class="lease_expired",
                    max_attempts=policy.max_attempts,
                    epoch=state.epoch + 1,  # claimed: the dead holder stays fenced out
                )
            )
            return events
        state = _expired(state, expired, now)
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
    return int(min(cap_ms, base_ms * 2 ** max(streak - 1, 0)))


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
) -> ActivationReady | Activation | WakeRefused:
    """Schedule a delayed wake: the ``activation:ready`` to append, the pending wake with
    the same ``dedupe_key`` (nothing to append), or why it is refused."""
    if dedupe_key is not None:
        for activation in state.queue:
            if activation.kind == "wake" and activation.dedupe_key == dedupe_key:
                return activation
    pending = sum(1 for a in state.queue if a.kind == "wake")
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


def decide_interrupt(state: ActivationsState, reason: str) -> list[Event]:
    """An interrupt: itself (claiming the next epoch, which fences out a running wake),
    then one ``activation:cancelled`` per unsettled activation, in queue order."""
    events: list[Event] = [UserInterrupt(reason=reason, epoch=state.epoch + 1)]
    events.extend(
        ActivationCancelled(activation_id=a.activation_id, reason="interrupt") for a in state.queue
    )
    return events
