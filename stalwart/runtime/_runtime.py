"""The Runtime: the configured parts started on one event log (see the package)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

import msgspec
import pykka

import stalwart
from stalwart import store as store_module
from stalwart._logs import get_logger
from stalwart.actors import (
    AgentActor,
    AgentLoopSettings,
    Announcer,
    Batch,
    Crashed,
    DeadLetterActor,
    Drain,
    GetBatches,
    GetHealth,
    GetRuns,
    HealthChanged,
    HealthReport,
    HealthView,
    IoPortal,
    LeaseLost,
    ProviderHealthActor,
    QueueState,
    RunEnded,
    RunReport,
    RunWatch,
    Scheduler,
    Spawn,
    SubAgentActor,
    SupervisorActor,
    Track,
    WakeFailed,
    Work,
    WorkerReport,
    subsession_work,
)
from stalwart.actors._restarts import Restarts
from stalwart.channels import Channel, ConsoleChannel, MemoryChannel, channel_from_settings
from stalwart.clock import Clock, SystemClock
from stalwart.config import Config
from stalwart.errors import ConcurrencyError, ConfigError, SpawnRefusedError
from stalwart.events import Event, RuntimeStarted, RuntimeStopped, SessionCreated, TaskClass
from stalwart.ids import new_id
from stalwart.state import DeadLetterState, spawn_timeout
from stalwart.store import NO_STREAM, EventStore, NewEvent
from stalwart.tools import Tool, ToolRegistry, build_tool

from ._context import ContextLayer
from ._control import (
    confirm,
    interrupt,
    load_session,
    schedule_wake,
    send_message,
    submit_tool_result,
)
from ._durable import Durability
from ._handles import (
    DEFAULT_CHANNEL,
    RUNTIME_STREAM,
    STOP_TIMEOUT_S,
    LiveRef,
    RunHandle,
    RunSpec,
    SessionHandle,
)
from ._layer import ProviderLayer
from ._tools import SPAWN_TOOL, SessionTools, spawn_tool_fn
from ._workspace import Committer, draft_tools

__all__ = ["Runtime"]

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
#: ``rt.spawn(..., splitter=)``: ``(task, context) -> subtasks`` (see :meth:`Runtime.spawn`)
Splitter = Callable[[str, str], Sequence[str]]


class Runtime:
    """The configured parts, started on one event log; ``with Runtime(config) as rt:``.

    ``store``: an :class:`EventStore` (kept open: it is the host's), a path (opened,
    created if missing, and closed on ``close()``), or None for ``config.store.location``.
    ``clock`` defaults to the system clock. ``channels`` adds channels by name to those
    the config builds (a ``console`` channel when the config names none); ``tools`` is the
    registry the agents offer their models (a new one when None).
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
    ) -> None:
        self.config = config
        self._committer = committer
        self.clock = clock or SystemClock()
        self.tools = tools if tools is not None else ToolRegistry()
        self.health_view = HealthView()
        self._store_arg = store
        self._extra_channels = dict(channels or {})
        self._lock = threading.RLock()
        self._state: Literal["new", "running", "closed"] = "new"
        self._store: EventStore | None = None
        self._owns_store = False
        self._started_recorded = False
        self._portal: IoPortal | None = None
        self._scheduler: Scheduler | None = None
        self._layer: ProviderLayer | None = None
        self._channels: dict[str, Channel] = {}
        self._built_channels: list[Channel] = []
        self._dead_letters: pykka.ActorRef[Any] | None = None
        self._health: dict[str, pykka.ActorRef[Any]] = {}
        self._sessions: dict[str, SessionHandle] = {}
        self._supervisor: pykka.ActorRef[Any] | None = None
        self._announcer: pykka.ActorRef[Any] | None = None
        self._runs: dict[str, RunSpec] = {}
        self._works: dict[tuple[str, str], tuple[Work | None, str]] = {}
        self._splitters: dict[tuple[str, str], Splitter] = {}
        # the infrastructure actors' restarts (see _part_crashed); what the actors hold
        # instead of these parts' refs, so a restarted part needs no re-wiring
        self._restarts: Restarts | None = None
        self._restarts_lock = threading.Lock()
        self._tracks: dict[str, Track] = {}  # what a restarted announcer is told again
        self._dead_letters_ref = LiveRef(lambda: self._dead_letters, "deadletter")
        self._durable: Durability | None = None
        self._context: ContextLayer | None = None
        self._supervisor_ref = LiveRef(lambda: self._supervisor, "supervisor")
        self._announcer_ref = LiveRef(lambda: self._announcer, "announcer")

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def store(self) -> EventStore:
        """The event log (RuntimeError before ``start()``)."""
        if self._store is None:
            raise RuntimeError("the runtime has not started: use start() or a with block")
        return self._store

    @property
    def channels(self) -> Mapping[str, Channel]:
        """Every channel a session may use, by name."""
        return dict(self._channels)

    @property
    def portal(self) -> IoPortal:
        """The I/O loop's portal: ``rt.portal.submit(coro_fn, *args)`` runs a coroutine
        where the clients and channels live (RuntimeError before ``start()``)."""
        if self._portal is None:
            raise RuntimeError("the runtime has not started: use start() or a with block")
        return self._portal

    def start(self) -> Self:
        """Open the store, record ``runtime:started`` and start the parts (once)."""
        with self._lock:
            if self._state == "running":
                return self
            if self._state == "closed":
                raise RuntimeError("this runtime was closed: make a new Runtime")
            self._state = "running"
            try:
                self._start_parts()
            except BaseException:
                self.close(reason="start failed")
                raise
        log.info("runtime.started", providers=sorted(self._health), channels=sorted(self._channels))
        return self

    def _start_parts(self) -> None:
        self._store, self._owns_store = self._open_store()
        # the channels first: a channel the config cannot build fails the start before
        # anything is recorded or started
        self._channels = self._build_channels()
        started = RuntimeStarted(
            config=self.config.to_record(),
            stalwart_version=stalwart.__version__,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        self._record(started)
        self._started_recorded = True
        self._portal = IoPortal().start()
        self._scheduler = Scheduler(self.clock).start()
        self._layer = ProviderLayer(self.config, self._store, clock=self.clock)
        self._restarts = Restarts(
            store=self._store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            channels=self._channels,
            dead_letters=None,
            settings=self.config.supervision,
            send_timeout_s=self.config.dead_letters.announce_timeout_ms / 1000,
            default_channel=DEFAULT_CHANNEL,
            tell=lambda _message: None,  # no notices: an infrastructure give-up is logged
            key="runtime",
        )
        self._dead_letters = self._start_dead_letters()
        self._start_supervision()
        for provider in self.config.providers:
            self._health[provider] = self._start_health(provider)
        if self.config.agents:
            self._context = ContextLayer(
                self.config,
                self._store,
                self.clock,
                self._portal,
                self._layer,
                on_crash=lambda start, reason: self._part_crashed(
                    "context", partial(self._restart_part, "context", start), reason
                ),
            )
            self._context.start()
        self._durable = Durability(
            self._store,
            self.clock,
            self._scheduler,
            self.config.activations,
            agent_for=self._agent_for_wake,
            passivate=self._passivate,
        )

    def _start_dead_letters(self) -> pykka.ActorRef[Any]:
        assert self._scheduler is not None
        assert self._portal is not None
        return DeadLetterActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            channels=self._channels,
            settings=self.config.dead_letters,
            on_crash=partial(self._part_crashed, "deadletter", self._restart_dead_letters),
        )

    def _start_health(self, provider: str) -> pykka.ActorRef[Any]:
        assert self._scheduler is not None
        restart = partial(self._restart_health, provider)
        return ProviderHealthActor.start(
            self.store,
            self.clock,
            self._scheduler,
            provider,
            self.config.health,
            [self._on_health_changed],
            self.health_view,
            on_crash=partial(self._part_crashed, f"health:{provider}", restart),
        )

    def _start_supervision(self) -> None:
        self._supervisor = self._start_supervisor()
        self._announcer = self._start_announcer()

    def _start_supervisor(self) -> pykka.ActorRef[Any]:
        assert self._scheduler is not None
        assert self._portal is not None
        return SupervisorActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            channels=self._channels,
            dead_letters=self._dead_letters_ref,
            spawner=self._respawn,
            splitters=self._splitter_of,
            settings=self.config.subagents,
            announce_timeout_ms=self.config.dead_letters.announce_timeout_ms,
            default_channel=DEFAULT_CHANNEL,
            supervision=self.config.supervision,
            on_crash=partial(self._part_crashed, "supervisor", self._restart_supervisor),
        )

    def _start_announcer(self) -> pykka.ActorRef[Any]:
        assert self._scheduler is not None
        assert self._portal is not None
        subagents = self.config.subagents
        return Announcer.start(
            store=self.store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            channels=self._channels,
            supervisor=self._supervisor_ref,
            on_ended=self._run_ended,
            dead_letters=self._dead_letters_ref,
            debounce_ms=subagents.announce_debounce_ms,
            max_wait_ms=subagents.announce_max_wait_ms,
            send_timeout_ms=self.config.dead_letters.announce_timeout_ms,
            on_crash=partial(self._part_crashed, "announcer", self._restart_announcer),
        )

    def _open_store(self) -> tuple[EventStore, bool]:
        given = self._store_arg
        if given is None:
            given = self.config.store.location
        if isinstance(given, str | os.PathLike):
            return store_module.open(given, clock=self.clock), True
        return given, False

    def _build_channels(self) -> dict[str, Channel]:
        built: dict[str, Channel] = {}
        for name, settings in self.config.channels.items():
            if name not in self._extra_channels:
                built[name] = channel_from_settings(name, settings, clock=self.clock)
        if not self.config.channels and DEFAULT_CHANNEL not in self._extra_channels:
            built[DEFAULT_CHANNEL] = ConsoleChannel(DEFAULT_CHANNEL)
        self._built_channels = list(built.values())
        return {**built, **self._extra_channels}

    def close(self, reason: str = "shutdown") -> None:
        """Stop everything and record ``runtime:stopped``; a second call does nothing."""
        with self._lock:
            if self._state == "closed":
                return
            self._state = "closed"
            sessions = list(self._sessions.values())
            self._sessions.clear()
            runs = list(self._runs.values())
            self._runs.clear()
        steps: list[tuple[str, Callable[[], object]]] = [
            ("worker", lambda: self._durable.stop() if self._durable else None),
            ("agents", lambda: _stop_actors([s.ref for s in sessions])),
            ("runs", lambda: _stop_runs(runs)),
            ("supervision", lambda: _stop_actors([self._announcer, self._supervisor])),
            ("health", lambda: _stop_actors(list(self._health.values()))),
            ("dead_letters", lambda: _stop_actors([self._dead_letters])),
            ("context", lambda: self._context.stop() if self._context else None),
            ("providers", lambda: self._on_loop(self._layer.aclose if self._layer else None)),
            ("channels", self._close_channels),
            ("threads", self._stop_threads),
            ("log", lambda: self._finish(reason)),
        ]
        for part, step in steps:
            try:
                step()
            except Exception:
                log.exception("runtime.stop_failed", part=part)
        log.info("runtime.stopped", reason=reason)

    def _stop_threads(self) -> None:
        """The scheduler, then the portal (which cancels whatever is still in flight)."""
        try:
            if self._scheduler is not None:
                self._scheduler.stop(STOP_TIMEOUT_S)
        finally:
            if self._portal is not None:
                self._portal.stop()

    def _finish(self, reason: str) -> None:
        """Record ``runtime:stopped`` (after a recorded start) and close a store we opened."""
        if self._store is None:
            return
        try:
            if self._started_recorded:
                self._record(RuntimeStopped(reason=reason))
        finally:
            if self._owns_store:
                self._store.close()

    def _close_channels(self) -> None:
        for channel in self._built_channels:
            try:
                self._on_loop(channel.aclose)
            except Exception:
                log.exception("runtime.channel_close_failed", channel=channel.name)

    def _on_loop(self, fn: Callable[[], Awaitable[T]] | None) -> T | None:
        """Run ``fn()`` on the portal's loop (where its clients live), within the stop bound."""
        if fn is None or self._portal is None or not self._portal.running:
            return None
        return self._portal.submit(fn).result(STOP_TIMEOUT_S)

    def _record(self, event: Event) -> None:
        self.store.append(RUNTIME_STREAM, [NewEvent(event=event, ts=self.clock.now())])

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
        or channel."""
        with self._lock:
            self._require_running()
            session_id = session_id or new_id()
            running = self._sessions.get(session_id)
            if running is not None and running.ref.is_alive():
                return running
            handle = self._start_agent(
                session_id, agent, channel or DEFAULT_CHANNEL, conversation, thread
            )
            self._sessions[session_id] = handle
            return handle

    def _start_agent(
        self,
        session_id: str,
        agent: str,
        channel: str,
        conversation: str | None,
        thread: str | None,
        *,
        supervised: bool = True,
        target: Channel | None = None,
    ) -> SessionHandle:
        settings = self.config.agent(agent)
        target = target or self._channels.get(channel)
        if target is None:
            raise ConfigError(
                f"no channel named {channel!r} (available: {sorted(self._channels) or 'none'})",
                key=f"channels.{channel}",
            )
        assert self._layer is not None
        assert self._scheduler is not None
        assert self._portal is not None
        loop = AgentLoopSettings(
            max_steps=settings.max_steps,
            tool_limit=settings.tool_limit,
            execution_timeout_ms=self.config.supervision.execution_timeout_ms,
            send_timeout_ms=self.config.dead_letters.announce_timeout_ms,
            system_prompt=settings.system_prompt,
            context_window=settings.context_window,
        )
        durable = self._durable if supervised else None
        if durable is not None:  # the session exists when session() returns
            created = SessionCreated(agent=agent, channel=target.name)
            with contextlib.suppress(ConcurrencyError):
                self.store.append(
                    f"session:{session_id}",
                    [NewEvent(event=created, ts=self.clock.now())],
                    expected_version=NO_STREAM,
                )
        tools: ToolRegistry = self.tools
        own: list[Tool] = []
        if settings.subagents and supervised:
            own.append(self._spawn_tool(session_id, agent))
        if durable is not None and self._committer is not None:
            own.extend(
                draft_tools(
                    self.store,
                    self._layer.sink,
                    self.clock,
                    session_id,
                    self._committer,
                    max_bytes=self.config.activations.max_draft_bytes,
                )
            )
        context = self._context if supervised else None
        if context is not None:
            own.extend(context.tools(session_id, None))
        if own:
            tools = SessionTools(self.tools, *own)
        ref = AgentActor.start(
            session_id,
            self.store,
            self.clock,
            self._scheduler,
            self._portal,
            self._layer.caller(agent),
            tools,
            target,
            conversation=conversation,
            thread=thread,
            settings=loop,
            is_degraded=self.health_view.is_degraded,
            dead_letters=self._dead_letters_ref,
            agent_name=agent,
            on_crash=partial(self._agent_crashed, session_id) if supervised else None,
            policy=durable.policy if durable is not None else None,
            worker=durable.tell if durable is not None else None,
            jitter_ms=durable.jitter_ms if durable is not None else None,
            hold=self._layer.sink.hold if durable is not None else None,
            context=context.gate if context is not None else None,
            profile=context.profile(agent) if context is not None else None,
        )
        return SessionHandle(
            session_id,
            ref,
            agent=agent,
            channel=channel,
            conversation=conversation,
            thread=thread,
            post=partial(self._post, session_id) if durable is not None else None,
        )

    # -- durable sessions ----------------------------------------------------------------------

    def _post(self, session_id: str, text: str, message_id: str | None) -> None:
        """A user message, durable on return (``activation:ready``); the worker runs it."""
        if self._state != "running":
            raise RuntimeError(f"session {session_id!r} is stopped: its runtime was closed")
        send_message(self.store, session_id, text, message_id=message_id, ts=self.clock.now())
        self._nudge()

    def _nudge(self) -> None:
        if self._durable is not None:
            self._durable.nudge()

    def _agent_for_wake(self, session_id: str, start: bool) -> pykka.ActorRef[Any] | None:
        """The Agent a wake goes to: the running one, or one started from the session's
        recorded agent and channel (after a takeover or a passivation)."""
        with self._lock:
            if self._state != "running":
                return None
            handle = self._sessions.get(session_id)
            if handle is not None and handle.ref.is_alive():
                return handle.ref
            if not start:
                return None
            session, _ = load_session(self.store, session_id)
            agent = session.agent if session.agent in self.config.agents else "default"
            channel = session.channel if session.channel in self._channels else None
            try:
                if handle is not None:  # passivated or crashed: the host's handle stays valid
                    fresh = self._start_agent(
                        session_id,
                        handle.agent,
                        handle.channel,
                        handle.conversation,
                        handle.thread,
                    )
                    handle.ref = fresh.ref
                    return handle.ref
                return self.session(session_id, agent=agent, channel=channel).ref
            except ConfigError as exc:
                log.warning("runtime.wake_without_agent", session=session_id, key=exc.key)
                return None

    def _passivate(self, session_id: str) -> None:
        """Stop an idle session's Agent (its handle stays: the next wake restarts it)."""
        with self._lock:
            handle = self._sessions.get(session_id)
        if handle is not None and handle.ref.is_alive():
            log.info("runtime.passivated", session=session_id)
            _stop_actors([handle.ref])

    def confirm(self, session_id: str, request_id: str, *, allow: bool) -> str:
        """Answer a pending approval (see :func:`stalwart.runtime.confirm`)."""
        self._require_running()
        resumed = confirm(self.store, session_id, request_id, allow=allow, ts=self.clock.now())
        self._nudge()
        return resumed

    def submit_tool_result(self, session_id: str, request_id: str, output: str) -> str:
        """Give a pending custom tool call its output; the session resumes."""
        self._require_running()
        resumed = submit_tool_result(
            self.store, session_id, request_id, output, ts=self.clock.now()
        )
        self._nudge()
        return resumed

    def interrupt(self, session_id: str, reason: str = "") -> list[str]:
        """Clear the pending request, cancel queued wakes, stop a running one."""
        self._require_running()
        cancelled = interrupt(self.store, session_id, reason, ts=self.clock.now())
        ref = self._agent_for_wake(session_id, False)
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(LeaseLost(f"session:{session_id}", None))
        self._nudge()
        return cancelled

    def wake_at(
        self, session_id: str, at: float, text: str, *, dedupe_key: str | None = None
    ) -> str:
        """Schedule a delayed wake of the session (SessionActionError over the caps)."""
        self._require_running()
        assert self._durable is not None
        activation_id = schedule_wake(
            self.store,
            session_id,
            at,
            now=self.clock.now(),
            policy=self._durable.policy,
            text=text,
            dedupe_key=dedupe_key,
        )
        self._nudge()
        return activation_id

    def worker(self, timeout: float = STOP_TIMEOUT_S) -> WorkerReport:
        """What this process's activation worker holds (owner, leases, position)."""
        self._require_running()
        assert self._durable is not None
        return self._durable.report(timeout)

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
        nothing escalates.
        """
        with self._lock:
            self._require_running()
            parent = self._sessions.get(parent_session)
            agent = agent or (parent.agent if parent is not None else "default")
            self.config.agent(agent)  # ConfigError for an unknown agent
            channel = channel or (parent.channel if parent is not None else DEFAULT_CHANNEL)
            if conversation is None:
                conversation = parent.conversation if parent is not None else parent_session
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
            )
            self._check_spawn(spawn)
            self._works[(parent_session, task)] = (work, agent)
            if splitter is not None:
                self._splitters[(parent_session, task)] = splitter
            else:
                self._splitters.pop((parent_session, task), None)
            return self._start_run(spawn, work, agent, announce=announce)

    def _check_spawn(self, spawn: Spawn) -> None:
        """SpawnRefusedError (nothing appended) for no valid timeout or an unknown channel."""
        settings = self.config.subagents
        spawn_timeout(
            spawn.task_class,
            spawn.custom_timeout_ms,
            spawn.reason,
            class_timeouts_ms=msgspec.structs.asdict(settings.class_timeouts_ms),
            custom_max_ms=settings.custom_max_ms,
            default_ms=settings.max_run_timeout_ms,
        )
        if spawn.channel not in self._channels:
            raise SpawnRefusedError(
                f"spawn refused: no channel named {spawn.channel!r} "
                f"(available: {sorted(self._channels) or 'none'})",
                field="channel",
            )

    def _start_run(
        self, spawn: Spawn, work: Work | None, agent: str, *, announce: bool
    ) -> RunHandle:
        assert self._scheduler is not None
        assert self._portal is not None
        assert self._announcer is not None
        run = RunSpec(spawn, work, agent)
        if work is None:
            start = partial(self._start_subsession, spawn.run_id, agent)
            work = subsession_work(self.store, spawn.run_id, spawn.task, start)
        self._runs[spawn.run_id] = run
        track = Track(
            run_id=spawn.run_id,
            parent=spawn.parent,
            channel=spawn.channel,
            conversation=spawn.conversation,
            announce=announce,
        )
        self._tracks[spawn.run_id] = track
        with contextlib.suppress(pykka.ActorDeadError):  # a restarted announcer is told again
            self._announcer.tell(track)
        run.ref = self._start_run_actor(spawn, work)
        return RunHandle(spawn.run_id, spawn.parent, self.store, run.ended, lambda: run.ref)

    def _start_run_actor(self, spawn: Spawn, work: Work) -> pykka.ActorRef[Any]:
        assert self._scheduler is not None
        assert self._portal is not None
        return SubAgentActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            spawn=spawn,
            work=work,
            parent=self._announcer_ref,
            settings=self.config.subagents,
            on_crash=partial(self._run_crashed, spawn.run_id),
        )

    def _start_subsession(self, run_id: str, agent: str) -> pykka.ActorRef[Any]:
        """The Agent of a model-driven run: on the run's stream, its answer kept off every
        user-facing channel (the run's result is what the parent gets)."""
        with self._lock:
            self._require_running()
            sink = MemoryChannel(f"subagent:{run_id}")
            handle = self._start_agent(
                run_id, agent, sink.name, None, None, supervised=False, target=sink
            )
            return handle.ref

    def _run_ended(self, ended: RunEnded) -> None:
        """The announcer's callback: resolve the run's handle and stop its actor."""
        with self._lock:
            run = self._runs.pop(ended.run_id, None)
            self._tracks.pop(ended.run_id, None)
        if run is None:
            return
        if not run.ended.done():
            run.ended.set_result(ended)
        if run.ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                run.ref.stop(block=False)

    def _respawn(self, spawn: Spawn) -> object:
        """The supervisor's recovery spawner: the next attempt, with the continuation
        context in its task, runs the same ``work`` (or is model-driven again)."""
        with self._lock:
            if self._state != "running":
                return None
            work, agent = None, self._agent_of(spawn.parent)
            for (parent, task), known in self._works.items():
                if parent == spawn.parent and (
                    spawn.task == task or spawn.task.startswith(task + "\n\n")
                ):
                    work, agent = known
            self._works[(spawn.parent, spawn.task)] = (work, agent)
            return self._start_run(spawn, work, agent, announce=True)

    def _splitter_of(self, parent: str, task: str) -> Splitter | None:
        """The supervisor's lookup: the splitter of the lineage a run of ``parent`` with
        ``task`` (maybe a later attempt's, the continuation context after it) belongs to.
        It calls the host's splitter with the lineage's task and registers the subtasks as
        model-driven lineages of the lineage's agent."""
        with self._lock:
            for (known_parent, known_task), splitter in self._splitters.items():
                if known_parent == parent and (
                    task == known_task or task.startswith(known_task + "\n\n")
                ):
                    return partial(self._split, parent, known_task, splitter)
        return None

    def _split(
        self, parent: str, lineage_task: str, splitter: Splitter, task: str, context: str
    ) -> Sequence[str]:
        subtasks = splitter(lineage_task, context)
        with self._lock:
            _, agent = self._works.get((parent, lineage_task), (None, self._agent_of(parent)))
            for subtask in [subtasks] if isinstance(subtasks, str) else subtasks:
                self._works[(parent, str(subtask).strip())] = (None, agent)
        return subtasks

    def _agent_of(self, parent_session: str) -> str:
        """The agent a model-driven run of ``parent_session`` uses when nothing says which
        (a run another process started): the parent's, else ``default``, else the first."""
        parent = self._sessions.get(parent_session)
        if parent is not None:
            return parent.agent
        agents = self.config.agents
        return "default" if "default" in agents or not agents else sorted(agents)[0]

    def run(self, run_id: str) -> RunHandle | None:
        """The handle of a run still running (a respawned one included), or None."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            return RunHandle(run_id, run.spawn.parent, self.store, run.ended, lambda: run.ref)

    def runs(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, RunWatch]:
        """Every run the supervisor folded (asked: what it decided before is in it)."""
        with self._lock:
            self._require_running()
            supervisor = self._supervisor
        assert supervisor is not None
        runs = supervisor.ask(GetRuns(), timeout=timeout)
        assert isinstance(runs, dict)
        return runs

    def announcements(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, Batch]:
        """The completion batches not sent yet, by parent session (asked of the announcer)."""
        with self._lock:
            self._require_running()
            announcer = self._announcer
        assert announcer is not None
        batches = announcer.ask(GetBatches(), timeout=timeout)
        assert isinstance(batches, dict)
        return batches

    # -- restarts (the supervisor decides; these start the actor again) ----------------------

    def _agent_crashed(self, session_id: str, reason: str) -> None:
        """A session's Agent died of an exception (its thread): tell the supervisor."""
        handle = self._sessions.get(session_id)
        crashed = Crashed(
            actor=f"session:{session_id}",
            reason=reason,
            restart=partial(self._restart_session, session_id),
            session=session_id,
            channel=handle.channel if handle is not None else "",
            conversation=handle.conversation if handle is not None else session_id,
        )
        self._tell_supervisor(crashed)
        if self._durable is not None:  # a wake it was running is retried with backoff
            self._durable.tell(WakeFailed(f"session:{session_id}", "agent_crashed"))

    def _restart_session(self, session_id: str) -> None:
        """Start the session's Agent again (it rebuilds from its stream)."""
        with self._lock:
            handle = self._sessions.get(session_id)
            if self._state != "running" or handle is None or handle.ref.is_alive():
                return
            fresh = self._start_agent(
                session_id, handle.agent, handle.channel, handle.conversation, handle.thread
            )
            handle.ref = fresh.ref
        log.info("runtime.session_restarted", session=session_id)

    def _run_crashed(self, run_id: str, reason: str) -> None:
        run = self._runs.get(run_id)
        if run is None:
            return
        crashed = Crashed(
            actor=f"session:{run_id}",
            reason=reason,
            restart=partial(self._restart_run, run_id),
            session=run.spawn.parent,
            channel=run.spawn.channel,
            conversation=run.spawn.conversation,
        )
        self._tell_supervisor(crashed)

    def _restart_run(self, run_id: str) -> None:
        """Start the run's actor again: it re-arms the watchdog of a run still running and
        does not run the work again (the recovery protocol decides that)."""
        with self._lock:
            run = self._runs.get(run_id)
            if self._state != "running" or run is None:
                return
            run.ref = self._start_run_actor(run.spawn, _no_work)

    def _part_crashed(self, part: str, restart: Callable[[], object], reason: str) -> None:
        """An infrastructure actor died of an exception (its ``on_failure``, its thread):
        the same decision as for a session (one_for_one, intensity, backoff), taken here
        since the supervisor may be the one that died; a give-up is appended and logged
        at ERROR only (no single session to notify)."""
        restarts = self._restarts
        if restarts is None or self._state != "running":
            return
        crashed = Crashed(actor=part, reason=reason, restart=restart, notify=False)
        with self._restarts_lock:
            restarts.crashed(crashed)

    def _restart_part(self, part: str, start: Callable[[], None]) -> None:
        with self._lock:
            if self._state != "running":
                return
            start()
        log.info("runtime.part_restarted", part=part)

    def _restart_dead_letters(self) -> None:
        """Start the dead-letter actor again (it rebuilds its queue from its stream); the
        agents, the supervisor and the announcer hold a :class:`LiveRef` to it."""

        def start() -> None:
            self._dead_letters = self._start_dead_letters()

        self._restart_part("deadletter", start)

    def _restart_health(self, provider: str) -> None:
        """Start a provider's health actor again (it folds ``provider:<name>`` again)."""

        def start() -> None:
            self._health[provider] = self._start_health(provider)

        self._restart_part(f"health:{provider}", start)

    def _restart_supervisor(self) -> None:
        """Start the supervisor again (it sweeps what the log says at once)."""

        def start() -> None:
            self._supervisor = self._start_supervisor()

        self._restart_part("supervisor", start)

    def _restart_announcer(self) -> None:
        """Start the announcer again and tell it the runs still tracked (before the runs
        can reach it through their :class:`LiveRef`); batches not sent yet are lost."""

        def start() -> None:
            announcer = self._start_announcer()
            for track in self._tracks.values():
                announcer.tell(track)
            self._announcer = announcer

        self._restart_part("announcer", start)

    def _tell_supervisor(self, message: object) -> None:
        supervisor = self._supervisor
        if supervisor is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                supervisor.tell(message)

    def _spawn_tool(self, session_id: str, agent: str) -> Tool:
        """The ``spawn_subagent`` tool of one session (see :func:`spawn_tool_fn`)."""
        fn = spawn_tool_fn(self, session_id, agent)
        timeout_ms = self.config.subagents.custom_max_ms + 60_000  # the run's own limit rules
        return build_tool(fn, name=SPAWN_TOOL, timeout_ms=timeout_ms)

    def health(self, timeout: float = STOP_TIMEOUT_S) -> dict[str, HealthReport]:
        """Each provider's health as its actor has folded it (asked, so a decision already
        in the log is in the answer; the same reports are in :attr:`health_view`)."""
        with self._lock:
            self._require_running()
            actors = dict(self._health)
        reports: dict[str, HealthReport] = {}
        for provider, ref in actors.items():
            report = ref.ask(GetHealth(), timeout=timeout)
            assert isinstance(report, HealthReport)
            reports[provider] = report
        return reports

    def dead_letters(self, timeout: float = STOP_TIMEOUT_S) -> DeadLetterState:
        """The dead-letter queue as its actor has folded it."""
        with self._lock:
            self._require_running()
            dead_letters = self._dead_letters
        assert dead_letters is not None
        state = dead_letters.ask(QueueState(), timeout=timeout)
        assert isinstance(state, DeadLetterState)
        return state

    def _require_running(self) -> None:
        if self._state != "running":
            raise RuntimeError(f"the runtime is {self._state}: use start() or a with block")

    def _on_health_changed(self, changed: HealthChanged) -> None:
        """A health listener (the health actor's thread): a recovery drains the queue."""
        dead_letters = self._dead_letters
        if changed.status == "healthy" and dead_letters is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                dead_letters.tell(Drain(changed.provider))

    def __repr__(self) -> str:
        return f"Runtime({self._state}, sessions={len(self._sessions)})"


def _stop_actors(refs: Sequence[pykka.ActorRef[Any] | None]) -> None:
    """Stop all at once, then wait for each within the stop bound."""
    futures = [ref.stop(block=False) for ref in refs if ref is not None]
    for future in futures:
        try:
            future.get(timeout=STOP_TIMEOUT_S)
        except pykka.Timeout:
            log.warning("runtime.actor_stop_timeout", timeout_s=STOP_TIMEOUT_S)
        except pykka.ActorDeadError:
            pass


def _stop_runs(runs: Sequence[RunSpec]) -> None:
    """Stop the runs' actors; a handle still waiting learns the run will not end here."""
    for run in runs:
        run.ended.cancel()
    _stop_actors([run.ref for run in runs])


async def _no_work(report: RunReport) -> str:
    """A restarted run's work: never run (the actor resumes the run, not the work)."""
    raise RuntimeError("a restarted run does not run its work again")
