"""The embedding API: :class:`Runtime` starts the configured parts on one event log.

::

    with Runtime(config, store=".stalwart") as rt:
        rt.tool(lookup_order)                    # or @rt.tool
        chat = rt.session("s1", channel="console")
        chat.send("Where is my order 1234?")
        chat.status(timeout=5.0)                 # an AgentReport

Starting opens the store (a path, or an :class:`EventStore` the host keeps), appends
``runtime:started`` with the config in force (``Config.to_record()``: no secrets), and
starts the I/O portal (one event loop thread for all network I/O), the scheduler (driven
by the clock: a ``FakeClock`` fires timers inside ``advance()``), one
``ProviderHealthActor`` per configured provider sharing one :class:`HealthView`, and the
``DeadLetterActor`` over the channels; a provider's recovery drains the dead-letter queue.
:meth:`Runtime.session` starts one ``AgentActor`` per session, on demand.

Closing stops the agents, the health and dead-letter actors, closes the provider clients
and the channels the runtime built (on the portal's loop), stops the scheduler and the
portal (whatever is still in flight is cancelled, which closes its HTTP request), appends
``runtime:stopped`` and closes the store if it opened it. A failure in one step is logged
and the next steps still run; a second ``close()`` does nothing.

:class:`ProviderLayer` and :class:`StoreSink` are the provider layer on a store, which
``stalwart run`` also uses on its own.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, overload

import anyio.to_thread
import pykka
import structlog

import stalwart
from stalwart import store as store_module
from stalwart.actors import (
    AgentActor,
    AgentLoopSettings,
    AgentReport,
    AgentStatus,
    DeadLetterActor,
    Drain,
    GetHealth,
    HealthChanged,
    HealthReport,
    HealthView,
    IoPortal,
    ProviderHealthActor,
    QueueState,
    Scheduler,
    UserMessage,
)
from stalwart.channels import Channel, ConsoleChannel, channel_from_settings
from stalwart.clock import Clock, SystemClock
from stalwart.config import Config
from stalwart.errors import ConfigError
from stalwart.events import Event, RecordedEvent, RuntimeStarted, RuntimeStopped
from stalwart.ids import new_id
from stalwart.providers import Breaker, ModelCaller, ProviderClient
from stalwart.state import BREAKER, DeadLetterState
from stalwart.store import EventStore, NewEvent, load_state
from stalwart.tools import ToolRegistry

__all__ = [
    "RUNTIME_STREAM",
    "STOP_TIMEOUT_S",
    "ProviderLayer",
    "Runtime",
    "SessionHandle",
    "StoreSink",
]

log = structlog.get_logger(__name__)

#: The stream ``runtime:started`` / ``runtime:stopped`` go to.
RUNTIME_STREAM = "runtime"
#: How long ``close()`` waits for each part (an actor, the clients, a thread) to stop.
STOP_TIMEOUT_S = 5.0
#: The channel every runtime has when the config names none.
DEFAULT_CHANNEL = "console"

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class StoreSink:
    """Appends to an EventStore from a worker thread (an append waits for its fsync)."""

    def __init__(self, store: EventStore) -> None:
        self._store = store

    async def emit(self, stream: str, events: Sequence[Event], ts: float) -> list[RecordedEvent]:
        if not events:
            return []
        news = [NewEvent(event=event, ts=ts) for event in events]
        return await anyio.to_thread.run_sync(self._store.append, stream, news)


class ProviderLayer:
    """Every configured provider's client and breaker, over one store."""

    def __init__(
        self,
        config: Config,
        store: EventStore,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.sink = StoreSink(store)
        self._rng = rng
        self.clients = {
            name: ProviderClient(name, settings, clock=self.clock)
            for name, settings in config.providers.items()
        }
        self.breakers = {
            name: Breaker(settings, load_state(store, f"provider:{name}", BREAKER))
            for name, settings in config.providers.items()
        }

    def caller(self, agent: str = "default") -> ModelCaller:
        """The caller for a configured agent."""
        return ModelCaller(
            self.config.agent(agent),
            self.clients,
            self.breakers,
            self.sink,
            self.clock,
            agent_name=agent,
            rng=self._rng,
        )

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


class SessionHandle:
    """One running session: tell it user messages, ask it for its report."""

    def __init__(
        self, session_id: str, ref: pykka.ActorRef[Any], *, agent: str, channel: str
    ) -> None:
        self.session_id = session_id
        self.agent = agent
        self.channel = channel
        self.ref = ref

    @property
    def stream(self) -> str:
        return f"session:{self.session_id}"

    def send(self, text: str, *, message_id: str | None = None) -> None:
        """Tell the agent a user message (it starts a turn, or waits for the running one).

        RuntimeError once the session's agent has stopped (the runtime was closed)."""
        try:
            self.ref.tell(UserMessage(text, message_id))
        except pykka.ActorDeadError:
            raise self._stopped() from None

    def status(self, timeout: float = STOP_TIMEOUT_S) -> AgentReport:
        """The agent's :class:`AgentReport` (``idle``, ``queued``, ``step``, the session)."""
        try:
            report = self.ref.ask(AgentStatus(), timeout=timeout)
        except pykka.ActorDeadError:
            raise self._stopped() from None
        assert isinstance(report, AgentReport)
        return report

    def _stopped(self) -> RuntimeError:
        return RuntimeError(f"session {self.session_id!r} is stopped: its runtime was closed")

    def __repr__(self) -> str:
        return f"SessionHandle({self.session_id!r}, agent={self.agent!r}, channel={self.channel!r})"


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
    ) -> None:
        self.config = config
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
        self._dead_letters = DeadLetterActor.start(
            store=self._store,
            clock=self.clock,
            scheduler=self._scheduler,
            portal=self._portal,
            channels=self._channels,
            settings=self.config.dead_letters,
        )
        for provider in self.config.providers:
            self._health[provider] = ProviderHealthActor.start(
                self._store,
                self.clock,
                self._scheduler,
                provider,
                self.config.health,
                [self._on_health_changed],
                self.health_view,
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
        steps: list[tuple[str, Callable[[], object]]] = [
            ("agents", lambda: _stop_actors([s.ref for s in sessions])),
            ("health", lambda: _stop_actors(list(self._health.values()))),
            ("dead_letters", lambda: _stop_actors([self._dead_letters])),
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
    ) -> SessionHandle:
        settings = self.config.agent(agent)
        target = self._channels.get(channel)
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
        )
        ref = AgentActor.start(
            session_id,
            self.store,
            self.clock,
            self._scheduler,
            self._portal,
            self._layer.caller(agent),
            self.tools,
            target,
            conversation=conversation,
            thread=thread,
            settings=loop,
            is_degraded=self.health_view.is_degraded,
            dead_letters=self._dead_letters,
            agent_name=agent,
        )
        return SessionHandle(session_id, ref, agent=agent, channel=channel)

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
