"""Small folds that replay verification reads and no other fold keeps: a session's open
prompt windows and running turn, and the ``runtime`` stream's restart history.

Each is what the deciding actor keeps in memory while it runs, rebuilt from the log: the
model caller's deadline window per call, the Agent's turn start, the supervisor's
``supervisor:restarted`` times (which it reads from the log at each decision).
"""

from __future__ import annotations

import msgspec

from stalwart.events import (
    Event,
    ExecutionAborted,
    PromptActivity,
    PromptCompleted,
    PromptFailed,
    PromptStarted,
    PromptTimeout,
    RecordedEvent,
    SupervisorRestarted,
    TurnCompleted,
    TurnStarted,
    UserInterrupt,
)

from ._aggregate import FolderAggregate
from ._prompt import PromptWindow, window_started, window_touched


class CallsState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A session's model calls still open (started, not yet ended), by call id, the
    attempt number each call of the running turn was started with (a retry names the
    call that failed; its attempt is that call's next one), and the running turn (id and
    start time) as the Agent's execution timeout sees it."""

    open: dict[str, PromptWindow] = msgspec.field(default_factory=dict)
    attempts: dict[str, int] = msgspec.field(default_factory=dict)
    turn_id: str | None = None
    turn_started_at: float | None = None


_MOVES: frozenset[type[Event]] = frozenset(
    {
        *(PromptActivity, PromptStarted, PromptCompleted, PromptFailed, PromptTimeout),
        *(TurnStarted, TurnCompleted, ExecutionAborted, UserInterrupt),
    }
)


class CallsFolder:
    """The fold of :class:`CallsState`; events that do not concern it cost one lookup."""

    __slots__ = ("_attempts", "_open", "_state", "_turn_id", "_turn_started_at")

    def __init__(self, state: CallsState) -> None:
        self._open = dict(state.open)
        self._attempts = dict(state.attempts)
        self._turn_id = state.turn_id
        self._turn_started_at = state.turn_started_at
        self._state: CallsState | None = state  # the frozen state, until the next change

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        if type(event) not in _MOVES:
            return
        self._state = None
        match event:
            case PromptActivity():
                window = self._open.get(event.call_id)
                if window is not None:
                    self._open[event.call_id] = window_touched(window, record.ts)
            case PromptStarted():
                self._open[event.call_id] = window_started(event, record.ts)
                self._attempts[event.call_id] = event.attempt
            case PromptCompleted() | PromptFailed() | PromptTimeout():
                self._open.pop(event.call_id, None)
            case TurnStarted():
                self._turn_id, self._turn_started_at = event.turn_id, record.ts
                self._attempts.clear()
            case TurnCompleted() | ExecutionAborted() | UserInterrupt():
                # the turn's calls are cancelled with it: no prompt event ends them
                self._open.clear()
                self._attempts.clear()
                self._turn_id = self._turn_started_at = None
            case _:
                pass

    def state(self) -> CallsState:
        if self._state is None:
            self._state = CallsState(
                open=dict(self._open),
                attempts=dict(self._attempts),
                turn_id=self._turn_id,
                turn_started_at=self._turn_started_at,
            )
        return self._state


#: :class:`CallsState` over a session stream
CALLS = FolderAggregate("verify_calls", CallsState, CallsFolder, moves=_MOVES)


def restarts_key(runtime: str, actor: str) -> str:
    """Where :class:`RestartsState` keeps the restarts of one runtime instance's actor."""
    return f"{runtime}/{actor}"


class RestartsState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Every runtime instance's actors' ``supervisor:restarted`` times, oldest first,
    by :func:`restarts_key`."""

    history: dict[str, tuple[float, ...]] = msgspec.field(default_factory=dict)


class RestartsFolder:
    __slots__ = ("_history",)

    def __init__(self, state: RestartsState) -> None:
        self._history = dict(state.history)

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        if isinstance(event, SupervisorRestarted):
            key = restarts_key(event.runtime, event.actor)
            self._history[key] = (*self._history.get(key, ()), record.ts)

    def state(self) -> RestartsState:
        return RestartsState(history=dict(self._history))


#: :class:`RestartsState` over the ``runtime`` stream (what ``restart_history`` reads)
RESTARTS = FolderAggregate(
    "verify_restarts", RestartsState, RestartsFolder, moves=frozenset({SupervisorRestarted})
)
