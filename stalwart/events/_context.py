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
    """One assembly. The pipeline engine also records its provider, sizes in and out,
    the layers that raised, and ``input_count`` / ``input_digest`` (a hash of the input's
    message ids, never content) so its signature scrubber can tell, after a restart,
    whether the next input still extends this one."""

    tokens_in: int
    tokens_out: int
    budget: int
    layers_fired: tuple[str, ...] = ()
    engine: str = ""
    provider: str = ""
    messages_in: int = 0
    messages_out: int = 0
    chars_in: int = 0
    chars_out: int = 0
    layers_failed: tuple[str, ...] = ()
    input_count: int = 0
    input_digest: str = ""
    severity: ClassVar[Severity] = "debug"


class ContextDagDegraded(Event, frozen=True, tag="context:dag_degraded"):
    reason: Literal["spend_cap", "breaker_open", "fail_closed_rollover", "tail_over_budget"]
    tenant: str | None = None
    duration_ms: int = 0
    severity: ClassVar[Severity] = "warning"


class ContextLayerDisabled(Event, frozen=True, tag="context:layer_disabled"):
    """A pipeline layer raised ``failures`` times in a row (or failed its half-open
    trial) and is skipped until ``retry_at`` (unix seconds), when one trial run is made.
    ``error`` is the exception's class name, never its message."""

    layer: str
    failures: int
    error: str = ""
    cooldown_s: float = 0.0
    retry_at: float | None = None
    severity: ClassVar[Severity] = "warning"


class ContextLayerHalfOpened(Event, frozen=True, tag="context:layer_half_opened"):
    """A disabled pipeline layer's cooldown passed: the next run tries it once."""

    layer: str


class ContextLayerEnabled(Event, frozen=True, tag="context:layer_enabled"):
    """A pipeline layer's half-open trial succeeded: it runs again on every assembly."""

    layer: str


class ContextCompacted(Event, frozen=True, tag="context:compacted"):
    """The pipeline engine's LLM compaction: ``covers`` (message ids) are replaced by one
    assistant message with ``body`` (the summary as rendered, wrapped as untrusted) from
    now on. Carries the numbers that triggered it: ``tokens`` >= ``threshold`` x
    ``budget`` at user turn ``turn``, with the previous compaction at ``previous_turn``."""

    summary_id: str
    turn: int
    covers: tuple[str, ...]
    through_seq: int
    tokens: int
    budget: int
    threshold: float
    previous_turn: int | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    body: str = ""
