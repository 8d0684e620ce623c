"""The DAG context engine's folds: a session's summary DAG, and a tenant's summarizer
spend and breaker, with the pure decision on whether the summarizer may run.

``context:<session>`` holds everything the engine decided: which summaries exist, what
each covers, where the session's scope was bound. The session's messages live in its own
stream; folding both rebuilds the engine exactly (see ``stalwart.context``).

The summarizer governor folds one tenant's ledger (``context-ledger:<tenant>``: the calls
admitted and released, recorded at decision time, so workers sharing a store share one
spend and one breaker), or, for a log older than the ledger, every ``context:*`` stream
of the tenant:

- spend: each summary's ``input_tokens + output_tokens`` at its timestamp; a rolling hour
  and a rolling day are compared with their caps (0 disables a window);
- in flight: a reserved call (``context:summarizer_reserved``) counts what it may spend
  until it is released, or until its lease ends (its worker died);
- breaker: a failed call (``context:summarizer_released`` with an ``error_class``; in an
  older log ``context:summarizer_failed``) counts consecutive failures, a summary made by
  the summarizer resets them. At ``failure_threshold`` the breaker is open until
  ``reset_timeout_ms`` after the latest failure, then half-open: one trial call, whose
  failure opens it again and whose success closes it.

Emergency truncations (``fallback``) are neither spend nor a breaker outcome.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any, Generic, Literal, TypeVar

import msgspec

from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextDagDegraded,
    ContextLedgerOpened,
    ContextSummarizerFailed,
    ContextSummarizerRefused,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    ContextSummaryCreated,
    Event,
    RecordedEvent,
)

HOUR_S = 3_600.0
DAY_S = 86_400.0

_V = TypeVar("_V")


class SummaryNode(msgspec.Struct, frozen=True, kw_only=True):
    """One summary of the DAG as its event recorded it."""

    summary_id: str
    depth: int
    covers: tuple[str, ...]
    descendant_count: int
    first_seq: int = 0
    last_seq: int = 0
    earliest: float = 0.0
    latest: float = 0.0
    tokens: int = 0
    fallback: Literal["emergency-truncation"] | None = None
    body: str = ""
    topics: tuple[str, ...] = ()
    created_at: float = 0.0


class ContextDagState(msgspec.Struct, frozen=True, kw_only=True):
    """A session's DAG: its summaries, which are top-level (``roots``, oldest first), the
    parent of each condensed child, and the id of the newest message a summary covers."""

    session: str
    tenant: str | None = None
    bound: bool = False
    version: int = 0
    summaries: dict[str, SummaryNode] = msgspec.field(default_factory=dict)
    parents: dict[str, str] = msgspec.field(default_factory=dict)
    roots: tuple[str, ...] = ()
    last_covered: str | None = None
    degraded: str | None = None
    #: the last assembly clipped the fresh tail (a ``tail_over_budget`` episode goes on)
    tail_clipped: bool = False


def summary_node(event: ContextSummaryCreated, ts: float) -> SummaryNode:
    """The node a ``context:summary_created`` event describes."""
    return SummaryNode(
        summary_id=event.summary_id,
        depth=event.depth,
        covers=event.covers,
        descendant_count=event.descendant_count,
        first_seq=event.first_seq,
        last_seq=event.last_seq,
        earliest=event.earliest,
        latest=event.latest,
        tokens=event.tokens,
        fallback=event.fallback,
        body=event.body,
        topics=event.topics,
        created_at=ts,
    )


def apply_context_event(
    state: ContextDagState, event: Event, version: int, ts: float
) -> ContextDagState:
    """The DAG after one more event of ``context:<session>``."""
    replace = msgspec.structs.replace
    match event:
        case ContextBound():
            return replace(state, version=version, tenant=event.tenant, bound=True)
        case ContextSummaryCreated():
            summaries = dict(state.summaries)
            summaries[event.summary_id] = summary_node(event, ts)
            if event.depth == 0:
                last = event.covers[-1] if event.covers else state.last_covered
                return replace(
                    state,
                    version=version,
                    summaries=summaries,
                    roots=(*state.roots, event.summary_id),
                    last_covered=last,
                    degraded=_episode_after(state.degraded, event),
                )
            parents = dict(state.parents)
            covered = set(event.covers)
            for child in event.covers:
                parents[child] = event.summary_id
            roots: list[str] = []
            for root in state.roots:
                if root in covered:
                    if event.summary_id not in roots:
                        roots.append(event.summary_id)
                else:
                    roots.append(root)
            return replace(
                state,
                version=version,
                summaries=summaries,
                parents=parents,
                roots=tuple(roots),
                degraded=_episode_after(state.degraded, event),  # as the live engine
            )
        case ContextDagDegraded():
            clipped = state.tail_clipped or event.reason == "tail_over_budget"
            # only the summarizer's episodes (what a new episode is compared with): a
            # clipped tail or a refused write between them does not end one
            episode = event.reason in ("spend_cap", "breaker_open")
            degraded = event.reason if episode else state.degraded
            return replace(state, version=version, degraded=degraded, tail_clipped=clipped)
        case ContextAssembled():
            return replace(state, version=version, tail_clipped=event.tail_clipped)
        case _:
            return replace(state, version=version)


def _episode_after(degraded: str | None, event: ContextSummaryCreated) -> str | None:
    """The summarizer's degraded episode after ``event``: a summary the summarizer made
    ends it, but for a condensed one under a spend cap. Condensing a run of emergency
    truncations asks little, and fits under a cap that refuses every leaf: ended there,
    the episode began again at the next leaf, its WARN and ``context:dag_degraded``
    repeated every few leaves while the cap held."""
    if event.fallback or (degraded == "spend_cap" and event.depth > 0):
        return degraded
    return None


def apply_context(state: ContextDagState, record: RecordedEvent) -> ContextDagState:
    return apply_context_event(state, record.event, record.version, record.ts)


class ContextDagFolder:
    """The DAG fold as an accumulator, equal to :func:`apply_context` event by event. The
    pure fold copies the summaries and their parents at every summary, which makes a
    session's fold quadratic in its summaries (16,000 summaries: 2 s); this one adds to
    its own and copies them once, when asked for the state."""

    __slots__ = ("_parents", "_roots", "_scalars", "_state", "_summaries")

    def __init__(self, state: ContextDagState) -> None:
        self._summaries = dict(state.summaries)
        self._parents = dict(state.parents)
        self._roots = list(state.roots)
        self._scalars: dict[str, Any] = {
            "session": state.session,
            "tenant": state.tenant,
            "bound": state.bound,
            "version": state.version,
            "last_covered": state.last_covered,
            "degraded": state.degraded,
            "tail_clipped": state.tail_clipped,
        }
        self._state: ContextDagState | None = state

    def add(self, record: RecordedEvent) -> None:
        event, scalars = record.event, self._scalars
        self._state = None
        scalars["version"] = record.version
        if isinstance(event, ContextBound):
            scalars["tenant"] = event.tenant
            scalars["bound"] = True
        elif isinstance(event, ContextSummaryCreated):
            made = event.summary_id
            self._summaries[made] = summary_node(event, record.ts)
            scalars["degraded"] = _episode_after(scalars["degraded"], event)  # as the engine
            if event.depth == 0:
                self._roots.append(made)
                if event.covers:
                    scalars["last_covered"] = event.covers[-1]
                return
            covered = set(event.covers)
            for child in event.covers:
                self._parents[child] = made
            roots: list[str] = []
            placed = False  # the condensed summary takes the place of its first child
            for root in self._roots:
                if root in covered:
                    if not placed:
                        roots.append(made)
                        placed = True
                else:
                    roots.append(root)
                    placed = placed or root == made
            self._roots = roots
        elif isinstance(event, ContextDagDegraded):
            if event.reason == "tail_over_budget":
                scalars["tail_clipped"] = True
            if event.reason in ("spend_cap", "breaker_open"):
                scalars["degraded"] = event.reason
        elif isinstance(event, ContextAssembled):
            scalars["tail_clipped"] = event.tail_clipped

    def state(self) -> ContextDagState:
        if self._state is None:
            self._state = ContextDagState(
                summaries=dict(self._summaries),
                parents=dict(self._parents),
                roots=tuple(self._roots),
                **self._scalars,
            )
        return self._state


class ContextDagAggregate:
    """The DAG fold for ``context:<session>`` streams."""

    name = "context_dag"
    version = 3  # 2: tail_clipped; 3: degraded is the summarizer's episode only
    state_type = ContextDagState

    def initial(self, stream: str) -> ContextDagState:
        return ContextDagState(session=stream.removeprefix("context:"))

    def apply(self, state: ContextDagState, record: RecordedEvent) -> ContextDagState:
        return apply_context(state, record)

    def folder(self, state: ContextDagState) -> ContextDagFolder:
        return ContextDagFolder(state)


CONTEXT_DAG = ContextDagAggregate()


# -- the summarizer governor (per tenant) ---------------------------------------------------


class ReservedCall(msgspec.Struct, frozen=True, kw_only=True):
    """A reserved summarizer call not yet released: what it may spend, whether it is the
    half-open trial, and when its lease ends (unix seconds)."""

    call_id: str
    tokens: int
    trial: bool = False
    expires: float = 0.0


class GovernorState(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's summarizer spend within the last day, its breaker counts, and (from its
    ledger) the calls still running.

    ``spend`` is ``(ts, tokens)`` oldest first, pruned to the day before the newest.
    ``released`` is ``(ts, call_id)`` of the releases of that day: a release written twice
    (its first append failed ambiguously and was retried) counts once."""

    tenant: str | None = None
    spend: tuple[tuple[float, int], ...] = ()
    consecutive_failures: int = 0
    last_failure_at: float | None = None
    calls: tuple[ReservedCall, ...] = ()
    released: tuple[tuple[float, str], ...] = ()


def apply_governor_event(state: GovernorState, event: Event, ts: float) -> GovernorState:
    """The governor after one more event of the tenant's ledger (or, for a log older
    than the ledger, of any ``context:*`` stream); other tenants' events leave it as it
    is. A fold takes one source: the ledger records every call the session streams
    record too."""
    replace = msgspec.structs.replace
    if getattr(event, "tenant", None) != state.tenant:
        return state
    match event:
        case ContextSummarizerReserved():
            expires = ts + event.lease_ms / 1000
            call = ReservedCall(
                call_id=event.call_id, tokens=event.tokens, trial=event.trial, expires=expires
            )
            return replace(state, calls=(*_live(state.calls, ts), call))
        case ContextSummarizerReleased():
            if any(call_id == event.call_id for _, call_id in state.released):
                return state  # the same release written again: counted already
            calls = tuple(c for c in _live(state.calls, ts) if c.call_id != event.call_id)
            spend = _spent(state, ts, event.input_tokens + event.output_tokens)
            kept = tuple(entry for entry in state.released if entry[0] > ts - DAY_S)
            released = (*kept, (ts, event.call_id))
            last = state.last_failure_at
            if event.error_class is None:
                # a success recorded late (its release was retried) ends no failures
                # that came after it
                failures = state.consecutive_failures if last is not None and ts < last else 0
                return replace(
                    state,
                    spend=spend,
                    calls=calls,
                    released=released,
                    consecutive_failures=failures,
                )
            return replace(
                state,
                spend=spend,
                calls=calls,
                released=released,
                consecutive_failures=state.consecutive_failures + 1,
                last_failure_at=ts if last is None else max(last, ts),
            )
        case ContextLedgerOpened():
            return replace(
                state,
                spend=event.spend,
                consecutive_failures=event.consecutive_failures,
                last_failure_at=event.last_failure_at,
            )
        case ContextSummaryCreated() if not event.fallback:
            spend = _spent(state, ts, event.input_tokens + event.output_tokens)
            return replace(state, spend=spend, consecutive_failures=0)
        case ContextSummarizerFailed():
            return replace(
                state,
                spend=_spent(state, ts, event.input_tokens + event.output_tokens),
                consecutive_failures=state.consecutive_failures + 1,
                last_failure_at=ts,
            )
        case _:
            return state


def _live(calls: tuple[ReservedCall, ...], now: float) -> tuple[ReservedCall, ...]:
    """The calls whose lease has not ended at ``now``."""
    return tuple(call for call in calls if call.expires > now)


def in_flight(state: GovernorState, now: float) -> int:
    """What the tenant's calls still running (reserved, not released, lease not ended)
    may spend."""
    return sum(call.tokens for call in _live(state.calls, now))


def _spent(state: GovernorState, ts: float, tokens: int) -> tuple[tuple[float, int], ...]:
    """The spend entries of the last day, with ``tokens`` spent at ``ts`` (if any)."""
    kept = tuple(entry for entry in state.spend if entry[0] > ts - DAY_S)
    return (*kept, (ts, tokens)) if tokens else kept


def apply_governor(state: GovernorState, record: RecordedEvent) -> GovernorState:
    return apply_governor_event(state, record.event, record.ts)


class _DayWindow(Generic[_V]):
    """``(ts, value)`` entries in the order they came, less those a cutoff dropped: what
    filtering the state's tuple at each event leaves (``_spent``), in amortised constant
    time per event while the entries come in time order (they do, but for clocks that
    disagree across workers; then each cut filters them all, as the pure fold does)."""

    __slots__ = ("_entries", "_head", "_ordered")

    def __init__(self, entries: tuple[tuple[float, _V], ...]) -> None:
        self._entries: list[tuple[float, _V]] = list(entries)
        self._head = 0
        self._ordered = _in_time_order(self._entries)

    def cut(self, cutoff: float) -> list[tuple[float, _V]]:
        """Drop the entries at or before ``cutoff``; return them."""
        entries, head = self._entries, self._head
        if not self._ordered:
            kept = [entry for entry in entries[head:] if entry[0] > cutoff]
            dropped = [entry for entry in entries[head:] if entry[0] <= cutoff]
            self._entries, self._head, self._ordered = kept, 0, _in_time_order(kept)
            return dropped
        end = len(entries)
        start = head
        while head < end and entries[head][0] <= cutoff:
            head += 1
        dropped = entries[start:head]
        if head > 1024 and head * 2 > end:  # let the dropped ones go
            self._entries, head = entries[head:], 0
        self._head = head
        return dropped

    def add(self, entry: tuple[float, _V]) -> None:
        entries = self._entries
        if self._ordered and len(entries) > self._head and entry[0] < entries[-1][0]:
            self._ordered = False
        entries.append(entry)

    def entries(self) -> tuple[tuple[float, _V], ...]:
        return tuple(self._entries[self._head :])


def _in_time_order(entries: list[tuple[float, _V]]) -> bool:
    return all(a[0] <= b[0] for a, b in pairwise(entries))


class GovernorFolder:
    """The governor's fold as an accumulator, equal to :func:`apply_governor_event` event
    by event. The pure fold copies the day's spend and releases at every event, which
    makes a ledger's fold quadratic in the calls of a day (at 8,000 calls a day, 0.6 ms
    an event: half a minute for three days); this one keeps them in lists and drops the
    old ones from the front."""

    __slots__ = (
        *("_calls", "_failed_at", "_failures", "_released", "_released_ids"),
        *("_spend", "_state", "tenant"),
    )

    def __init__(self, state: GovernorState) -> None:
        self.tenant = state.tenant
        self._spend: _DayWindow[int] = _DayWindow(state.spend)
        self._released: _DayWindow[str] = _DayWindow(state.released)
        self._released_ids = Counter(call_id for _, call_id in state.released)
        self._calls = list(state.calls)
        self._failures = state.consecutive_failures
        self._failed_at = state.last_failure_at
        self._state: GovernorState | None = state

    def add(self, record: RecordedEvent) -> None:
        self.add_event(record.event, record.ts)

    def add_event(self, event: Event, ts: float) -> None:
        """What :func:`apply_governor_event` does with ``event`` at ``ts``."""
        if getattr(event, "tenant", None) != self.tenant:
            return
        if isinstance(event, ContextSummarizerReserved):
            calls = [call for call in self._calls if call.expires > ts]
            expires = ts + event.lease_ms / 1000
            calls.append(
                ReservedCall(
                    call_id=event.call_id, tokens=event.tokens, trial=event.trial, expires=expires
                )
            )
            self._calls = calls
        elif isinstance(event, ContextSummarizerReleased):
            if self._released_ids[event.call_id]:
                return  # the same release written again: counted already
            self._calls = [c for c in self._calls if c.expires > ts and c.call_id != event.call_id]
            self._spent(ts, event.input_tokens + event.output_tokens)
            for _, call_id in self._released.cut(ts - DAY_S):
                self._released_ids[call_id] -= 1
            self._released.add((ts, event.call_id))
            self._released_ids[event.call_id] += 1
            last = self._failed_at
            if event.error_class is None:
                if not (last is not None and ts < last):
                    self._failures = 0
            else:
                self._failures += 1
                self._failed_at = ts if last is None else max(last, ts)
        elif isinstance(event, ContextLedgerOpened):
            self._spend = _DayWindow(event.spend)
            self._failures = event.consecutive_failures
            self._failed_at = event.last_failure_at
        elif isinstance(event, ContextSummaryCreated) and not event.fallback:
            self._spent(ts, event.input_tokens + event.output_tokens)
            self._failures = 0
        elif isinstance(event, ContextSummarizerFailed):
            self._spent(ts, event.input_tokens + event.output_tokens)
            self._failures += 1
            self._failed_at = ts
        else:
            return
        self._state = None

    def _spent(self, ts: float, tokens: int) -> None:
        self._spend.cut(ts - DAY_S)
        if tokens:
            self._spend.add((ts, tokens))

    def state(self) -> GovernorState:
        if self._state is None:
            self._state = GovernorState(
                tenant=self.tenant,
                spend=self._spend.entries(),
                consecutive_failures=self._failures,
                last_failure_at=self._failed_at,
                calls=tuple(self._calls),
                released=self._released.entries(),
            )
        return self._state


class _LedgerFolder(GovernorFolder):
    """The ledger stream's fold: the tenant is the one its first event names."""

    __slots__ = ()

    def add(self, record: RecordedEvent) -> None:
        if record.version == 1:
            self.tenant = getattr(record.event, "tenant", None)
            self._state = None
        self.add_event(record.event, record.ts)


class LedgerAggregate:
    """The governor's fold of one tenant's ledger stream (``context-ledger...``). The
    tenant is the one its first event (``context:ledger_opened``) names: a stream named
    by a digest does not say it."""

    name = "summarizer_ledger"
    version = 2  # 2: released call ids
    state_type = GovernorState

    def initial(self, stream: str) -> GovernorState:
        return GovernorState()

    def apply(self, state: GovernorState, record: RecordedEvent) -> GovernorState:
        if record.version == 1:
            state = msgspec.structs.replace(state, tenant=getattr(record.event, "tenant", None))
        return apply_governor_event(state, record.event, record.ts)

    def folder(self, state: GovernorState) -> GovernorFolder:
        return _LedgerFolder(state)


SUMMARIZER_LEDGER = LedgerAggregate()


class SummarizerVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the summarizer may run now, and if not, the rule, its knob and numbers.
    ``trial`` marks the half-open breaker's single trial call."""

    allowed: bool
    reason: Literal["spend_cap", "breaker_open"] | None = None
    knob: str | None = None
    used: int = 0
    limit: int = 0
    until: float | None = None
    trial: bool = False


def window_spend(state: GovernorState, now: float, seconds: float) -> int:
    """Tokens spent in the window ``(now - seconds, now]``."""
    return sum(tokens for ts, tokens in state.spend if now - seconds < ts <= now)


def _window_frees(state: GovernorState, now: float, seconds: float) -> float | None:
    inside = [ts for ts, _ in state.spend if now - seconds < ts <= now]
    return min(inside) + seconds if inside else None


def decide_summarizer(
    state: GovernorState,
    now: float,
    *,
    projected: int,
    per_hour: int,
    per_day: int,
    failure_threshold: int,
    reset_timeout_ms: int,
) -> SummarizerVerdict:
    """May a summarizer call that would spend about ``projected`` tokens run at ``now``?

    The breaker is checked first (an open breaker makes no call at all, and a half-open
    one allows a single trial: none while one is running), then each window: a call is
    refused when what the window already spent, plus what the tenant's calls still
    running may spend (the state's reserved calls whose lease has not ended), plus
    ``projected`` would pass its cap."""
    live = _live(state.calls, now)
    running = sum(call.tokens for call in live)
    trial_running = any(call.trial for call in live)
    trial = False
    if state.consecutive_failures >= failure_threshold and state.last_failure_at is not None:
        reopens = state.last_failure_at + reset_timeout_ms / 1000
        if now < reopens or trial_running:
            return SummarizerVerdict(
                allowed=False,
                reason="breaker_open",
                knob="context_engine.summarizer_breaker.failure_threshold",
                used=state.consecutive_failures,
                limit=failure_threshold,
                until=reopens if now < reopens else None,
            )
        trial = True
    for seconds, cap, knob in (
        (HOUR_S, per_hour, "context_engine.summarizer_spend.max_tokens_per_tenant_per_hour"),
        (DAY_S, per_day, "context_engine.summarizer_spend.max_tokens_per_tenant_per_day"),
    ):
        if cap <= 0:
            continue
        used = window_spend(state, now, seconds) + running
        if used + projected > cap:
            return SummarizerVerdict(
                allowed=False,
                reason="spend_cap",
                knob=knob,
                used=used,
                limit=cap,
                until=_window_frees(state, now, seconds),
            )
    return SummarizerVerdict(allowed=True, trial=trial)


def refusal(
    verdict: SummarizerVerdict, *, tenant: str | None, session: str | None, tokens: int
) -> ContextSummarizerRefused:
    """The ledger's record of a refusing ``verdict`` for a call estimated at ``tokens``."""
    return ContextSummarizerRefused(
        tenant=tenant,
        session=session,
        tokens=tokens,
        reason=verdict.reason or "breaker_open",
        knob=verdict.knob,
        used=verdict.used,
        limit=verdict.limit,
        until=verdict.until,
    )
