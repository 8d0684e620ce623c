"""Context-engine events (stream ``context:<session id>``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity


class ContextSummaryCreated(Event, frozen=True, tag="context:summary_created"):
    summary_id: str
    depth: int
    covers: tuple[str, ...]
    descendant_count: int
    tokens: int = 0
    fallback: Literal["emergency-truncation"] | None = None
    body: str = ""


class ContextAssembled(Event, frozen=True, tag="context:assembled"):
    tokens_in: int
    tokens_out: int
    budget: int
    layers_fired: tuple[str, ...] = ()
    severity: ClassVar[Severity] = "debug"


class ContextDagDegraded(Event, frozen=True, tag="context:dag_degraded"):
    reason: Literal["spend_cap", "breaker_open", "fail_closed_rollover", "tail_over_budget"]
    tenant: str | None = None
    duration_ms: int = 0
    severity: ClassVar[Severity] = "warning"


class ContextLayerDisabled(Event, frozen=True, tag="context:layer_disabled"):
    layer: str
    failures: int
    severity: ClassVar[Severity] = "warning"
