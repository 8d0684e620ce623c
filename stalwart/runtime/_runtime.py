"""The Runtime: the configured parts started on one event log (see the package).

Here are its lifecycle (start, close) and its public methods; what they do is in the
parts it builds on start and delegates to: ``_foundation`` (the store, the channels,
the portal and the scheduler), ``_parts`` (the restartable dead-letter, health,
supervisor and announcer actors), ``_sessions`` (the sessions' Agents and the durable
worker), ``_runs`` (the sub-agent runs), ``_context`` (the context engine) and
``_layer`` (the providers).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from functools import partial
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

from stalwart._logs import get_logger
from stalwart.actors import (
    Batch,
    HealthReport,
    HealthView,
    IoPortal,
    RunWatch,
    Spawn,
    Work,
    WorkerReport,
)
from stalwart.channels import Channel
from stalwart.clock import Clock, SystemClock
from stalwart.config import Config
from stalwart.context.pipeline import FileReader
from stalwart.events import TaskClass
from stalwart.ids import new_id
from stalwart.state import DeadLetterState
from stalwart.store import EventStore
from stalwart.tools import Tool, ToolRegistry, build_tool

from ._context import ContextLayer
from ._control import check_session_id
from ._foundation import Foundation
from ._handles import DEFAULT_CHANNEL, STOP_TIMEOUT_S, RunHandle, RunSpec, SessionHandle
from ._layer import ProviderLayer
from ._parts import PartsLayer
from ._runs import RunLayer, Splitter, stop_runs
from ._sessions import SessionLayer
from ._tools import BUILTIN_TOOLS, SPAWN_TOOL, SpawnTool
from ._wiring import Wiring, stop_actors
from ._workspace import Committer

__all__ = ["Runtime"]

log = get_logger(__name__)

#: How long a second ``close()`` waits for the first to end (each of its steps is bounded).
CLOSE_WAIT_S = 12 * STOP_TIMEOUT_S

F = TypeVar("F", bound=Callable[..., Any])
L = TypeVar("L")


class Runtime:
    """The configured parts, started on one event log; ``with Runtime(config) as rt:``.

    ``store``: an :class:`EventStore` (kept open: it is the host's), a path (opened,
    created if missing, and closed on ``close()``), or None for ``config.store.location``.
    ``clock`` defaults to the system clock. ``channels`` adds channels by name to those
    the config builds (a ``console`` channel when the config names none); ``tools`` is the
    registry the agents offer their models (a new one when None). ``file_reader`` (with
    ``context_engine.version = "pipeline"``) is how layer 9 reads the agent's instructions
    file and the files its summarized tool calls named: see
    :func:`stalwart.context.pipeline.directory_reader` (None: nothing is read again).
    """

    def __init__(
        self,
        config: Config,
        *,
        store: EventStore | str | os.PathLike[str] | None = None,
        clock: Clock | None = None,
        channels: Mapping[str, Channel] | None = None,
        tools: ToolRegistry | None = None,
        committer: Committer | None = None,
        file_reader: FileReader | None = None,
    ) -> None:
        self.config = config
        self._file_reader = file_reader
        self._committer = committer
        self.clock = clock or SystemClock()
        self.tools = tools if tools is not None else ToolRegistry()
        self.tools.reserve(BUILTIN_TOOLS, "a stalwart built-in tool")
        self.health_view = HealthView()
        self._base = Foundation(config, self.clock, store, channels or {})
        self._lock = threading.RLock()
        self._state: Literal["new", "running", "closed"] = "new"
        self._closing: _Closing | None = None  # the close under way or done
        # built on start (see _start_layers)
        self._layer: ProviderLayer | None = None
        self._parts: PartsLayer | None = None
        self._sessions: SessionLayer | None = None
        self._runs: RunLayer | None = None
        self._context: ContextLayer | None = None
        # held while an infrastructure actor's crash is decided (see PartsLayer.crashed)
        self._restarts_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def store(self) -> EventStore:
        """The event log (RuntimeError before ``start()``)."""
        return self._base.store

    @property
    def channels(self) -> Mapping[str, Channel]:
        """Every channel a session may use, by name."""
        return dict(self._base.channels)

    @property
    def portal(self) -> IoPortal:
        """The I/O loop's portal: ``rt.portal.submit(coro_fn, *args)`` runs a coroutine
        where the clients and channels live (RuntimeError before ``start()``)."""
        return self._base.portal

    def start(self) -> Self:
        """Open the store, record ``runtime:started`` and start the parts (once)."""
        with self._lock:
            if self._state == "running":
                return self
            if self._state == "closed":
                raise RuntimeError("this runtime was closed: make a new Runtime")
            self._state = "running"
            try:
                self._base.open()
                self._layer = ProviderLayer(self.config, self.store, clock=self.clock)
                self._start_layers(self._base.wiring(self._lock, lambda: self.running))
            except BaseException:
                self.close(reason="start failed")
                raise
        providers = sorted(self.config.providers)
        log.info("runtime.started", providers=providers, channels=sorted(self._base.channels))
        return self

    def _start_layers(self, wiring: Wiring) -> None:
        """The restartable parts, then the context engine, then the durable worker."""
        assert self._layer is not None
        parts = self._parts = PartsLayer(
            wiring, self.health_view, restarts_lock=self._restarts_lock
        )
        sessions = self._sessions = SessionLayer(
            wiring,
            self._layer,
            tools=self.tools,
            health_view=self.health_view,
            committer=self._committer,
            dead_letters=parts.dead_letters_ref,
            tell_supervisor=parts.tell_supervisor,
            spawn_tool=self._spawn_tool,
        )
        self._runs = RunLayer(
            wiring, sessions, announcer=parts.announcer_ref, tell_supervisor=parts.tell_supervisor
        )
        parts.start(self._runs)
        if self.config.agents:
            self._context = ContextLayer(
                self.config,
                wiring.store,
                self.clock,
                wiring.portal,
                self._layer,
                timer=wiring.timer,
                on_crash=lambda start, reason: parts.crashed(
                    "context", partial(parts.restart, "context", start), reason
                ),
                file_reader=self._file_reader,
                down_for_good=lambda: parts.is_given_up("context") or not wiring.running(),
            )
            self._context.start()
        parts.on_given_up(sessions.part_given_up)
        sessions.start(
            self._context,
            on_worker_crash=lambda start, reason: parts.crashed(
                "activations", partial(parts.restart, "activations", start), reason
            ),
            given_up=parts.is_given_up,
        )

    def close(self, reason: str = "shutdown") -> None:
        """Stop everything and record ``runtime:stopped``.

        Called on the runtime's own I/O loop (an async tool, a channel's send), it
        returns at once and the close goes on on a thread of its own, since the loop
        cannot wait for itself. A second call returns once the first has ended (at once
        on the thread that closes, or on the loop)."""
        with self._lock:
            earlier = self._closing
            if earlier is None:
                sessions = self._sessions.take() if self._sessions is not None else []
                runs = self._runs.take() if self._runs is not None else []
                self._state = "closed"
                self._closing = closing = _Closing(partial(self._close, reason, sessions, runs))
        if earlier is not None:
            if not earlier.runs_here() and not self._base.on_loop_thread():
                earlier.done.wait(CLOSE_WAIT_S)
            return
        if self._base.on_loop_thread():
            threading.Thread(target=closing.run, name="stalwart-close").start()
        else:
            closing.run()

    def _close(self, reason: str, sessions: list[SessionHandle], runs: list[RunSpec]) -> None:
        parts, base = self._parts, self._base
        steps: list[tuple[str, Callable[[], object]]] = [
            (
                "worker",
                lambda: self._sessions.pause_worker() if self._sessions is not None else None,
            ),
            (
                "sends",  # the answers being sent get a moment to end and be recorded
                lambda: self._sessions.let_sends_end(sessions) if self._sessions else None,
            ),
            ("agents", lambda: stop_actors([s.ref for s in sessions])),
            (
                # their leases are handed back, each claiming the next epoch: an Agent
                # that did not stop in time is fenced out, as after a takeover
                "leases",
                lambda: self._sessions.stop_worker() if self._sessions is not None else None,
            ),
            ("runs", lambda: stop_runs(runs)),
            ("supervision", lambda: parts.stop_supervision() if parts else None),
            ("health", lambda: parts.stop_health() if parts else None),
            ("dead_letters", lambda: parts.stop_dead_letters() if parts else None),
            ("context", lambda: self._context.stop() if self._context else None),
            ("providers", lambda: base.on_loop(self._layer.aclose if self._layer else None)),
            ("channels", base.close_channels),
            ("threads", base.stop_threads),
            ("log", lambda: base.finish(reason)),
        ]
        for part, step in steps:
            try:
                step()
            except Exception:
                log.exception("runtime.stop_failed", part=part)
        log.info("runtime.stopped", reason=reason)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(reason="shutdown" if exc is None else "error")

    # -- what a host uses --------------------------------------------------------------------

    @overload
    def tool(self, fn: F, **options: Any) -> F: ...

    @overload
    def tool(self, fn: None = None, **options: Any) -> Callable[[F], F]: ...

    def tool(self, fn: F | None = None, **options: Any) -> F | Callable[[F], F]:
        """Register a tool the agents offer their models; ``@rt.tool`` or ``@rt.tool(...)``.

        Options are :meth:`ToolRegistry.register`'s (``name``, ``description``,
        ``parameters``, ``timeout_ms``, ``needs_confirmation``)."""
        registered: F | Callable[[F], F]
        if fn is None:
            registered = self.tools.register(**options)
        else:
            registered = self.tools.register(fn, **options)
        return registered

    def session(
        self,
        session_id: str | None = None,
        *,
        agent: str = "default",
        channel: str | None = None,
        conversation: str | None = None,
        thread: str | None = None,
    ) -> SessionHandle:
        """The running session ``session_id``, or start its agent (a new id when None).

        A session that runs already is returned as it is (its agent and channel were
        chosen when it started). ``channel`` defaults to ``console``; ``conversation``
        (where the channel delivers) to the session id. ConfigError for an unknown agent
        or channel; SessionActionError (``invalid_session``) for an id no session can
        have (see :func:`stalwart.ids.valid_session_id`)."""
        with self._lock:
            sessions = self._started(self._sessions)
            channel = channel or DEFAULT_CHANNEL
            chosen = new_id() if session_id is None else session_id
            return sessions.session(chosen, agent, channel, conversation, thread)

    # -- durable sessions ----------------------------------------------------------------------

    def confirm(self, session_id: str, request_id: str, *, allow: bool) -> str:
        """Answer a pending approval (see :func:`stalwart.runtime.confirm`)."""
        return self._session_layer().confirm(session_id, request_id, allow=allow)

    def submit_tool_result(self, session_id: str, request_id: str, output: str) -> str:
        """Give a pending custom tool call its output; the session resumes."""
        return self._session_layer().submit_tool_result(session_id, request_id, output)

    def interrupt(self, session_id: str, reason: str = "") -> list[str]:
        """Clear the pending request, cancel queued wakes, stop a running one."""
        return self._session_layer().interrupt(session_id, reason)

    def wake_at(
        self, session_id: str, at: float, text: str, *, dedupe_key: str | None = None
    ) -> str:
        """Schedule a delayed wake of the session (SessionActionError over the caps)."""
        return self._session_layer().wake_at(session_id, at, text, dedupe_key)

    def worker(self, timeout: float = STOP_TIMEOUT_S) -> WorkerReport:
        """What this process's activation worker holds (owner, leases, position)."""
        return self._session_layer().worker(timeout)

    def _session_layer(self) -> SessionLayer:
        """The sessions of the running runtime, taken under its lock: a call from another
        thread while ``start()`` runs waits for it (its layers are built then)."""
        with self._lock:
            return self._started(self._sessions)

    # -- sub-agents ----------------------------------------------------------------------------

    def spawn(
        self,
        parent_session: str,
        task: str,
        *,
        task_class: TaskClass | None = None,
        custom_timeout_ms: int | None = None,
        reason: str | None = None,
        max_steps: int | None = None,
        work: Work | None = None,
        channel: str | None = None,
        conversation: str | None = None,
        agent: str | None = None,
        announce: bool = True,
        splitter: Splitter | None = None,
    ) -> RunHandle:
        """Start a sub-agent run for ``parent_session`` under its watchdog.

        Every spawn has a timeout, no exceptions: a ``task_class``, or ``custom_timeout_ms``
        with a ``reason`` (SpawnRefusedError otherwise, raised before anything is
        appended). ``work`` is the async callable the run awaits (given a
        :class:`~stalwart.actors.RunReport`); without it the run is a model-driven
        sub-session: an Agent (``agent``, default the parent's) on the run's own stream
        answers ``task``. ``channel`` / ``conversation`` (default the parent session's)
        are where its failure notice and, when ``announce``, its batched completion go.
        ``splitter(task, context) -> subtasks``: when this run's lineage has failed
        ``recovery_max_attempts`` times, the supervisor calls it on its own thread (keep it
        cheap: no I/O) and spawns each subtask as a model-driven first attempt (same
        parent, timeout, channel; no splitter of its own); one that raises or returns
        nothing escalates. SessionActionError (``invalid_session``) for a
        ``parent_session`` no session can have, before anything is appended.
        """
        check_session_id(parent_session)
        with self._lock:
            runs = self._started(self._runs)
            agent, channel, conversation, thread = runs.defaults(
                parent_session, agent, channel, conversation
            )
            spawn = Spawn(
                run_id=new_id(),
                parent=parent_session,
                task=task,
                task_class=task_class,
                custom_timeout_ms=custom_timeout_ms,
                reason=reason,
                max_steps=max_steps,
                channel=channel,
                conversation=conversation,
                thread=thread,
            )
            return runs.spawn(spawn, work, agent, announce=announce, splitter=splitter)

    def run(self, run_id: str) -> RunHandle | None:
        """The handle of a run still running (a respawned one included), or None."""
        with self._lock:
            return self._runs.handle(run_id) if self._runs is not None else None

    def runs(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, RunWatch]:
        """Every run the supervisor folded (asked: what it decided before is in it)."""
        with self._lock:
            parts = self._started(self._parts)
        return parts.runs(timeout)

    def announcements(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, Batch]:
        """The completion batches not sent yet, by parent session (asked of the announcer)."""
        with self._lock:
            parts = self._started(self._parts)
        return parts.announcements(timeout)

    def _spawn_tool(self, session_id: str, agent: str) -> Tool:
        """The ``spawn_subagent`` tool of one session (see :class:`SpawnTool`)."""
        spawner = SpawnTool(self, session_id, agent)
        # the run's own limit rules: this only bounds a wait nothing else would end
        timeout_ms = self.config.subagents.spawn_wait_ms
        tool = build_tool(spawner.spawn_subagent, name=SPAWN_TOOL, timeout_ms=timeout_ms)
        # a call a crash cut short finds the run it spawned (named after the call)
        return dataclasses.replace(tool, reconcile=spawner.reconcile)

    # -- the parts' health ---------------------------------------------------------------------

    def health(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, HealthReport]:
        """Each provider's health as its actor has folded it (asked, so a decision already
        in the log is in the answer; the same reports are in :attr:`health_view`)."""
        with self._lock:
            parts = self._started(self._parts)
        return parts.health(timeout)

    def dead_letters(self, timeout: float = STOP_TIMEOUT_S) -> DeadLetterState:
        """The dead-letter queue as its actor has folded it."""
        with self._lock:
            parts = self._started(self._parts)
        return parts.dead_letters(timeout)

    def given_up(self) -> dict[str, int]:
        """The parts supervision gave up on after repeated crashes (``activations``,
        ``supervisor``, ``announcer``, ``deadletter``, ``context``, ``health:<provider>``),
        each with how many tells it refused since; empty while every part runs. A part
        given up on does not run again in this runtime: with ``activations`` or
        ``context`` no session's work runs here any more (a host restarts its runtime)."""
        with self._lock:
            parts = self._started(self._parts)
        return parts.given_up()

    def _require_running(self) -> None:
        if self._state != "running":
            raise RuntimeError(f"the runtime is {self._state}: use start() or a with block")

    def _started(self, layer: L | None) -> L:
        """``layer`` of the running runtime (RuntimeError when it is not running)."""
        self._require_running()
        assert layer is not None
        return layer

    def __repr__(self) -> str:
        sessions = self._sessions.count() if self._sessions is not None else 0
        return f"Runtime({self._state}, sessions={sessions})"


class _Closing:
    """A runtime's one close: its steps, the thread running them, and when they ended."""

    def __init__(self, steps: Callable[[], None]) -> None:
        self._steps = steps
        self._ident: int | None = None
        self.done = threading.Event()

    def runs_here(self) -> bool:
        return self._ident == threading.get_ident()

    def run(self) -> None:
        self._ident = threading.get_ident()
        try:
            self._steps()
        finally:
            self.done.set()
