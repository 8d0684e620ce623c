"""Verifiers of the pipeline engine's layer breaker (``context:<session>`` streams).

==========================  ======================  ======================================
decision                    fold (stream)           decide (knobs; recorded inputs)
==========================  ======================  ======================================
context:layer_disabled      CONTEXT_PIPELINE        decide_layer_failure (context_engine.
                            (context:)              pipeline.layer_failure_limit,
                                                    layer_retry_after_s; the recorded
                                                    layer and error class)
context:layer_half_opened   CONTEXT_PIPELINE        layer_trial_due
context:layer_enabled       CONTEXT_PIPELINE        only during the layer's trial
context:summarizer_         SUMMARIZER_LEDGER       decide_summarizer (context_engine.
reserved                    (context-ledger)        summarizer_spend.*, summarizer_breaker.
                                                    failure_threshold, reset_timeout_ms;
                                                    the recorded estimate ``tokens``)
context:summarizer_refused  SUMMARIZER_LEDGER       the same: a refusal, by its rule and
                            (context-ledger)        numbers
==========================  ======================  ======================================

A layer's failure is an exception raised by code, which replay cannot re-run: which layer
failed and its class are taken as recorded. The count of failures in a row before it
(from the ``layers_failed`` of each ``context:assembled``), whether it was the half-open
trial, the limit and the cooldown are re-derived. The engine decides at the assembly's
clock reading, which the event's record carries; a record written before that was so
(its time is the append's, a little later) is re-derived at the time its ``retry_at``
implies, when that is not after the record. A trial's success is the layer running
without raising: what is checked is that the layer was in its trial.

A summarizer call's admission is re-derived from its tenant's ledger as it stood before
the reservation: the call's estimate within both rolling caps (with the calls still
running), the breaker closed or half-open with no trial running, whether it was the
trial, and its lease. A refusal is re-derived the same way: the rule that refused, the
knob, the numbers compared and when the governor lets calls run again.
"""

from __future__ import annotations

import msgspec

from stalwart.events import (
    ContextLayerDisabled,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
    ContextSummarizerRefused,
    ContextSummarizerReserved,
    Event,
    RecordedEvent,
)

from ._context import (
    DAY_S,
    HOUR_S,
    SUMMARIZER_LEDGER,
    GovernorState,
    SummarizerVerdict,
    decide_summarizer,
    in_flight,
    refusal,
    window_spend,
)
from ._context_pipeline import (
    CONTEXT_PIPELINE,
    PipelineState,
    decide_layer_failure,
    layer_trial_due,
)
from ._verify_registry import Knobs, Verifier, moment

_CONTEXT = "context:"
_LIMIT = "context_engine.pipeline.layer_failure_limit"
_COOLDOWN = "context_engine.pipeline.layer_retry_after_s"


def _decided_at(event: ContextLayerDisabled, record: RecordedEvent, cooldown_s: float) -> float:
    if event.retry_at is None:
        return record.ts
    return min(record.ts, event.retry_at - cooldown_s)


def _disabled(state: PipelineState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ContextLayerDisabled)
    cooldown_s = knobs.get_float(_COOLDOWN)
    return decide_layer_failure(
        event.layer,
        state.breaker(event.layer),
        _decided_at(event, record, cooldown_s),
        error=event.error,
        limit=knobs.get_int(_LIMIT),
        cooldown_s=cooldown_s,
    )


def _disabled_why(state: PipelineState, record: RecordedEvent, knobs: Knobs) -> str:
    event = record.event
    assert isinstance(event, ContextLayerDisabled)
    breaker = state.breaker(event.layer)
    if breaker.status != "closed":
        return (
            f"the {event.layer} layer was {breaker.status} after {breaker.failures} failures: "
            f"a failure now disables it for {knobs.get_float(_COOLDOWN)} s ({_COOLDOWN})"
        )
    return (
        f"the {event.layer} layer had failed {breaker.failures} times in a row before this; "
        f"it is disabled at failure {knobs.get_int(_LIMIT)} ({_LIMIT}), for "
        f"{knobs.get_float(_COOLDOWN)} s ({_COOLDOWN})"
    )


def _half_opened(state: PipelineState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ContextLayerHalfOpened)
    due = layer_trial_due(state.breaker(event.layer), record.ts)
    return [ContextLayerHalfOpened(layer=event.layer)] if due else []


def _enabled(state: PipelineState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ContextLayerEnabled)
    trial = state.breaker(event.layer).status == "half_open"
    return [ContextLayerEnabled(layer=event.layer)] if trial else []


def _breaker_why(state: PipelineState, record: RecordedEvent, knobs: Knobs) -> str:
    layer = getattr(record.event, "layer", "")
    breaker = state.breaker(layer)
    retry = f", its retry is due at {moment(breaker.retry_at)}" if breaker.retry_at else ""
    return f"the {layer} layer's breaker is {breaker.status}{retry}"


_SPEND = "context_engine.summarizer_spend"
_BREAKER = "context_engine.summarizer_breaker"


def _verdict(
    state: GovernorState, record: RecordedEvent, tokens: int, knobs: Knobs
) -> SummarizerVerdict:
    return decide_summarizer(
        state,
        record.ts,
        projected=tokens,
        per_hour=knobs.get_int(f"{_SPEND}.max_tokens_per_tenant_per_hour"),
        per_day=knobs.get_int(f"{_SPEND}.max_tokens_per_tenant_per_day"),
        failure_threshold=knobs.get_int(f"{_BREAKER}.failure_threshold"),
        reset_timeout_ms=knobs.get_int(f"{_BREAKER}.reset_timeout_ms"),
    )


def _reserved(state: GovernorState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ContextSummarizerReserved)
    verdict = _verdict(state, record, event.tokens, knobs)
    if not verdict.allowed:
        return []
    lease_ms = knobs.get_int(f"{_SPEND}.reservation_lease_ms")
    return [msgspec.structs.replace(event, trial=verdict.trial, lease_ms=lease_ms)]


def _refused(state: GovernorState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    event = record.event
    assert isinstance(event, ContextSummarizerRefused)
    verdict = _verdict(state, record, event.tokens, knobs)
    if verdict.allowed:
        return []
    return [refusal(verdict, tenant=event.tenant, session=event.session, tokens=event.tokens)]


def _reserved_why(state: GovernorState, record: RecordedEvent, knobs: Knobs) -> str:
    now = record.ts
    running = in_flight(state, now)
    return (
        f"the tenant had spent {window_spend(state, now, HOUR_S)} tokens in the hour and "
        f"{window_spend(state, now, DAY_S)} in the day, with {running} more in calls still "
        f"running ({_SPEND}.*), and {state.consecutive_failures} failures in a row "
        f"({_BREAKER}.failure_threshold)"
    )


CONTEXT_RULES = (
    Verifier("context:layer_disabled", CONTEXT_PIPELINE, _disabled, _CONTEXT, why=_disabled_why),
    Verifier(
        "context:layer_half_opened", CONTEXT_PIPELINE, _half_opened, _CONTEXT, why=_breaker_why
    ),
    Verifier("context:layer_enabled", CONTEXT_PIPELINE, _enabled, _CONTEXT, why=_breaker_why),
    Verifier(
        "context:summarizer_reserved",
        SUMMARIZER_LEDGER,
        _reserved,
        "context-ledger",
        why=_reserved_why,
    ),
    Verifier(
        "context:summarizer_refused",
        SUMMARIZER_LEDGER,
        _refused,
        "context-ledger",
        why=_reserved_why,
    ),
)
