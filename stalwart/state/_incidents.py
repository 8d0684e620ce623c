"""Incidents per provider and model: a projection of the whole log, in global order.

Which model fails more than the others? The projection folds ``read_all`` and counts, per
``(provider, model)``:

- calls: one per ``provider:call_succeeded`` or ``provider:call_failed`` in a
  ``provider:<name>`` stream, except that an attempt which retried a failed one
  (``retry_of``) takes its place, as for the breaker and the health monitor: a call is
  counted once, by its latest attempt, and ``retried`` counts the failed attempts a retry
  took the place of; failures by error class (``failed / calls`` is the rate). A failed
  attempt is remembered for its retry like an open call (at most ``max_open_calls``; one
  forgotten, or before ``since``, leaves its retry counted as a call of its own);
- timeouts by limit: an ``execution:prompt_timeout`` names only its ``call_id``, so the
  fold joins it to the ``prompt:started`` that opened the call. The join remembers open
  calls only: a call is forgotten when it completes, fails or times out, and at most
  ``max_open_calls`` are kept (the oldest goes first; a crashed process leaves calls that
  never end). A timeout whose call is unknown is counted in ``unmatched_timeouts``;
- fallbacks away from and to the model (``model:fallback_attempt``, whose models are
  ``provider:model``) and fallback chains exhausted, counted for the chain's first model;
- first and last seen, and the latency of successful calls in a small log-bucket
  histogram (exact below 16 ms, then 8 buckets per doubling: within 12.5 %).

Breaker openings (``breaker:opened``) and degraded episodes (``provider:degraded``) belong to
a provider, not a model: they are counted per provider.

``since`` keeps only what happened at or after that timestamp; the join still learns from
earlier ``prompt:started`` events, so a call started before ``since`` that times out after
it is attributed. The state is a frozen msgspec Struct; :class:`IncidentsFolder` is the
fast accumulator and :func:`apply_incidents` the pure one-event interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import msgspec

from stalwart.errors import ConfigError
from stalwart.events import (
    BreakerOpened,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    PromptCompleted,
    PromptFailed,
    PromptStarted,
    PromptTimeout,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    RecordedEvent,
)

#: How many open calls the timeout join remembers at most.
DEFAULT_MAX_OPEN_CALLS = 4096

_EXACT = 16  # latencies below this many ms get a bucket each
_V = TypeVar("_V")


class ModelIncidents(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one model of one provider."""

    provider: str
    model: str
    succeeded: int = 0
    failed: int = 0
    failures: dict[str, int] = msgspec.field(default_factory=dict)
    #: failed attempts a retry of the same call took the place of (not in ``failed``)
    retried: int = 0
    timeouts: dict[str, int] = msgspec.field(default_factory=dict)
    fallbacks_away: int = 0
    fallbacks_to: int = 0
    fallbacks_exhausted: int = 0
    first_seen: float | None = None
    last_seen: float | None = None
    #: (bucket, count) of successful calls' latency, by bucket; see :func:`latency_bucket`
    latency_buckets: tuple[tuple[int, int], ...] = ()
    latency_max_ms: int = 0

    @property
    def calls(self) -> int:
        return self.succeeded + self.failed

    @property
    def failure_rate(self) -> float:
        calls = self.calls
        return self.failed / calls if calls else 0.0

    @property
    def timeout_count(self) -> int:
        return sum(self.timeouts.values())


class ProviderIncidents(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to a provider as a whole."""

    provider: str
    breaker_openings: int = 0
    degraded_episodes: int = 0
    first_seen: float | None = None
    last_seen: float | None = None


class OpenCall(msgspec.Struct, frozen=True, array_like=True):
    """A call the timeout join still remembers."""

    call_id: str
    provider: str
    model: str


class FailedAttempt(msgspec.Struct, frozen=True, array_like=True):
    """A counted failed attempt that a retry of the same call may still take the place of."""

    call_id: str
    provider: str
    model: str
    error_class: str


class IncidentsState(msgspec.Struct, frozen=True, kw_only=True):
    """Incidents per model and per provider, both sorted by name."""

    since: float | None = None
    models: tuple[ModelIncidents, ...] = ()
    providers: tuple[ProviderIncidents, ...] = ()
    open_calls: tuple[OpenCall, ...] = ()
    failed_attempts: tuple[FailedAttempt, ...] = ()
    max_open_calls: int = DEFAULT_MAX_OPEN_CALLS
    #: open calls (and failed attempts) dropped to keep the joins bounded, and timeouts no
    #: open call explained
    forgotten_calls: int = 0
    unmatched_timeouts: int = 0


def latency_bucket(ms: int) -> int:
    """The histogram bucket of a latency: exact below 16 ms, then 8 per doubling."""
    if ms < _EXACT:
        return max(ms, 0)
    exponent = ms.bit_length() - 1
    mantissa = (ms >> (exponent - 3)) & 7
    return _EXACT + (exponent - 4) * 8 + mantissa


def bucket_upper(bucket: int) -> int:
    """The largest latency (ms) in a bucket."""
    if bucket < _EXACT:
        return bucket
    exponent, mantissa = divmod(bucket - _EXACT, 8)
    return ((9 + mantissa) << (exponent + 1)) - 1


def latency_percentile(row: ModelIncidents, percent: int) -> int | None:
    """The nearest-rank ``percent`` percentile (1-100) of successful calls' latency in ms.

    It is the upper bound of the bucket the rank falls in, never above the slowest call;
    None when the model had no successful call.
    """
    total = sum(count for _, count in row.latency_buckets)
    if not total:
        return None
    rank = max(1, -(-percent * total // 100))
    seen = 0
    for bucket, count in row.latency_buckets:
        seen += count
        if seen >= rank:
            return min(bucket_upper(bucket), row.latency_max_ms)
    return row.latency_max_ms


def split_model(qualified: str) -> tuple[str, str]:
    """``provider:model`` -> ``(provider, model)``; a bare model has provider ``""``."""
    provider, sep, model = qualified.partition(":")
    return (provider, model) if sep else ("", qualified)


class _Row:
    """A model's counts while folding."""

    __slots__ = (
        "buckets",
        "failed",
        "failures",
        "fallbacks_away",
        "fallbacks_exhausted",
        "fallbacks_to",
        "first_seen",
        "last_seen",
        "latency_max_ms",
        "model",
        "provider",
        "retried",
        "succeeded",
        "timeouts",
    )

    def __init__(self, row: ModelIncidents) -> None:
        self.provider = row.provider
        self.model = row.model
        self.succeeded = row.succeeded
        self.failed = row.failed
        self.failures = dict(row.failures)
        self.retried = row.retried
        self.timeouts = dict(row.timeouts)
        self.fallbacks_away = row.fallbacks_away
        self.fallbacks_to = row.fallbacks_to
        self.fallbacks_exhausted = row.fallbacks_exhausted
        self.first_seen = row.first_seen
        self.last_seen = row.last_seen
        self.buckets = dict(row.latency_buckets)
        self.latency_max_ms = row.latency_max_ms

    def seen(self, ts: float) -> None:
        if self.first_seen is None or ts < self.first_seen:
            self.first_seen = ts
        if self.last_seen is None or ts > self.last_seen:
            self.last_seen = ts

    def frozen(self) -> ModelIncidents:
        return ModelIncidents(
            provider=self.provider,
            model=self.model,
            succeeded=self.succeeded,
            failed=self.failed,
            failures=dict(sorted(self.failures.items())),
            retried=self.retried,
            timeouts=dict(sorted(self.timeouts.items())),
            fallbacks_away=self.fallbacks_away,
            fallbacks_to=self.fallbacks_to,
            fallbacks_exhausted=self.fallbacks_exhausted,
            first_seen=self.first_seen,
            last_seen=self.last_seen,
            latency_buckets=tuple(sorted(self.buckets.items())),
            latency_max_ms=self.latency_max_ms,
        )


def _seen(row: ProviderIncidents, ts: float) -> ProviderIncidents:
    first = ts if row.first_seen is None else min(row.first_seen, ts)
    last = ts if row.last_seen is None else max(row.last_seen, ts)
    return msgspec.structs.replace(row, first_seen=first, last_seen=last)


class IncidentsFolder:
    """The incidents projection as a mutable accumulator over ``read_all``."""

    __slots__ = ("_failed", "_open", "_providers", "_rows", "_state")

    def __init__(self, state: IncidentsState) -> None:
        self._state = state
        self._rows = {(r.provider, r.model): _Row(r) for r in state.models}
        self._providers = {p.provider: p for p in state.providers}
        self._open = {c.call_id: (c.provider, c.model) for c in state.open_calls}
        self._failed = {f.call_id: f for f in state.failed_attempts}

    def _row(self, provider: str, model: str) -> _Row:
        row = self._rows.get((provider, model))
        if row is None:
            row = self._rows[provider, model] = _Row(ModelIncidents(provider=provider, model=model))
        return row

    def _remember(self, event: PromptStarted) -> None:
        calls = self._open
        calls.pop(event.call_id, None)
        calls[event.call_id] = (event.provider, event.model)
        self._bound(calls)

    def _bound(self, remembered: dict[str, _V]) -> None:
        if len(remembered) > self._state.max_open_calls:
            del remembered[next(iter(remembered))]
            self._state = msgspec.structs.replace(
                self._state, forgotten_calls=self._state.forgotten_calls + 1
            )

    def _retry(self, retry_of: str) -> None:
        """An attempt retried the failed attempt ``retry_of``: the call's failure is now
        the retry's outcome, so the one counted for that attempt is taken back."""
        attempt = self._failed.pop(retry_of, None) if retry_of else None
        if attempt is None:
            return  # not counted (before ``since``, or forgotten): the retry counts alone
        row = self._row(attempt.provider, attempt.model)
        row.failed -= 1
        left = row.failures[attempt.error_class] - 1
        if left:
            row.failures[attempt.error_class] = left
        else:
            del row.failures[attempt.error_class]
        row.retried += 1

    def _provider_event(self, provider: str, ts: float, *, opened: int, degraded: int) -> None:
        row = self._providers.get(provider) or ProviderIncidents(provider=provider)
        self._providers[provider] = _seen(
            msgspec.structs.replace(
                row,
                breaker_openings=row.breaker_openings + opened,
                degraded_episodes=row.degraded_episodes + degraded,
            ),
            ts,
        )

    def _succeeded(self, event: ProviderCallSucceeded, ts: float) -> None:
        self._retry(event.retry_of)
        row = self._row(event.provider, event.model)
        row.succeeded += 1
        latency = max(event.latency_ms, 0)
        bucket = latency_bucket(latency)
        row.buckets[bucket] = row.buckets.get(bucket, 0) + 1
        row.latency_max_ms = max(row.latency_max_ms, latency)
        row.seen(ts)

    def _call_failed(self, event: ProviderCallFailed, ts: float) -> None:
        self._retry(event.retry_of)
        row = self._row(event.provider, event.model)
        row.failed += 1
        row.failures[event.error_class] = row.failures.get(event.error_class, 0) + 1
        row.seen(ts)
        if event.call_id:  # its retry, if any, takes its place
            self._failed[event.call_id] = FailedAttempt(
                event.call_id, event.provider, event.model, event.error_class
            )
            self._bound(self._failed)

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        ts = record.ts
        since = self._state.since
        counted = since is None or ts >= since
        match event:
            case PromptStarted():
                self._remember(event)
            case PromptCompleted() | PromptFailed():
                self._open.pop(event.call_id, None)
            case PromptTimeout():
                call = self._open.pop(event.call_id, None)
                if not counted:
                    return
                if call is None:
                    self._state = msgspec.structs.replace(
                        self._state, unmatched_timeouts=self._state.unmatched_timeouts + 1
                    )
                    return
                row = self._row(*call)
                row.timeouts[event.limit] = row.timeouts.get(event.limit, 0) + 1
                row.seen(ts)
            case ProviderCallSucceeded() if counted and record.stream.startswith("provider:"):
                self._succeeded(event, ts)
            case ProviderCallFailed() if counted and record.stream.startswith("provider:"):
                self._call_failed(event, ts)
            case ModelFallbackAttempt() if counted:
                away = self._row(*split_model(event.from_model))
                away.fallbacks_away += 1
                away.seen(ts)
                to = self._row(*split_model(event.to_model))
                to.fallbacks_to += 1
                to.seen(ts)
            case ModelFallbackExhausted() if counted and event.models:
                head = self._row(*split_model(event.models[0]))
                head.fallbacks_exhausted += 1
                head.seen(ts)
            case BreakerOpened() if counted:
                self._provider_event(event.provider, ts, opened=1, degraded=0)
            case ProviderDegraded() if counted:
                self._provider_event(event.provider, ts, opened=0, degraded=1)
            case _:
                pass

    def state(self) -> IncidentsState:
        return msgspec.structs.replace(
            self._state,
            models=tuple(row.frozen() for _, row in sorted(self._rows.items())),
            providers=tuple(row for _, row in sorted(self._providers.items())),
            open_calls=tuple(OpenCall(cid, p, m) for cid, (p, m) in self._open.items()),
            failed_attempts=tuple(self._failed.values()),
        )


def apply_incidents(state: IncidentsState, record: RecordedEvent) -> IncidentsState:
    """The incidents after one more event of the log (pure; a folder is faster)."""
    folder = IncidentsFolder(state)
    folder.add(record)
    return folder.state()


def incidents(
    records: Iterable[RecordedEvent],
    *,
    since: float | None = None,
    max_open_calls: int = DEFAULT_MAX_OPEN_CALLS,
) -> IncidentsState:
    """Fold a whole log (``read_all``, global order) into incidents per provider and model."""
    if max_open_calls < 1:
        raise ConfigError(
            f"max_open_calls: expected at least 1, got {max_open_calls}", key="max_open_calls"
        )
    folder = IncidentsFolder(IncidentsState(since=since, max_open_calls=max_open_calls))
    add = folder.add
    for record in records:
        add(record)
    return folder.state()
