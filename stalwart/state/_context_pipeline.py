"""The pipeline context engine's per-session state: a pure fold over its ``context:`` events.

What survives a restart is exactly what the log says:

- each layer's breaker (``closed`` -> ``open`` after consecutive failures -> ``half_open``
  for one trial -> ``closed`` or ``open`` again), from ``context:layer_disabled``,
  ``context:layer_half_opened``, ``context:layer_enabled`` and the ``layers_failed`` of
  each ``context:assembled``;
- the compaction in force (what it covers, its rendered body, the user turn it ran at),
  from ``context:compacted``;
- what the previous assembly was given (provider, count and digest of its message ids,
  budget), from ``context:assembled``, which the signature replay scrubber compares
  against;
- the cache fence the previous assembly left (``fence`` messages of its output, standing
  for its first ``fence_input`` input messages, shaped at user turn ``fence_turn``). The
  messages behind it are held in memory, not in the log: a rebuilt engine knows where
  the fence was and breaks it once (``cache_break = "rebuilt"``);
- the tenant the session is bound to, from ``context:bound`` (the first assembly writes
  it; a later one for another tenant is refused, as in the DAG engine).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextCompacted,
    ContextLayerDisabled,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
    Event,
    RecordedEvent,
)

from ._aggregate import ApplyFolder

LayerStatus = Literal["closed", "open", "half_open"]


class LayerBreaker(msgspec.Struct, frozen=True, kw_only=True):
    """One layer's breaker: consecutive failures, and when a disabled layer is retried."""

    status: LayerStatus = "closed"
    failures: int = 0
    error: str = ""
    retry_at: float | None = None


class PipelineSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The compaction in force: ``covers`` are replaced by one message with ``body``;
    ``truncated`` when it was an emergency truncation (no summarizer ran), which does
    not hold the next compaction back for the cooldown."""

    summary_id: str
    turn: int
    covers: frozenset[str]
    through_seq: int
    body: str
    truncated: bool = False


class PipelineState(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 0
    assemblies: int = 0
    breakers: dict[str, LayerBreaker] = msgspec.field(default_factory=dict)
    summary: PipelineSummary | None = None
    last_provider: str = ""
    last_input_count: int = 0
    last_input_digest: str = ""
    last_budget: int = 0
    fence: int = 0
    fence_input: int = 0
    fence_turn: int = 0
    #: ``context:bound`` was recorded: ``tenant`` is the session's (None: no tenant)
    bound: bool = False
    tenant: str | None = None

    def breaker(self, layer: str) -> LayerBreaker:
        """The breaker of ``layer`` (closed with no failures if it never failed)."""
        return self.breakers.get(layer, _CLOSED)


_CLOSED = LayerBreaker()


def _with_breaker(state: PipelineState, layer: str, breaker: LayerBreaker) -> PipelineState:
    breakers = dict(state.breakers)
    if breaker == _CLOSED:
        breakers.pop(layer, None)
    else:
        breakers[layer] = breaker
    return msgspec.structs.replace(state, breakers=breakers)


def _assembled(state: PipelineState, event: ContextAssembled) -> PipelineState:
    failed = set(event.layers_failed)
    breakers: dict[str, LayerBreaker] = {}
    for layer, breaker in state.breakers.items():
        if breaker.status == "closed" and layer not in failed:
            continue  # ran and succeeded: its count of consecutive failures is over
        breakers[layer] = breaker
    for layer in failed:
        breaker = state.breakers.get(layer, _CLOSED)
        if breaker.status == "closed":
            breakers[layer] = msgspec.structs.replace(breaker, failures=breaker.failures + 1)
    return msgspec.structs.replace(
        state,
        breakers=breakers,
        assemblies=state.assemblies + 1,
        last_provider=event.provider,
        last_input_count=event.input_count,
        last_input_digest=event.input_digest,
        last_budget=event.budget,
        fence=event.fence,
        fence_input=event.fence_input,
        fence_turn=event.fence_turn,
    )


# -- the layer breaker's decisions (the engine makes them; replay re-derives them) -------


def layer_trial_due(breaker: LayerBreaker, now: float) -> bool:
    """Whether a layer that is not closed runs its half-open trial at ``now``."""
    return breaker.status != "closed" and breaker.retry_at is not None and now >= breaker.retry_at


def decide_layer_failure(
    layer: str, breaker: LayerBreaker, now: float, *, error: str, limit: int, cooldown_s: float
) -> list[Event]:
    """What a layer raising at ``now`` decides, from its breaker before the failure: it
    is disabled until ``now + cooldown_s`` when this is its ``limit``-th failure in a row
    (``context_engine.pipeline.layer_failure_limit``) or its half-open trial; otherwise
    nothing (the failure is counted by ``context:assembled``). ``error`` is the exception's
    class name."""
    failures = breaker.failures + 1
    if breaker.status == "closed" and failures < limit:
        return []
    return [
        ContextLayerDisabled(
            layer=layer,
            failures=failures,
            error=error,
            cooldown_s=cooldown_s,
            retry_at=now + cooldown_s,
        )
    ]


def apply_pipeline_event(state: PipelineState, event: Event) -> PipelineState:
    """The state after one more event (events of other kinds change nothing)."""
    match event:
        case ContextLayerDisabled():
            breaker = LayerBreaker(
                status="open", failures=event.failures, error=event.error, retry_at=event.retry_at
            )
            return _with_breaker(state, event.layer, breaker)
        case ContextLayerHalfOpened():
            current = state.breaker(event.layer)
            return _with_breaker(
                state, event.layer, msgspec.structs.replace(current, status="half_open")
            )
        case ContextLayerEnabled():
            return _with_breaker(state, event.layer, _CLOSED)
        case ContextCompacted():
            before = state.summary.covers if state.summary is not None else frozenset()
            summary = PipelineSummary(
                summary_id=event.summary_id,
                turn=event.turn,
                covers=before | frozenset(event.added),
                through_seq=event.through_seq,
                body=event.body,
                truncated=event.fallback is not None,
            )
            return msgspec.structs.replace(state, summary=summary)
        case ContextAssembled() if event.engine == "pipeline":
            return _assembled(state, event)
        case ContextBound() if not state.bound:
            return msgspec.structs.replace(state, bound=True, tenant=event.tenant)
        case _:
            return state


def apply_pipeline(state: PipelineState, record: RecordedEvent) -> PipelineState:
    """The state after one more recorded event of the session's ``context:`` stream."""
    state = apply_pipeline_event(state, record.event)
    return msgspec.structs.replace(state, version=record.version)


class PipelineAggregate:
    """The pipeline engine's fold for ``context:<session id>`` streams."""

    name = "context_pipeline"
    version = 3
    state_type = PipelineState

    def initial(self, stream: str) -> PipelineState:
        return PipelineState()

    def apply(self, state: PipelineState, record: RecordedEvent) -> PipelineState:
        return apply_pipeline(state, record)

    def folder(self, state: PipelineState) -> ApplyFolder[PipelineState]:
        return ApplyFolder(apply_pipeline, state)


CONTEXT_PIPELINE = PipelineAggregate()
