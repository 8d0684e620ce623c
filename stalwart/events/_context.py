"""Context-engine events (stream ``context:<session id>``)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from ._base import Event, Severity


class ContextSummaryCreated(Event, frozen=True, tag="context:summary_created"):
    """A summary of the DAG engine: ``covers`` are the ids it replaces in order (message
    ids for a leaf at depth 0, summary ids for a condensed one), ``descendant_count`` the
    stored messages under it. ``first_seq``..``last_seq`` and ``earliest``..``latest``
    are the message range and time range it covers; ``input_tokens`` / ``output_tokens``
    what the summarizer spent (0 for an emergency truncation, made without one) and
    ``tenant`` whom it is charged to."""

    summary_id: str
    depth: int
    covers: tuple[str, ...]
    descendant_count: int
    tokens: int = 0
    fallback: Literal["emergency-truncation"] | None = None
    body: str = ""
    first_seq: int = 0
    last_seq: int = 0
    earliest: float = 0.0
    latest: float = 0.0
    topics: tuple[str, ...] = ()
    input_tokens: int = 0
    output_tokens: int = 0
    tenant: str | None = None


class ContextAssembled(Event, frozen=True, tag="context:assembled"):
    """One assembly. The pipeline engine also records its provider, sizes in and out,
    the layers that raised, and ``input_count`` / ``input_digest`` (a hash of the input's
    message ids, never content) so its signature scrubber can tell, after a restart,
    whether the next input still extends this one.

    ``fence`` is the cache fence: ``messages[:fence]`` are sent unchanged on the next
    call unless it breaks. The pipeline engine also records ``fence_input`` (the input
    messages before the fence), ``fence_turn`` (the user turn the messages behind it were
    last shaped at) and ``cache_break``: why this call shaped again what was behind the
    previous fence (``new``, ``rebuilt``, ``replay``, ``budget``,
    ``late_result``, ``compaction``, ``step``, ``threshold``), None when the fence held
    or there is none."""

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
    summaries_made: int = 0
    fence: int = 0
    evicted: int = 0
    repairs: int = 0
    #: the DAG engine shrank the fresh tail to fit (an over-budget episode goes on);
    #: False once it fits again, which ends the episode
    tail_clipped: bool = False
    fence_input: int = 0
    fence_turn: int = 0
    cache_break: str | None = None
    #: the pipeline engine left this many of the newest turn's oldest tool steps out
    steps_left_out: int = 0
    severity: ClassVar[Severity] = "debug"


class ContextDagDegraded(Event, frozen=True, tag="context:dag_degraded"):
    """The DAG engine degraded by a rule; ids, numbers and the knob, never content.

    ``knob`` names the config key that bound it, ``used`` / ``limit`` the numbers it
    compared (tokens spent and the cap, the tail's tokens and the budget, consecutive
    failures and the threshold), ``until`` when the window or breaker lets the
    summarizer run again (None when unknown), ``summary_id`` the emergency truncation
    made instead."""

    reason: Literal["spend_cap", "breaker_open", "fail_closed_rollover", "tail_over_budget"]
    tenant: str | None = None
    duration_ms: int = 0
    session: str | None = None
    knob: str | None = None
    used: int = 0
    limit: int = 0
    until: float | None = None
    summary_id: str | None = None
    severity: ClassVar[Severity] = "warning"


class ContextSummarizerFailed(Event, frozen=True, tag="context:summarizer_failed"):
    """A summarizer call raised or overran its trial window; counted by the breaker.
    ``error_class`` is the exception's class name, never its message."""

    tenant: str | None = None
    error_class: str = "exception"
    duration_ms: int = 0
    #: what a call that answered but too late (``trial_timeout``) spent: it counts
    #: against the tenant's spend cap like a summary's
    input_tokens: int = 0
    output_tokens: int = 0
    severity: ClassVar[Severity] = "warning"


class ContextLedgerOpened(Event, frozen=True, tag="context:ledger_opened"):
    """The first event of a tenant's summarizer ledger (stream ``context-ledger:<tenant>``,
    ``context-ledger`` for no tenant): the governor as the ``context:<session>`` streams
    recorded it before the ledger existed (a log older than it), carried on from here.
    ``spend`` is ``(ts, tokens)`` within the last day, oldest first."""

    tenant: str | None = None
    spend: tuple[tuple[float, int], ...] = ()
    consecutive_failures: int = 0
    last_failure_at: float | None = None
    severity: ClassVar[Severity] = "debug"


class LegacyGovernor(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's summarizer governor as the ``context:<session>`` streams recorded it
    (a log older than the ledger), in ``context:legacy_counted``: ``spend`` is ``(ts,
    tokens)`` within the day before the count, oldest first."""

    tenant: str | None = None
    spend: tuple[tuple[float, int], ...] = ()
    consecutive_failures: int = 0
    last_failure_at: float | None = None


class ContextLegacyCounted(Event, frozen=True, tag="context:legacy_counted"):
    """The summarizer governors of the tenants that had no ledger yet, folded from every
    ``context:<session>`` stream's records at positions up to ``covers`` (stream
    ``context-legacy``): a ledger opened later starts from this and the records after
    ``covers``, not from every session's stream. A tenant whose governor is the initial
    one is left out."""

    covers: int
    governors: tuple[LegacyGovernor, ...] = ()
    severity: ClassVar[Severity] = "debug"


class ContextSummarizerReserved(Event, frozen=True, tag="context:summarizer_reserved"):
    """A summarizer call the tenant's governor let run, recorded in its ledger before the
    call (with the ledger's version expected, so workers sharing a store admit calls one
    at a time): ``tokens`` it may spend (counted against the caps until it is released),
    ``trial`` when it is the half-open breaker's single trial, and ``lease_ms`` after
    which a call never released (its worker died) counts no more."""

    call_id: str
    tenant: str | None = None
    session: str | None = None
    tokens: int = 0
    trial: bool = False
    lease_ms: int = 0
    severity: ClassVar[Severity] = "debug"


class ContextCalibrated(Event, frozen=True, tag="context:calibrated"):
    """The token estimator of ``provider``'s ``model`` took in one more report of the
    provider's own count: ``estimated`` (uncalibrated) against ``reported``. ``factor``
    and ``observations`` are the estimator's after it, appended with the stream's
    version expected, so the newest record is the fold of every report before it: a
    process that starts reads it and counts as the one before it did."""

    provider: str
    model: str
    estimated: int
    reported: int
    factor: float
    observations: int


class ContextSummarizerRefused(Event, frozen=True, tag="context:summarizer_refused"):
    """A summarizer call the tenant's governor refused, recorded in its ledger with the
    ledger's version expected (so the refusal was decided on the ledger just before it):
    the estimate ``tokens``, the rule (``spend_cap`` or ``breaker_open``), its ``knob``,
    the numbers it compared (``used`` / ``limit``) and ``until`` when it lets calls run
    again (None when unknown: calls still running hold the cap or the trial). A worker
    records a refusal once while neither the ledger nor the verdict changes; the sessions
    it degraded record ``context:dag_degraded``."""

    tenant: str | None = None
    session: str | None = None
    tokens: int = 0
    reason: Literal["spend_cap", "breaker_open"] = "spend_cap"
    knob: str | None = None
    used: int = 0
    limit: int = 0
    until: float | None = None


class ContextSummarizerReleased(Event, frozen=True, tag="context:summarizer_released"):
    """A reserved summarizer call ended: what it spent, and ``error_class`` (the
    exception's class name, or ``trial_timeout``) when it failed, which the breaker
    counts; None when it answered, which closes the breaker."""

    call_id: str
    tenant: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error_class: str | None = None
    duration_ms: int = 0
    severity: ClassVar[Severity] = "debug"


class ContextBound(Event, frozen=True, tag="context:bound"):
    """The first event of ``context:<session>``: the session and tenant it belongs to.
    A later write naming another tenant is refused (fail-closed rollover)."""

    session: str
    tenant: str | None = None


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
    """The pipeline engine's LLM compaction: from now on the messages it covers are
    replaced by one assistant message with ``body`` (the summary as rendered, wrapped as
    untrusted). What it covers is what the compaction before it covered plus ``added``
    (message ids), so each record names only the messages it newly summarized and stays
    as small as what was in view (schema 1 named every id covered so far, ``covers``:
    its upcaster makes that ``added``, and the union the fold takes reads the same).
    Carries the numbers that triggered it: ``tokens`` >= ``threshold`` x
    ``budget`` at user turn ``turn``, with the previous compaction at ``previous_turn``;
    ``rule`` is ``over_budget`` when ``tokens`` > ``budget`` let it run within the
    cooldown. ``fallback`` is ``emergency-truncation`` when no summarizer ran (it was
    failing or disabled, and the transcript was over the budget): ``body`` then says how
    many messages were left out, and keeps the text of the earlier summaries it covers."""

    summary_id: str
    turn: int
    added: tuple[str, ...]
    through_seq: int
    tokens: int
    budget: int
    threshold: float
    previous_turn: int | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    body: str = ""
    rule: Literal["threshold", "over_budget"] = "threshold"
    fallback: Literal["emergency-truncation"] | None = None
    schema_version: ClassVar[int] = 2
