"""ProviderHealth: the owner of one provider's degraded / recovered decisions (seed 000).

One actor per configured provider. It folds ``provider:<name>`` (the stream the model
caller appends ``provider:call_failed`` / ``provider:call_succeeded`` to) with the pure
:data:`~stalwart.state.HEALTH` fold, asks :func:`~stalwart.state.decide_health` what
follows at ``clock.now()``, appends the decision (``expected_version`` = the version it
folded; on a conflict it folds what the callers appended meanwhile and decides again),
and only then tells its listeners :class:`HealthChanged` and updates the shared
:class:`HealthView`.

How it keeps up with its stream: it follows the log itself. A small follower thread waits
on the store's head (``store.wait_for``, no decoding) and, when the actor's stream is
past what it folded, tells it :class:`PollHealth` (at most one pending; one look at the
stream's version every 50 ms at most: other streams' appends do not wake it); every
message that can change the state (``PollHealth``, ``CallOutcome``, the timer) first
reads ``read_stream(from_version=version + 1)``. Reading by version is what makes it gap-
and duplicate-free: a ``CallOutcome`` is only a hint that there is something to read, so
whoever tells it (or nobody) cannot make the actor skip or double-count an event. The
follower captures the head before the initial fold, so nothing appended around start-up
is missed. ``follow=False`` leaves the feeding to
``PollHealth`` / ``CallOutcome`` messages.

Recovery does not wait for someone to ask: after every fold the actor arms a timer at
:func:`~stalwart.state.health_deadline` (the quiet window after the last failure), and
the scheduler fires it; a success recorded while degraded (by ``PROBE_AGENT`` or any
agent) recovers on the next fold.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.config import HealthSettings
from stalwart.errors import (
    ConcurrencyError,
    CorruptRecordError,
)
from stalwart.events import ProviderDegraded, ProviderRecovered, RecordedEvent
from stalwart.state import (
    DEFAULT_HORIZON_MS,
    ApplyFolder,
    HealthAggregate,
    HealthState,
    decide_health,
    health_deadline,
)
from stalwart.store import EventStore, NewEvent, load_state, read_readable

from ._deadletter import FoldSnapshots
from ._follow import FOLLOW_SLICE_S, HeadFollower
from ._outage import StoreOutage
from ._restarts import crashed
from ._scheduler import Scheduler, TimerHandle
from ._supervised import Supervised

log = get_logger(__name__)

HealthStatus = Literal["healthy", "degraded"]

#: How many append conflicts in a row the actor folds and retries before it yields the
#: mailbox (and re-polls itself).
MAX_CONFLICTS = 64


# -- messages -----------------------------------------------------------------------------


class CallOutcome(msgspec.Struct, frozen=True):
    """A call outcome already appended to ``provider:<name>``: catch up and decide.

    Only a hint: the actor reads its stream by version, so the record itself is never
    folded twice, and a record of another provider's stream is ignored (failures are
    attributed to the provider that failed)."""

    record: RecordedEvent


class PollHealth(msgspec.Struct, frozen=True):
    """Read the stream's new events, decide; an ``ask`` replies with the HealthReport."""


class GetHealth(msgspec.Struct, frozen=True):
    """Ask for the current :class:`HealthReport` (no store read)."""


class _Due(msgspec.Struct, frozen=True):
    """The quiet-window timer fired at ``at``."""

    at: float


class HealthChanged(msgspec.Struct, frozen=True, kw_only=True):
    """Told to listeners after a ``provider:degraded`` / ``provider:recovered`` is appended.

    ``version`` is the decision's version in ``provider:<name>`` (unique per decision)."""

    provider: str
    status: HealthStatus
    at: float
    rule: str
    version: int


class HealthReport(msgspec.Struct, frozen=True, kw_only=True):
    """A provider's health as its actor last folded it.

    ``since`` and ``rule`` come from the latest decision (None before the first one);
    ``deadline`` is when quiet-window recovery is due while degraded."""

    provider: str
    status: HealthStatus = "healthy"
    since: float | None = None
    rule: str | None = None
    version: int = 0
    deadline: float | None = None

    @property
    def degraded(self) -> bool:
        return self.status == "degraded"


Listener = pykka.ActorRef[Any] | Callable[[HealthChanged], object]


class HealthView(Mapping[str, HealthReport]):
    """Provider -> latest HealthReport, readable from any thread without an ``ask``.

    Health actors publish into it (one view may be shared by all of them); readers such as
    the Agent check ``view.is_degraded(provider)`` before an LLM call. Writes copy the
    dict under a lock and swap it in, so a read never sees a half-made update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, HealthReport] = {}

    def __getitem__(self, provider: str) -> HealthReport:
        return self._reports[provider]

    def __iter__(self) -> Iterator[str]:
        return iter(self._reports)

    def __len__(self) -> int:
        return len(self._reports)

    def is_degraded(self, provider: str) -> bool:
        report = self._reports.get(provider)
        return report is not None and report.degraded

    def any_degraded(self) -> bool:
        """Whether some provider is degraded (the dead-letter queue then holds its retries)."""
        return any(report.degraded for report in self._reports.values())

    def publish(self, report: HealthReport) -> None:
        with self._lock:
            self._reports = {**self._reports, report.provider: report}

    def __repr__(self) -> str:
        return f"HealthView({self._reports!r})"


# -- the fold the actor keeps: health, plus the latest decision's rule and time ------------


class _Watch(msgspec.Struct, frozen=True, kw_only=True):
    health: HealthState
    rule: str | None = None
    since: float | None = None


class _WatchAggregate:
    """HEALTH plus the rule and time of the latest decision (for GetHealth after a restart)."""

    name = "provider_health_watch"
    state_type = _Watch

    def __init__(self, health: HealthAggregate) -> None:
        self._health = health
        # the health fold's counting is in its snapshots: a new one is not read as old
        # (2 and below: the health fold before it counted calls; this was 1 then)
        self.version = health.version

    def initial(self, stream: str) -> _Watch:
        return _Watch(health=self._health.initial(stream))

    def apply(self, state: _Watch, record: RecordedEvent) -> _Watch:
        health = self._health.apply(state.health, record)
        match record.event:
            case ProviderDegraded(rule=rule) | ProviderRecovered(rule=rule):
                return _Watch(health=health, rule=rule, since=record.ts)
            case _:
                return msgspec.structs.replace(state, health=health)

    def folder(self, state: _Watch) -> ApplyFolder[_Watch]:
        return ApplyFolder(self.apply, state)


# -- the actor -----------------------------------------------------------------------------


class ProviderHealthActor(Supervised):
    """Decides ``provider:degraded`` / ``provider:recovered`` for one provider.

    Start with ``ProviderHealthActor.start(store, clock, scheduler, provider, settings,
    listeners, view)``. Messages: :class:`PollHealth`, :class:`CallOutcome` (both reply with a
    :class:`HealthReport` when asked) and :class:`GetHealth`. Listeners (actor refs or
    callables, called on the actor's thread: keep them cheap) are told
    :class:`HealthChanged` once per appended decision. ``on_crash(exception class name)``
    is called once if the actor dies of an exception (its follower and timer stopped first).
    """

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        provider: str,
        settings: HealthSettings | None = None,
        listeners: Sequence[Listener] = (),
        view: HealthView | None = None,
        *,
        follow: bool = True,
        on_crash: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self._on_crash = on_crash
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._provider = provider
        self._stream = f"provider:{provider}"
        self._settings = settings or HealthSettings()
        self._listeners = tuple(listeners)
        self._view = view if view is not None else HealthView()
        self._follow = follow
        horizon = max(DEFAULT_HORIZON_MS, self._settings.window_ms)
        self._aggregate = _WatchAggregate(HealthAggregate(horizon_ms=horizon))
        self._state = self._aggregate.initial(self._stream)
        #: the fold saved as it goes: a restart folds what came after it, not the run
        self._snapshots = FoldSnapshots(store, self._aggregate)
        self._timer: TimerHandle | None = None
        self._poll_pending = threading.Event()
        self._follower: HeadFollower | None = None
        #: a check the store failed is made again a moment later, not a crash
        self._outage = StoreOutage("health", scheduler, clock, self._tell_self)

    # -- lifecycle ---------------------------------------------------------------------------

    def started(self) -> None:
        if self._follow:
            name = f"stalwart-health-{self._provider}"
            self._follower = HeadFollower(
                self._store,
                self._stream_moved,
                name,
                part="health",
                pace_s=FOLLOW_SLICE_S,  # a busy store: one look (a query) a slice
            )
        self._state = self._load()
        log.info("health.started", provider=self._provider, status=self._state.health.status)
        self._settle()
        if self._follower is not None:
            self._follower.start()

    def on_stop(self) -> None:
        if self._follower is not None:
            self._follower.stop()
        if self._timer is not None:
            self._timer.cancel()

    def on_failure(self, *exc_info: object) -> None:
        self.on_stop()
        crashed(self._on_crash, exc_info)

    def _load(self) -> _Watch:
        state = self._load_from(use_snapshots=True)
        if state.health.horizon_ms < self._settings.window_ms:  # a snapshot of a narrower fold
            state = self._load_from(use_snapshots=False)
        self._snapshots.loaded(state.health.version)
        return state

    def _load_from(self, *, use_snapshots: bool) -> _Watch:
        """The fold from the log; a damaged record is passed over (logged): one lost
        outcome must not keep the provider's health unknown for good."""
        try:
            return load_state(
                self._store, self._stream, self._aggregate, use_snapshots=use_snapshots
            )
        except CorruptRecordError:
            self._snapshots.damaged()
            return load_state(
                self._store,
                self._stream,
                self._aggregate,
                use_snapshots=use_snapshots,
                skip_unreadable=True,
            )

    # -- messages ----------------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        match message:
            case PollHealth():
                self._poll_pending.clear()
                self._outage.run(message, self._settle)
            case CallOutcome(record=record) if record.stream != self._stream:
                log.warning("health.foreign_outcome", provider=self._provider, stream=record.stream)
            case CallOutcome() | _Due():
                self._outage.run(message, self._settle)
            case GetHealth():
                pass
            case _:
                raise TypeError(f"ProviderHealthActor does not understand {message!r}")
        return self._report()

    # -- receive, fold, decide, append, then act ---------------------------------------------

    def _settle(self) -> None:
        settings = self._settings
        for _ in range(MAX_CONFLICTS):
            self._catch_up()
            now = self._clock.now()
            decided = decide_health(
                self._state.health,
                now,
                window_ms=settings.window_ms,
                min_agents=settings.min_agents,
                consecutive=settings.consecutive_failures,
            )
            if not decided:
                break
            try:
                recorded = self._store.append(
                    self._stream,
                    [NewEvent(event=event, ts=now) for event in decided],
                    expected_version=self._state.health.version,
                )
            except ConcurrencyError:
                continue  # a caller appended meanwhile: fold it and decide again
            for record in recorded:
                self._fold(record)
            self._announce(recorded)
        else:
            log.warning("health.append_contended", provider=self._provider, tries=MAX_CONFLICTS)
            self.actor_ref.tell(PollHealth())
        self._snapshots.keep(self._stream, self._state)
        self._arm()
        self._view.publish(self._report())

    def _catch_up(self) -> None:
        for record in read_readable(
            self._store, self._stream, self._state.health.version + 1, unreadable=self._skip
        ):
            self._fold(record)

    def _skip(self, version: int, exc: CorruptRecordError) -> None:
        """A record of the stream that cannot be read: logged, and folded past."""
        log.error(
            "health.record_unreadable", stream=self._stream, version=version, position=exc.position
        )
        self._snapshots.damaged()
        health = msgspec.structs.replace(self._state.health, version=version)
        self._state = msgspec.structs.replace(self._state, health=health)

    def _fold(self, record: RecordedEvent) -> None:
        self._state = self._aggregate.apply(self._state, record)
        self._snapshots.folded(record)

    def _announce(self, recorded: list[RecordedEvent]) -> None:
        for record in recorded:
            event = record.event
            if not isinstance(event, ProviderDegraded | ProviderRecovered):
                continue
            status: HealthStatus = "degraded" if isinstance(event, ProviderDegraded) else "healthy"
            log.warning("health.changed", provider=self._provider, status=status, rule=event.rule)
            changed = HealthChanged(
                provider=self._provider,
                status=status,
                at=record.ts,
                rule=event.rule,
                version=record.version,
            )
            for listener in self._listeners:
                self._tell(listener, changed)

    def _tell(self, listener: Listener, changed: HealthChanged) -> None:
        try:
            if isinstance(listener, pykka.ActorRef):
                listener.tell(changed)
            else:
                listener(changed)
        except pykka.ActorDeadError:
            log.warning("health.listener_dead", provider=self._provider, listener=repr(listener))
        except Exception:
            log.exception("health.listener_failed", provider=self._provider)

    # -- the timer and the follower ----------------------------------------------------------

    def _arm(self) -> None:
        deadline = health_deadline(self._state.health, window_ms=self._settings.window_ms)
        timer = self._timer
        if deadline is None:
            if timer is not None:
                timer.cancel()
                self._timer = None
            return
        if timer is not None and timer.active and timer.deadline == deadline:
            return
        if timer is not None:
            timer.cancel()
        self._timer = self._scheduler.schedule(deadline, self._due)

    def _tell_self(self, message: object) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(message)

    def _due(self, at: float) -> None:
        """Scheduler callback (the scheduler's thread, or inside ``FakeClock.advance``)."""
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(_Due(at))

    def _stream_moved(self) -> None:
        """Follower callback (its thread), the store's head moved: wake the actor when its
        stream is past what it folded (a call's outcome or a decision another process
        appended). Any other stream's append only moves the head: waking the actor for
        each of those kept it reading and publishing for every writer on the store."""
        if self._store.stream_version(self._stream) > self._state.health.version:
            self._wake()

    def _wake(self) -> None:
        """At most one PollHealth waits in the mailbox."""
        if self._poll_pending.is_set():
            return
        self._poll_pending.set()
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(PollHealth())

    def _report(self) -> HealthReport:
        health = self._state.health
        return HealthReport(
            provider=self._provider,
            status=health.status,
            since=self._state.since,
            rule=self._state.rule,
            version=health.version,
            deadline=health_deadline(health, window_ms=self._settings.window_ms),
        )
