"""Provider health: a fold of ``provider:<name>`` and the pure degraded/recovered decision.

Seed 000's monitor aggregates failures across agents. Within ``window_ms`` (60 s) before
``now``, failures from ``>= min_agents`` (2) distinct agents, or ``consecutive`` (3)
failures in a row from one agent (no success of that agent in between), make the provider
``degraded``, once. A failure is a call's: the attempts the caller makes on the same model
are one call, as seed 000's SDK retries are, so an attempt's outcome (``retry_of``) takes
the place of the failure it retried: a failed call counts once from its first failed
attempt, and a retry that succeeds takes its failure back.
It ``recovers`` once: at the first recorded success while degraded of an attempt begun
after the provider was degraded (rule ``probe`` when the caller is :data:`PROBE_AGENT`,
else ``success``; a call in flight when the outage was declared does not end it), or
when no failure has been
recorded for ``window_ms`` (rule ``quiet_window``, a timer: :func:`health_deadline`).

The fold keeps its memory bounded: failures and successes older than the state's
``horizon_ms`` before the newest event are dropped. ``horizon_ms`` is fixed when the fold
starts and must be at least the ``window_ms`` decisions use, so pruning never changes one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.errors import ConfigError
from stalwart.events import (
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
    RecordedEvent,
)

from ._aggregate import ApplyFolder
from ._breaker import CALLER_FAULTS

HealthStatus = Literal["healthy", "degraded"]

#: the ``agent`` of the single probe call the health monitor makes while degraded
PROBE_AGENT = "stalwart:probe"
#: the horizon of the default fold: seed 000's 60-second window
DEFAULT_HORIZON_MS = 60_000


class Mark(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One call outcome: when, by which agent, where in the stream (for ordering), and
    the attempt's call id (a retry of it takes its place)."""

    ts: float
    agent: str
    version: int
    call: str = ""


def _retried(marks: tuple[Mark, ...], retry_of: str, call: str) -> tuple[Mark, ...] | None:
    """``marks`` with the failure of attempt ``retry_of`` now standing for attempt
    ``call`` of the same call: it keeps its time and place (the call failed then, before
    any success in between), only its id moves on. None when there is no such mark."""
    if not retry_of:
        return None
    for index, mark in enumerate(marks):
        if mark.call == retry_of:
            moved = msgspec.structs.replace(mark, call=call)
            return (*marks[:index], moved, *marks[index + 1 :])
    return None


def _without(marks: tuple[Mark, ...], call: str) -> tuple[Mark, ...]:
    """``marks`` but the failure of attempt ``call`` (which a retry now stands for)."""
    if not call:
        return marks
    return tuple(m for m in marks if m.call != call)


class HealthState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    provider: str
    horizon_ms: int = DEFAULT_HORIZON_MS
    version: int = 0
    status: HealthStatus = "healthy"
    newest_ts: float | None = None
    failures: tuple[Mark, ...] = ()
    successes: tuple[Mark, ...] = ()  # the latest success per agent
    last_failure_at: float | None = None
    degraded_at: float | None = None
    recovering_agent: str | None = None  # the first success while degraded
    recovering_version: int = 0  # where that success is in the stream


def _pruned(marks: tuple[Mark, ...], after: float) -> tuple[Mark, ...]:
    if not marks or marks[0].ts > after:
        return marks
    return tuple(m for m in marks if m.ts > after)


def _observed(state: HealthState, record: RecordedEvent) -> HealthState:
    newest = record.ts if state.newest_ts is None else max(state.newest_ts, record.ts)
    after = newest - state.horizon_ms / 1000
    return msgspec.structs.replace(
        state,
        version=record.version,
        newest_ts=newest,
        failures=_pruned(state.failures, after),
        successes=_pruned(state.successes, after),
    )


def _begun_before_outage(state: HealthState, event: ProviderCallSucceeded) -> bool:
    """Whether the attempt began before the provider was degraded: its success says
    nothing of the provider now (as for the breaker, whose probe it is not). A record
    with no ``started_at`` (written before it) is taken as one begun after, as it was."""
    began, degraded = event.started_at, state.degraded_at
    return began is not None and degraded is not None and began < degraded


def apply_health(state: HealthState, record: RecordedEvent) -> HealthState:
    """The provider's health after one more event of its stream."""
    state = _observed(state, record)
    event = record.event
    replace = msgspec.structs.replace
    match event:
        case ProviderCallFailed() if event.error_class in CALLER_FAULTS:
            return state  # the request was wrong, the provider is fine (as for the breaker)
        case ProviderCallFailed():
            failures = _retried(state.failures, event.retry_of, event.call_id)
            if failures is None:  # a call's first failure (or one whose first has aged out)
                mark = Mark(record.ts, event.agent, record.version, event.call_id)
                failures = (*state.failures, mark)
            return replace(state, failures=failures, last_failure_at=record.ts)
        case ProviderCallSucceeded():
            if event.retry_of:  # the call succeeded after all: its failure is taken back
                state = replace(state, failures=_without(state.failures, event.retry_of))
            mark = Mark(record.ts, event.agent, record.version)
            others = tuple(m for m in state.successes if m.agent != event.agent)
            if (
                state.status == "degraded"
                and state.recovering_agent is None
                and not _begun_before_outage(state, event)
            ):
                return replace(
                    state,
                    successes=(*others, mark),
                    recovering_agent=event.agent,
                    recovering_version=record.version,
                )
            return replace(state, successes=(*others, mark))
        case ProviderDegraded():
            return replace(state, status="degraded", degraded_at=record.ts, recovering_agent=None)
        case ProviderRecovered():
            # the episode's failures are forgiven; those recorded after the success that
            # recovered it still count (folded in one catch-up with it, they may degrade
            # the provider again at once)
            since = state.recovering_version if state.recovering_agent is not None else None
            return replace(
                state,
                status="healthy",
                degraded_at=None,
                recovering_agent=None,
                recovering_version=0,
                failures=()
                if since is None
                else tuple(m for m in state.failures if m.version > since),
                successes=()
                if since is None
                else tuple(m for m in state.successes if m.version >= since),
            )
        case _:
            return state


def _streak(state: HealthState, agent: str, after: float) -> int:
    """The agent's failures in the window since its last success."""
    since = max((m.version for m in state.successes if m.agent == agent), default=0)
    return sum(1 for m in state.failures if m.agent == agent and m.ts > after and m.version > since)


def _degraded(
    state: HealthState, now: float, *, window_ms: int, min_agents: int, consecutive: int
) -> ProviderDegraded | None:
    after = now - window_ms / 1000
    recent = [m for m in state.failures if m.ts > after]
    agents = tuple(sorted({m.agent for m in recent}))
    provider = state.provider
    if len(agents) >= min_agents:
        failures = len(recent)
        return ProviderDegraded(
            provider=provider, rule="agents", agents=agents, failures=failures, window_ms=window_ms
        )
    for agent in agents:
        streak = _streak(state, agent, after)
        if streak >= consecutive:
            return ProviderDegraded(
                provider=provider,
                rule="consecutive",
                agents=(agent,),
                failures=streak,
                window_ms=window_ms,
            )
    return None


def health_deadline(state: HealthState, *, window_ms: int) -> float | None:
    """When a degraded provider recovers by the quiet window if no failure comes first."""
    if state.status != "degraded" or state.degraded_at is None:
        return None
    quiet_since = max(state.degraded_at, state.last_failure_at or state.degraded_at)
    return quiet_since + window_ms / 1000


def decide_health(
    state: HealthState, now: float, *, window_ms: int, min_agents: int, consecutive: int
) -> list[Event]:
    """``provider:degraded`` or ``provider:recovered`` when one is due at ``now`` (seed 000).

    Each fires once per episode: degraded only while healthy, recovered only while
    degraded. ``window_ms`` must not exceed the state's ``horizon_ms``.
    """
    if window_ms > state.horizon_ms:
        raise ConfigError(
            f"key 'health.window_ms': {window_ms} exceeds the health fold's horizon "
            f"({state.horizon_ms} ms); start the fold with HealthAggregate(horizon_ms>=window)",
            key="health.window_ms",
        )
    if state.status == "healthy":
        degraded = _degraded(
            state, now, window_ms=window_ms, min_agents=min_agents, consecutive=consecutive
        )
        return [] if degraded is None else [degraded]
    if state.recovering_agent is not None:
        rule: Literal["probe", "success"] = (
            "probe" if state.recovering_agent == PROBE_AGENT else "success"
        )
        return [ProviderRecovered(provider=state.provider, rule=rule)]
    deadline = health_deadline(state, window_ms=window_ms)
    if deadline is not None and now >= deadline:
        return [ProviderRecovered(provider=state.provider, rule="quiet_window")]
    return []


class HealthAggregate:
    """The provider-health fold for ``provider:<name>`` streams.

    ``horizon_ms`` bounds the fold's memory; keep it ``>= HealthSettings.window_ms``.
    """

    name = "provider_health"
    version = 3  # 3: a retry's outcome takes the place of the failure it retried
    state_type = HealthState

    def __init__(self, horizon_ms: int = DEFAULT_HORIZON_MS) -> None:
        self.horizon_ms = horizon_ms

    def initial(self, stream: str) -> HealthState:
        return HealthState(provider=stream.removeprefix("provider:"), horizon_ms=self.horizon_ms)

    def apply(self, state: HealthState, record: RecordedEvent) -> HealthState:
        return apply_health(state, record)

    def folder(self, state: HealthState) -> ApplyFolder[HealthState]:
        return ApplyFolder(apply_health, state)


HEALTH = HealthAggregate()
