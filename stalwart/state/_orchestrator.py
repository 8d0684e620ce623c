"""The orchestrator: one projection over every stream, for the operator's views.

:class:`OrchestratorFolder` takes the whole log in global order (``read_all``) and keeps,
per ``session:`` stream, the session fold and the activations fold; the ``deadletter``
queue; each provider's health and breaker; the activations abandoned so far (the other
half of the dead-letter backlog); and the newest position and time it has seen. It is
incremental: ``stalwart watch`` and ``activations --follow`` fold only what was appended
since the last refresh, never the log again.

It reuses the folds of each part (nothing here re-decides anything) and, like them, reads
no clock: whoever asks for a lease's expiry or a session's retry posture passes ``now``.
"""

from __future__ import annotations

import msgspec

from stalwart.events import ActivationAbandoned, RecordedEvent, SubagentSpawned

from ._activation import ACTIVATIONS, ActivationsState, apply_activations
from ._breaker import BREAKER, BreakerState, apply_breaker
from ._deadletter import DeadLetterEntry, DeadLetterFolder, DeadLetterState
from ._drafts import DRAFTS, DraftsState, apply_drafts
from ._due import due_at
from ._health import HEALTH, HealthState, apply_health
from ._session import SESSION, SessionFolder, SessionState

__all__ = [
    "ABANDONED_KEPT",
    "AbandonedActivation",
    "OrchestratorFolder",
    "OrchestratorState",
    "ProviderView",
    "RetryPosture",
    "SessionView",
    "apply_orchestrator",
    "retry_posture",
    "session_dead_letters",
]

#: how many abandoned activations the projection keeps (newest); the total is counted
ABANDONED_KEPT = 200


class RetryPosture(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where a session's retries stand.

    ``streak`` is the failure count of its most-failed unsettled activation (0: nothing
    is retrying); ``attempt`` the number of the next attempt of that activation (None
    when nothing is queued); ``next_run_at`` when a worker may next run one of them (a
    message queued behind a retrying one waits for it; None while a human is asked);
    ``last_error`` the error class of the retrying activation, else of the last outcome.
    """

    attempt: int | None = None
    streak: int = 0
    next_run_at: float | None = None
    last_error: str | None = None
    retrying: str | None = None


class AbandonedActivation(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An activation given up (attempts exhausted or not retryable): a dead letter."""

    session: str
    activation_id: str
    kind: str
    text: str
    attempts: int
    error_class: str
    retryable: bool
    at: float
    position: int


class SessionView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    stream: str
    session: SessionState
    activations: ActivationsState
    drafts: DraftsState | None = None
    #: a sub-agent run's stream (it starts with ``subagent:spawned``, not a session)
    run: bool = False


class ProviderView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    provider: str
    health: HealthState
    breaker: BreakerState


class OrchestratorState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Everything an operator's overview shows, as of global ``position``."""

    position: int = 0
    newest_ts: float | None = None
    sessions: tuple[SessionView, ...] = ()
    deadletter: DeadLetterState = msgspec.field(default_factory=DeadLetterState)
    abandoned: tuple[AbandonedActivation, ...] = ()
    abandoned_total: int = 0
    providers: tuple[ProviderView, ...] = ()

    def find(self, stream: str) -> SessionView | None:
        for view in self.sessions:
            if view.stream == stream:
                return view
        return None


def retry_posture(activations: ActivationsState) -> RetryPosture:
    """The retry posture of a session from its activations (see :class:`RetryPosture`)."""
    queue = activations.queue
    outcome = activations.last_outcome
    last_error = outcome.error_class if outcome is not None else None
    if not queue:
        return RetryPosture(last_error=last_error)
    worst = max(queue, key=lambda a: a.streak)
    # when a worker may next run something: messages run in order (one queued behind a
    # retry waits for it), nothing runs while a human is asked; with a lease, the queue
    next_run_at = min(a.run_at for a in queue) if activations.lease else due_at(activations)
    if worst.streak == 0:
        return RetryPosture(attempt=1, next_run_at=next_run_at, last_error=last_error)
    return RetryPosture(
        attempt=worst.streak + 1,
        streak=worst.streak,
        next_run_at=next_run_at,
        last_error=worst.last_error or last_error,
        retrying=worst.activation_id,
    )


def session_dead_letters(
    state: OrchestratorState, stream: str
) -> tuple[tuple[AbandonedActivation, ...], tuple[DeadLetterEntry, ...]]:
    """A session's abandoned activations and the undelivered announcements meant for it."""
    short = stream.removeprefix("session:")
    abandoned = tuple(a for a in state.abandoned if a.session == stream)
    entries = tuple(e for e in state.deadletter.entries if e.conversation in (stream, short))
    return abandoned, entries


class _Session:
    __slots__ = ("activations", "drafts", "folder", "run", "view")

    def __init__(
        self, session: SessionState, activations: ActivationsState, drafts: DraftsState
    ) -> None:
        self.folder = SessionFolder(session)
        self.activations = activations
        self.drafts = drafts
        self.run = False
        self.view: SessionView | None = None  # the last one frozen, until an event comes


class OrchestratorFolder:
    """The orchestrator projection as an accumulator: :meth:`add` records in global
    order (any subset of the log, e.g. one session's stream and ``deadletter``), and
    :meth:`state` freezes what it has. Equal to :func:`apply_orchestrator` event by
    event."""

    def __init__(self, state: OrchestratorState | None = None) -> None:
        start = state if state is not None else OrchestratorState()
        self._position = start.position
        self._newest = start.newest_ts
        self._sessions: dict[str, _Session] = {}
        for v in start.sessions:
            held = _Session(v.session, v.activations, v.drafts or DRAFTS.initial(v.stream))
            held.run = v.run
            self._sessions[v.stream] = held
        # what state() gave last, kept until a session changes (a live view asks for the
        # state every second: a frame then costs what changed, not every session again)
        self._order: list[str] | None = None  # the sessions' streams, sorted
        self._views: tuple[SessionView, ...] | None = None
        # the queue's own folder: a backlog of thousands of entries costs one lookup per
        # event, not a copy of the queue (``apply_deadletter`` per event was quadratic)
        self._deadletter = DeadLetterFolder(start.deadletter)
        self._abandoned = list(start.abandoned)
        self._abandoned_total = start.abandoned_total
        self._health = {p.provider: p.health for p in start.providers}
        self._breakers = {p.provider: p.breaker for p in start.providers}

    @property
    def position(self) -> int:
        """The global position of the last record folded (0: none yet)."""
        return self._position

    def add(self, record: RecordedEvent) -> None:
        self._position = max(self._position, record.position)
        if self._newest is None or record.ts > self._newest:
            self._newest = record.ts
        stream = record.stream
        if stream.startswith("session:"):
            self._session_event(stream, record)
        elif stream == "deadletter":
            self._deadletter.add(record)
        elif stream.startswith("provider:"):
            name = stream.removeprefix("provider:")
            health = self._health.get(name) or HEALTH.initial(stream)
            breaker = self._breakers.get(name) or BREAKER.initial(stream)
            self._health[name] = apply_health(health, record)
            self._breakers[name] = apply_breaker(breaker, record)

    def _session_event(self, stream: str, record: RecordedEvent) -> None:
        held = self._sessions.get(stream)
        if held is None:
            held = _Session(
                SESSION.initial(stream), ACTIVATIONS.initial(stream), DRAFTS.initial(stream)
            )
            self._sessions[stream] = held
            self._order = None
        held.view = None
        self._views = None
        event = record.event
        if isinstance(event, SubagentSpawned):
            held.run = True
        if isinstance(event, ActivationAbandoned):
            self._abandon(stream, held.activations, event, record)
        held.folder.add(record)
        held.activations = apply_activations(held.activations, record)
        held.drafts = apply_drafts(held.drafts, record)

    def _abandon(
        self,
        stream: str,
        activations: ActivationsState,
        event: ActivationAbandoned,
        record: RecordedEvent,
    ) -> None:
        queued = activations.find(event.activation_id)
        self._abandoned.append(
            AbandonedActivation(
                session=stream,
                activation_id=event.activation_id,
                kind=queued.kind if queued is not None else "",
                text=queued.text if queued is not None else "",
                attempts=event.attempts,
                error_class=event.error_class,
                retryable=event.retryable,
                at=record.ts,
                position=record.position,
            )
        )
        del self._abandoned[:-ABANDONED_KEPT]
        self._abandoned_total += 1

    def state(self) -> OrchestratorState:
        sessions = self._views
        if sessions is None:
            if self._order is None:
                self._order = sorted(self._sessions)
            sessions = self._views = tuple(
                self._view(stream, self._sessions[stream]) for stream in self._order
            )
        providers = tuple(
            ProviderView(provider=name, health=self._health[name], breaker=self._breakers[name])
            for name in sorted(self._health)
        )
        return OrchestratorState(
            position=self._position,
            newest_ts=self._newest,
            sessions=sessions,
            deadletter=self._deadletter.state(),
            abandoned=tuple(self._abandoned),
            abandoned_total=self._abandoned_total,
            providers=providers,
        )

    @staticmethod
    def _view(stream: str, held: _Session) -> SessionView:
        view = held.view
        if view is None:
            view = held.view = SessionView(
                stream=stream,
                session=held.folder.state(),
                activations=held.activations,
                drafts=held.drafts,
                run=held.run,
            )
        return view


def apply_orchestrator(state: OrchestratorState, record: RecordedEvent) -> OrchestratorState:
    """The projection after one more record (the pure, one-event form of the folder)."""
    folder = OrchestratorFolder(state)
    folder.add(record)
    return folder.state()
