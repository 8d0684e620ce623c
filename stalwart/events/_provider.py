"""Provider health and breaker events (stream ``provider:<name>``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity


class ProviderCallFailed(Event, frozen=True, tag="provider:call_failed"):
    """One attempt failed. ``retried``: the caller tries the same model again (an attempt
    inside one call, as an SDK's retries are: the breaker and the health monitor count
    calls, so neither counts this one, except as a half-open breaker's probe)."""

    provider: str
    model: str
    agent: str
    error_class: str
    status: int | None = None
    retried: bool = False
    severity: ClassVar[Severity] = "warning"


class ProviderCallSucceeded(Event, frozen=True, tag="provider:call_succeeded"):
    provider: str
    model: str
    agent: str
    latency_ms: int = 0
    severity: ClassVar[Severity] = "debug"


class ProviderDegraded(Event, frozen=True, tag="provider:degraded"):
    provider: str
    rule: Literal["agents", "consecutive"]
    agents: tuple[str, ...] = ()
    failures: int = 0
    window_ms: int = 0
    severity: ClassVar[Severity] = "error"


class ProviderRecovered(Event, frozen=True, tag="provider:recovered"):
    provider: str
    rule: Literal["quiet_window", "probe", "success"] = "quiet_window"


class BreakerOpened(Event, frozen=True, tag="breaker:opened"):
    provider: str
    failures: int
    threshold: int
    reset_timeout_ms: int = 0
    severity: ClassVar[Severity] = "warning"


class BreakerHalfOpened(Event, frozen=True, tag="breaker:half_opened"):
    provider: str


class BreakerClosed(Event, frozen=True, tag="breaker:closed"):
    provider: str
