"""Activation, lease and user-input events (in their session's stream).

An activation is one unit of work for a session (a user message to answer, a paused turn
to resume, a delayed wake) that a worker leases, runs as one bounded wake, and settles:
``activation:ready`` -> ``activation:leased`` -> ``activation:acked`` | ``requeued`` |
``blocked`` | ``abandoned``. Leases carry a fencing epoch (see ``stalwart.store.Fence``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity

ActivationKind = Literal["message", "resume", "wake"]


class ActivationReady(Event, frozen=True, tag="activation:ready"):
    """Work for the session. ``message``: answer the user message carried here (its id and
    text: the message joins the conversation when a wake takes it, never mid-turn);
    ``resume``: continue the paused turn; ``wake``: delayed work (``text`` says what) due
    at ``wake_at``, deduplicated by ``dedupe_key``."""

    activation_id: str
    kind: str = "wake"
    wake_at: float | None = None
    dedupe_key: str | None = None
    message_id: str | None = None
    text: str = ""


class ActivationLeased(Event, frozen=True, tag="activation:leased"):
    """A worker took the activation (and, for a user message, the ``covers`` messages
    queued behind it, which the same wake answers) until ``expires_at``."""

    activation_id: str
    owner: str
    epoch: int
    expires_at: float
    covers: tuple[str, ...] = ()
    ttl_ms: int = 0


class LeaseRenewed(Event, frozen=True, tag="lease:renewed"):
    activation_id: str
    owner: str
    epoch: int
    expires_at: float
    severity: ClassVar[Severity] = "debug"


class ActivationAcked(Event, frozen=True, tag="activation:acked"):
    activation_id: str
    epoch: int
    outcome: str = "answered"


class ActivationRequeued(Event, frozen=True, tag="activation:requeued"):
    """A retryable failure: the wake runs again at ``run_at`` (``delay_ms`` = the backoff
    for failure number ``streak``, ``base_ms`` x 2^(streak-1) capped at ``cap_ms``, plus
    ``jitter_ms``)."""

    activation_id: str
    epoch: int
    delay_ms: int
    streak: int
    run_at: float
    error_class: str
    jitter_ms: int = 0
    base_ms: int = 0
    cap_ms: int = 0
    max_attempts: int = 0
    severity: ClassVar[Severity] = "warning"


class ActivationBlocked(Event, frozen=True, tag="activation:blocked"):
    activation_id: str
    epoch: int
    request_id: str


class ActivationAbandoned(Event, frozen=True, tag="activation:abandoned"):
    """Given up: ``attempts`` failures reached ``max_attempts``, or the failure is not
    retryable. The work goes to the dead-letter stream; the user is told."""

    activation_id: str
    attempts: int
    error_class: str
    retryable: bool = True
    max_attempts: int = 0
    epoch: int = 0
    severity: ClassVar[Severity] = "error"


class ActivationCancelled(Event, frozen=True, tag="activation:cancelled"):
    """An interrupt cancelled the activation before it settled."""

    activation_id: str
    reason: str = "interrupt"
    severity: ClassVar[Severity] = "warning"


class ActivationLeaseLost(Event, frozen=True, tag="activation:lease_lost"):
    """A holder found its lease taken over (fenced): it stopped without acking."""

    activation_id: str
    owner: str
    epoch: int
    current_epoch: int = 0
    severity: ClassVar[Severity] = "warning"


class ActivationReleased(Event, frozen=True, tag="activation:released"):
    """The lease's holder handed it back unsettled (its process stopping cleanly): the
    activation runs again as soon as a worker leases it, and no failure is counted.
    ``claimed`` is the lease epoch the release claimed (one above the stream's), which
    fences out the holder's wake if it still runs; 0 in logs written before a release
    claimed one."""

    activation_id: str
    owner: str
    epoch: int
    reason: str = "shutdown"
    claimed: int = 0


class LeaseExpired(Event, frozen=True, tag="lease:expired"):
    """A lease ran out with its wake unsettled (the holder died or froze); ``streak`` is
    the activation's failure count with this one."""

    activation_id: str
    owner: str
    epoch: int
    expired_at: float
    streak: int = 0
    severity: ClassVar[Severity] = "warning"


class UserToolConfirmation(Event, frozen=True, tag="user:tool_confirmation"):
    request_id: str
    allow: bool


class UserCustomToolResult(Event, frozen=True, tag="user:custom_tool_result"):
    request_id: str
    output: str


class UserInterrupt(Event, frozen=True, tag="user:interrupt"):
    """Clears the pending request and cancels every unsettled activation; ``epoch`` is
    the lease epoch it claimed, which fences out a wake still running."""

    reason: str = ""
    epoch: int = 0
