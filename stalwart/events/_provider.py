"""Provider health and breaker events (stream ``provider:<name>``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity


class ProviderCallFailed(Event, frozen=True, tag="provider:call_failed"):
    """One attempt failed. ``call_id``: the attempt's (its ``prompt:started``);
    ``retry_of``: the failed attempt of the same call it retried on the same model ("" for
    a call's first attempt). A call is one failure however many attempts it takes, as
    seed 000's SDK retries are inside one: the health monitor and the breaker let an
    attempt's outcome stand in for the one it retried. ``probe``: whether the attempt was
    the half-open breaker's one trial (only the trial's outcome answers it; None in records
    written before the field, when any outcome while half-open did)."""

    provider: str
    model: str
    agent: str
    error_class: str
    status: int | None = None
    call_id: str = ""
    retry_of: str = ""
    probe: bool | None = None
    severity: ClassVar[Severity] = "warning"


class ProviderCallSucceeded(Event, frozen=True, tag="provider:call_succeeded"):
    """One attempt succeeded; ``retry_of`` and ``probe`` as for :class:`ProviderCallFailed`
    (a retry that succeeds takes its call's failure back). ``started_at``: when the
    attempt began (its ``prompt:started``); an attempt begun before ``provider:degraded``
    does not end the outage. None in records written before the field (any success
    while degraded did then)."""

    provider: str
    model: str
    agent: str
    latency_ms: int = 0
    retry_of: str = ""
    probe: bool | None = None
    started_at: float | None = None
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
