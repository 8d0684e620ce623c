"""SubAgent: the owner of one run's stream ``session:<run id>`` (seeds 000 and 002, layer 1).

A run is a session whose ``subagent:spawned`` names its ``parent``. The actor:

* refuses a spawn with no valid timeout in ``start()`` itself (:class:`SpawnRefusedError`
  from :func:`~stalwart.state.spawn_timeout`, raised in the caller's thread before
  anything is appended);
* on start appends ``subagent:spawned`` (at ``clock.now()``), arms its one timer at
  :func:`~stalwart.state.watchdog_deadline` and submits the ``work`` to the
  :class:`~stalwart.actors.IoPortal`;
* appends every :class:`RunReport` call the work makes (``subagent:progress``,
  ``subagent:artifact``), and the work's end (``subagent:completed``, succeeded with its
  result or failed with no error text; a cancellation the work raised of its own, not
  one the actor made, is a failure too), then tells the parent :class:`RunEnded`;
* when the watchdog fires, asks :func:`~stalwart.state.decide_watchdog` at ``now``,
  appends ``subagent:watchdog_timeout`` (once: the fold makes the run ``timed_out``),
  cancels the work and tells the parent ``RunEnded(outcome="timed_out")`` with the static
  notice. A result that still arrives is recorded (``late_completion`` in the fold) and
  never delivered.

Its state changes only by folding what an append returned or what it read back from its
stream. The supervisor may write decisions into the same stream (``subagent:suspicious``,
``subagent:ghost_swept``, ``subagent:recovery_decided``, announcements), so every append
expects the version folded so far; on a conflict the actor reads what was added, folds it
and decides again. A run swept meanwhile has its work cancelled.

A restarted actor whose stream already holds the run does not run the work again (the
recovery protocol decides that); it re-arms the watchdog of a run still running. So does
an actor whose ``subagent:spawned`` another writer beat to the new stream (appended
expecting version 0): one run, one work, however many supervisors started it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Literal

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart._text import scrub_surrogates
from stalwart.clock import Clock
from stalwart.config import SubagentSettings
from stalwart.errors import ConcurrencyError, EventError, StoreError
from stalwart.events import (
    Event,
    SubagentArtifact,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    TaskClass,
)
from stalwart.ids import new_id
from stalwart.state import RUN, RunState, decide_watchdog, spawn_timeout, watchdog_deadline
from stalwart.store import EventStore, NewEvent, load_state

from ._portal import IoPortal
from ._restarts import crashed, tell_later
from ._scheduler import Scheduler
from ._subagent_notice import failure_notice
from ._supervised import Supervised

__all__ = [
    "GetRun",
    "RunEnded",
    "RunReport",
    "Spawn",
    "SubAgentActor",
    "Work",
]

log = get_logger(__name__)

#: How many append conflicts in a row the actor folds and retries before it fails.
MAX_CONFLICTS = 64

RunOutcome = Literal["succeeded", "failed", "timed_out", "swept"]


# -- messages -----------------------------------------------------------------------------


class Spawn(msgspec.Struct, frozen=True, kw_only=True):
    """What a parent asks for: a task with a mandatory timeout (a task class, or a custom
    timeout with a reason; neither gives ``max_run_timeout_ms``), optional ``max_steps``.
    ``channel`` / ``conversation`` / ``thread`` say where the run's failure notice and
    completion go."""

    run_id: str
    parent: str
    task: str
    task_class: TaskClass | None = None
    custom_timeout_ms: int | None = None
    reason: str | None = None
    max_steps: int | None = None
    attempt: int = 1
    channel: str = ""
    conversation: str = ""
    thread: str | None = None
    #: whether the result is announced to the parent (recorded in ``subagent:spawned``)
    announce: bool | None = None
    #: whether ``work`` is the host's own code, not a model (``subagent:spawned``)
    host_work: bool | None = None
    #: the run whose ``split`` made this lineage (``subagent:spawned``)
    split_from: str | None = None
    #: the run this one follows in the recovery protocol (a respawn's failed run, or the
    #: run a ``split`` ended): whose ``work``, agent and splitter the host's runtime uses
    #: again. Not recorded: only the process that spawned that run holds its work.
    retry_of: str | None = None
    #: the idempotency key of the ``spawn_subagent`` call it serves (``subagent:spawned``)
    call_key: str | None = None

    @property
    def stream(self) -> str:
        return f"session:{self.run_id}"


class RunEnded(msgspec.Struct, frozen=True, kw_only=True):
    """Told to the parent once per run: its outcome, the result of a success, or the
    static notice of a failure (never an error's text)."""

    run_id: str
    outcome: RunOutcome
    result: str = ""
    notice: str = ""


class GetRun(msgspec.Struct, frozen=True):
    """Ask for the run's :class:`~stalwart.state.RunState` (after a catch-up read)."""


class _Progress(msgspec.Struct, frozen=True):
    tokens: int
    step: int


class _Artifact(msgspec.Struct, frozen=True):
    path: str
    sha256: str
    final: bool


class _WorkDone(msgspec.Struct, frozen=True):
    result: str | None
    error_class: str | None = None


class _WatchdogDue(msgspec.Struct, frozen=True):
    at: float


class RunReport:
    """What the work is given to report with; each call is told to the actor (cheap,
    thread-safe, never blocks) and appended there.

    A value the log could not record raises :class:`TypeError` here, in the work's own
    thread, unless its meaning is plain: an integral float counts as its int, an
    :class:`os.PathLike` path as its text (a path that is not UTF-8 is recorded with
    U+FFFD for its undecodable bytes)."""

    __slots__ = ("_tell",)

    def __init__(self, tell: Callable[[object], None]) -> None:
        self._tell = tell

    def progress(self, tokens: int, step: int = 0) -> None:
        self._tell(_Progress(_count("tokens", tokens), _count("step", step)))

    def artifact(self, path: str | os.PathLike[str], sha256: str, final: bool = False) -> None:
        if not isinstance(sha256, str):
            raise TypeError(f"artifact sha256 must be str, found {type(sha256).__name__}")
        if not isinstance(final, bool):
            raise TypeError(f"artifact final must be bool, found {type(final).__name__}")
        self._tell(_Artifact(_path_text(path), scrub_surrogates(sha256), final))


def _count(name: str, value: object) -> int:
    """``value`` as the int a report records (an integral float is its int); TypeError
    for anything else (a bool, a fraction, text)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, found {type(value).__name__} {value!r}")
    return value


def _path_text(path: object) -> str:
    """``path`` (text or :class:`os.PathLike`) as text the log can store; TypeError for
    anything else (bytes included)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str):
        raise TypeError(f"artifact path must be str or a path, found {type(path).__name__}")
    return scrub_surrogates(text)


Work = Callable[[RunReport], Awaitable[str]]


def _work_done(future: Future[str], run: str, *, cancelled_here: bool) -> _WorkDone | None:
    """The work's end as the actor records it: a result that is not text fails the run
    (logged by its type, never its value); a lone surrogate in one becomes U+FFFD. A
    cancellation is no outcome when the actor made it (``cancelled_here``: the run was
    force-failed, or the actor stopped); one the work raised of its own (it awaited a
    task or future something else cancelled) fails the run, as any other exception."""
    if future.cancelled():
        return None if cancelled_here else _WorkDone(None, "CancelledError")
    exc = future.exception()
    if exc is not None:
        return _WorkDone(None, type(exc).__name__)
    result: object = future.result()
    if not isinstance(result, str):
        log.warning("subagent.result_not_text", run=run, result_type=type(result).__name__)
        return _WorkDone(None, "TypeError")
    return _WorkDone(scrub_surrogates(result))


# -- the actor ----------------------------------------------------------------------------


class SubAgentActor(Supervised):
    """Runs one sub-agent run under its watchdog; the owner of ``session:<run id>``.

    Start with ``SubAgentActor.start(store=..., clock=..., scheduler=..., portal=...,
    spawn=Spawn(...), work=..., parent=<ActorRef or None>, settings=SubagentSettings())``;
    it raises :class:`~stalwart.errors.SpawnRefusedError` for a spawn with no valid
    timeout. Ask :class:`GetRun` for the folded state. ``on_crash(exception class name)``
    is called once if the actor dies of an exception.
    """

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        spawn: Spawn,
        work: Work,
        parent: pykka.ActorRef[Any] | None = None,
        settings: SubagentSettings | None = None,
        on_crash: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self._settings = settings or SubagentSettings()
        self._on_crash = on_crash
        self._timeout_ms, self._knob = spawn_timeout(  # raises before anything is appended
            spawn.task_class,
            spawn.custom_timeout_ms,
            spawn.reason,
            class_timeouts_ms=msgspec.structs.asdict(self._settings.class_timeouts_ms),
            custom_max_ms=self._settings.custom_max_ms,
            default_ms=self._settings.max_run_timeout_ms,
        )
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._spawn = spawn
        self._work = work
        self._parent = parent
        self._stream = spawn.stream
        self._state: RunState = RUN.initial(self._stream)
        self._future: Future[str] | None = None
        #: set before the actor cancels the work itself (read by the done-callback)
        self._cancelled_here = False
        #: whether the parent was told how the run ended
        self._told = False
        self._timer_key = ("subagent", self.actor_urn)

    # -- lifecycle ---------------------------------------------------------------------------

    def started(self) -> None:
        self._state = load_state(self._store, self._stream, RUN, use_snapshots=False)
        if self._state.status == "new" and self._append_spawned():
            self._arm()  # before the work starts: it may report at once
            report = RunReport(self._tell)
            self._future = self._portal.submit(self._work, report)
            self._future.add_done_callback(self._finished)
        log.info(
            "subagent.started",
            run=self._stream,
            status=self._state.status,
            timeout_ms=self._state.timeout_ms,
            knob=self._state.timeout_knob,
        )
        self._arm()

    def on_stop(self) -> None:
        self._release()

    def on_failure(self, *exc_info: object) -> None:
        self._release()
        crashed(self._on_crash, exc_info)

    def _release(self) -> None:
        self._scheduler.cancel(self._timer_key)
        if self._future is not None:
            self._cancelled_here = True
            self._future.cancel()

    # -- messages ----------------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        match message:
            case _Progress(tokens=tokens, step=step):
                self._observe(SubagentProgress(tokens=tokens, step=step))
            case _Artifact(path=path, sha256=sha256, final=final):
                self._observe(SubagentArtifact(path=path, sha256=sha256, final=final))
            case _WorkDone():
                self._completed(message)
            case _WatchdogDue():
                self._watchdog()
            case GetRun():
                self._catch_up()
                return self._state
            case _:
                raise TypeError(f"SubAgentActor does not understand {message!r}")
        return None

    def _append_spawned(self) -> bool:
        """Append ``subagent:spawned`` to the new stream; False when another writer
        spawned the run first (two supervisors started the same recorded next run): this
        actor then only watches it, as a restarted one does, and never runs the work."""
        spawn = self._spawn
        event = SubagentSpawned(
            parent=spawn.parent,
            task=spawn.task,
            task_class=spawn.task_class or "custom",
            timeout_ms=self._timeout_ms,
            timeout_reason=spawn.reason if self._knob == "custom_timeout_ms" else None,
            max_steps=spawn.max_steps,
            attempt=spawn.attempt,
            timeout_knob=self._knob,
            channel=spawn.channel,
            conversation=spawn.conversation,
            thread=spawn.thread,
            announce=spawn.announce,
            host_work=spawn.host_work,
            split_from=spawn.split_from,
            next_run_id=new_id(),
            call_key=spawn.call_key,
        )
        if self._append(lambda state, now: [event] if state.status == "new" else []):
            return True
        log.warning("subagent.spawn_taken", run=self._stream, status=self._state.status)
        return False

    def _observe(self, event: Event) -> None:
        """A report of the work, while the run runs (one after a force-fail is dropped).
        One the log refuses, or cannot take (the store away for a moment), is dropped:
        a crash of this actor would cancel the work."""
        try:
            self._catch_up()
            if self._state.status != "running":
                log.info("subagent.report_dropped", run=self._stream, status=self._state.status)
                return
            self._append(lambda state, now: [event] if state.status == "running" else [])
        except (EventError, StoreError) as exc:
            log.warning(
                "subagent.report_unrecorded",
                run=self._stream,
                report=type(event).__name__,
                error=type(exc).__name__,
            )

    def _completed(self, done: _WorkDone) -> None:
        """The work's end, recorded; while the store is away it is told again in
        :data:`~stalwart.actors._restarts.DECISION_RETRY_S` (a crash of this actor would
        lose the result: the work does not run again)."""
        try:
            self._complete(done)
        except StoreError as exc:
            if isinstance(exc, ConcurrencyError):
                raise  # conflicts in a row: the actor fails, as any append of it would
            log.warning("subagent.completion_deferred", run=self._stream, error=type(exc).__name__)
            tell_later(self._scheduler, self._clock, self._tell, done)

    def _complete(self, done: _WorkDone) -> None:
        self._catch_up()
        before = self._state.status
        if before in ("succeeded", "failed") and not self._told:
            # recorded by an append that raised (its outcome in doubt): tell it now
            self._scheduler.cancel(self._timer_key)
            self._tell_parent(self._ended_as_recorded())
            return
        if before not in ("running", "timed_out", "swept") or self._state.late_completion:
            return
        event = self._record_completion(done)
        outcome = event.outcome
        if before != "running":  # the late result: recorded, never delivered twice
            log.warning("subagent.late_completion", run=self._stream, outcome=outcome)
            return
        self._scheduler.cancel(self._timer_key)
        log.info("subagent.completed", run=self._stream, outcome=outcome, error=done.error_class)
        if outcome == "succeeded":
            self._tell_parent(
                RunEnded(run_id=self._spawn.run_id, outcome=outcome, result=event.result)
            )
        else:
            self._tell_parent(self._failure("failed"))

    def _record_completion(self, done: _WorkDone) -> SubagentCompleted:
        """Append the work's end; a success the log refuses is recorded as a failure, so
        the run still ends at once."""
        if done.result is not None:
            event = SubagentCompleted(outcome="succeeded", result=done.result)
            try:
                self._append(lambda state, now: [event])
            except EventError as exc:
                log.warning(
                    "subagent.result_unrecorded", run=self._stream, error=type(exc).__name__
                )
            else:
                return event
        event = SubagentCompleted(outcome="failed", result="")
        self._append(lambda state, now: [event])
        return event

    def _watchdog(self) -> None:
        per_step = self._settings.per_step_timeout_ms
        recorded = self._append(
            lambda state, now: decide_watchdog(state, now, per_step_timeout_ms=per_step)
        )
        if not recorded:
            self._arm()  # early (or already ended): nothing decided
            return
        log.warning("subagent.watchdog_timeout", run=self._stream, knob=self._state.timeout_knob)
        self._cancel_work()
        self._tell_parent(self._failure("timed_out"))

    # -- fold, decide, append, then act ------------------------------------------------------

    def _append(self, decide: Callable[[RunState, float], list[Event]]) -> list[Event]:
        """Decide on the state folded so far at ``now`` and append expecting its version;
        on a conflict read what was added, fold it and decide again."""
        for attempt in range(1, MAX_CONFLICTS + 1):
            now = self._clock.now()
            events = decide(self._state, now)
            if not events:
                return []
            try:
                records = self._store.append(
                    self._stream,
                    [NewEvent(event=event, ts=now) for event in events],
                    expected_version=self._state.version,
                )
            except ConcurrencyError:
                if attempt == MAX_CONFLICTS:
                    raise  # the actor fails; its supervisor restarts it from the log
                self._catch_up()
                continue
            for record in records:
                self._state = RUN.apply(self._state, record)
            return events
        raise AssertionError("unreachable")

    def _catch_up(self) -> None:
        for record in self._store.read_stream(self._stream, self._state.version + 1):
            self._state = RUN.apply(self._state, record)
        if self._state.status in ("swept", "failed"):
            self._cancel_work()

    def _ended_as_recorded(self) -> RunEnded:
        """How the run ended as its folded completion says (succeeded or failed)."""
        if self._state.status == "succeeded":
            return RunEnded(
                run_id=self._spawn.run_id, outcome="succeeded", result=self._state.result
            )
        return self._failure("failed")

    def _failure(self, outcome: RunOutcome) -> RunEnded:
        state = self._state
        ended = state.ended_at if state.ended_at is not None else self._clock.now()
        runtime_ms = round((ended - (state.started_at or ended)) * 1000)
        notice = failure_notice(state.task, outcome, runtime_ms)
        return RunEnded(run_id=self._spawn.run_id, outcome=outcome, notice=notice)

    def _cancel_work(self) -> None:
        if self._future is not None and not self._future.done():
            self._cancelled_here = True  # before the cancel: its callback reads it
            self._future.cancel()

    def _tell_parent(self, ended: RunEnded) -> None:
        self._told = True
        if self._parent is None:
            return
        try:
            self._parent.tell(ended)
        except pykka.ActorDeadError:
            log.warning("subagent.parent_dead", run=self._stream, outcome=ended.outcome)

    # -- the timer and the work's callbacks --------------------------------------------------

    def _arm(self) -> None:
        deadline = watchdog_deadline(
            self._state, per_step_timeout_ms=self._settings.per_step_timeout_ms
        )
        if deadline is None:
            self._scheduler.cancel(self._timer_key)
        else:
            self._scheduler.schedule(deadline, self._due, key=self._timer_key)

    def _due(self, at: float) -> None:
        """Scheduler callback (its thread, or inside ``FakeClock.advance``)."""
        self._tell(_WatchdogDue(at))

    def _finished(self, future: Future[str]) -> None:
        """Done-callback (the portal's thread): the work's end becomes a message."""
        done = _work_done(future, self._stream, cancelled_here=self._cancelled_here)
        if done is not None:
            self._tell(done)

    def _tell(self, message: object) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(message)
