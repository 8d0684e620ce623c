"""Activation, lease and user-input events (in their session's stream)."""

from __future__ import annotations

from typing import ClassVar

from ._base import Event, Severity


class ActivationReady(Event, frozen=True, tag="activation:ready"):
    activation_id: str
    kind: str = "wake"
    wake_at: float | None = None
    dedupe_key: str | None = None


class ActivationLeased(Event, frozen=True, tag="activation:leased"):
    activation_id: str
    owner: str
    epoch: int
    expires_at: float


class LeaseRenewed(Event, frozen=True, tag="lease:renewed"):
    activation_id: str
    owner: str
    epoch: int
    expires_at: float
    severity: ClassVar[Severity] = "debug"


class ActivationAcked(Event, frozen=True, tag="activation:acked"):
    activation_id: str
    epoch: int


class ActivationRequeued(Event, frozen=True, tag="activation:requeued"):
    activation_id: str
    epoch: int
    delay_ms: int
    streak: int
    run_at: float
    error_class: str
    jitter_ms: int = 0
    severity: ClassVar[Severity] = "warning"


class ActivationBlocked(Event, frozen=True, tag="activation:blocked"):
    activation_id: str
    epoch: int
    request_id: str


class ActivationAbandoned(Event, frozen=True, tag="activation:abandoned"):
    activation_id: str
    attempts: int
    error_class: str
    severity: ClassVar[Severity] = "error"


class ActivationLeaseLost(Event, frozen=True, tag="activation:lease_lost"):
    activation_id: str
    owner: str
    epoch: int
    severity: ClassVar[Severity] = "warning"


class LeaseExpired(Event, frozen=True, tag="lease:expired"):
    activation_id: str
    owner: str
    epoch: int
    expired_at: float
    severity: ClassVar[Severity] = "warning"


class UserToolConfirmation(Event, frozen=True, tag="user:tool_confirmation"):
    request_id: str
    allow: bool


class UserCustomToolResult(Event, frozen=True, tag="user:custom_tool_result"):
    request_id: str
    output: str


class UserInterrupt(Event, frozen=True, tag="user:interrupt"):
    reason: str = ""
