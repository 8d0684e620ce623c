"""The per-provider circuit breaker: a fold over the provider stream and a pure decision.

closed --(N consecutive failures)--> open --(reset timeout)--> half_open
half_open --(the probe succeeds)--> closed;  half_open --(the probe fails)--> open

A failure is a call's, as for the health monitor: a failed retry (``retry_of``) of an
attempt already counted is not counted again (a half-open breaker's probe answers whatever
attempt it is). Only the probe's outcome (``probe``) answers a half-open breaker: a call
admitted before the breaker opened may end while it is half-open, and its success or
failure says nothing of the provider now.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import (
    BreakerClosed,
    BreakerHalfOpened,
    BreakerOpened,
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    RecordedEvent,
)

from ._aggregate import ApplyFolder

BreakerStatus = Literal["closed", "open", "half_open"]

#: Failures that say the request was wrong, not that the provider is unwell: the breaker
#: neither counts them nor treats them as a probe's answer (a few oversized prompts must
#: not cut a healthy provider off for every agent).
CALLER_FAULTS = frozenset(
    {"bad_request", "client_error", "content_policy", "context_overflow", "not_found"}
)


class BreakerState(msgspec.Struct, frozen=True, kw_only=True):
    provider: str
    version: int = 0
    status: BreakerStatus = "closed"
    consecutive_failures: int = 0
    opened_at: float | None = None
    probe_outcome: Literal["success", "failure"] | None = None


def _answers_probe(state: BreakerState, event: ProviderCallFailed | ProviderCallSucceeded) -> bool:
    """Whether a call's outcome is the half-open breaker's probe's (a record written before
    outcomes said so, ``probe`` None, is taken as the probe's, as it then was)."""
    return state.status == "half_open" and event.probe is not False


def apply_breaker(state: BreakerState, record: RecordedEvent) -> BreakerState:
    """The breaker after one more event of its provider stream."""
    event = record.event
    replace = msgspec.structs.replace
    match event:
        case ProviderCallFailed() if event.error_class in CALLER_FAULTS:
            return replace(state, version=record.version)
        case ProviderCallFailed() if event.retry_of and not _answers_probe(state, event):
            # the call's failure, counted at its first failed attempt
            return replace(state, version=record.version)
        case ProviderCallFailed():
            outcome = "failure" if _answers_probe(state, event) else state.probe_outcome
            return replace(
                state,
                version=record.version,
                consecutive_failures=state.consecutive_failures + 1,
                probe_outcome=outcome,
            )
        case ProviderCallSucceeded():
            outcome = "success" if _answers_probe(state, event) else state.probe_outcome
            return replace(
                state, version=record.version, consecutive_failures=0, probe_outcome=outcome
            )
        case BreakerOpened():
            return replace(
                state,
                version=record.version,
                status="open",
                opened_at=record.ts,
                probe_outcome=None,
            )
        case BreakerHalfOpened():
            return replace(state, version=record.version, status="half_open", probe_outcome=None)
        case BreakerClosed():
            return replace(
                state,
                version=record.version,
                status="closed",
                consecutive_failures=0,
                opened_at=None,
                probe_outcome=None,
            )
        case _:
            return replace(state, version=record.version)


def decide_breaker(
    state: BreakerState, now: float, *, threshold: int, reset_timeout_ms: int
) -> list[Event]:
    """What the breaker does next, if anything."""
    provider = state.provider
    if state.status == "closed" and state.consecutive_failures >= threshold:
        return [
            BreakerOpened(
                provider=provider,
                failures=state.consecutive_failures,
                threshold=threshold,
                reset_timeout_ms=reset_timeout_ms,
            )
        ]
    if state.status == "open" and state.opened_at is not None:
        if now >= state.opened_at + reset_timeout_ms / 1000:
            return [BreakerHalfOpened(provider=provider)]
        return []
    if state.status == "half_open" and state.probe_outcome == "failure":
        return [
            BreakerOpened(
                provider=provider,
                failures=state.consecutive_failures,
                threshold=threshold,
                reset_timeout_ms=reset_timeout_ms,
            )
        ]
    if state.status == "half_open" and state.probe_outcome == "success":
        return [BreakerClosed(provider=provider)]
    return []


class BreakerAggregate:
    """The breaker fold for ``provider:<name>`` streams."""

    name = "breaker"
    version = 3  # 2: a failed retry is not counted again; 3: only the probe answers it
    state_type = BreakerState

    def initial(self, stream: str) -> BreakerState:
        return BreakerState(provider=stream.removeprefix("provider:"))

    def apply(self, state: BreakerState, record: RecordedEvent) -> BreakerState:
        return apply_breaker(state, record)

    def folder(self, state: BreakerState) -> ApplyFolder[BreakerState]:
        return ApplyFolder(apply_breaker, state)


BREAKER = BreakerAggregate()
