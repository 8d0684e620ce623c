"""A runtime's sessions: one Agent per session, started on demand, restarted after a
crash, started again by a wake after a takeover or a passivation; the durable worker
they run their wakes under (see ``_durable``), and what a host does to a session (a
message, a confirmation, a tool result, an interrupt, a delayed wake)."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    RESEND_GRACE_S,
    RESEND_WITHIN_S,
    AgentActor,
    AgentLoopSettings,
    AgentReport,
    Crashed,
    HealthView,
    LeaseLost,
    Nudge,
    SendsPending,
    TimerHandle,
    WakeFailed,
    WorkerReport,
    left_unsaid,
)
from stalwart.channels import Channel, channel_named
from stalwart.clock import SystemClock
from stalwart.config import AgentSettings
from stalwart.errors import (
    ConcurrencyError,
    ConfigError,
    CorruptRecordError,
    SessionActionError,
    SessionsStoppedError,
    StalwartError,
)
from stalwart.events import SessionCreated
from stalwart.store import NO_STREAM, NewEvent
from stalwart.tools import Tool, ToolRegistry

from ._context import ContextLayer
from ._control import (
    check_session_id,
    confirm,
    interrupt,
    load_session,
    schedule_wake,
    send_message,
    submit_tool_result,
)
from ._durable import Durability
from ._handles import DEFAULT_CHANNEL, STOP_TIMEOUT_S, SessionHandle
from ._layer import ProviderLayer
from ._tools import SessionTools
from ._wiring import Wiring, stop_actors
from ._workspace import Committer, draft_tools

__all__ = ["SessionLayer"]

log = get_logger(__name__)

#: real time: how often a closing runtime looks again at the sends still in flight
CLOSE_POLL_S = 0.02
_REAL_TIME = SystemClock()
#: How often (seconds on the runtime's Clock) a durable runtime looks again for sessions
#: whose reply a stopped or hung worker of the same log left unsent (``_resend_cut_short``).
RESEND_SWEEP_S = 10.0
#: the parts without which no session's work runs here (name -> what a message calls it)
_ESSENTIAL = {"activations": "activation worker", "context": "context engine"}
#: real time: how often the watch makes sure its runtime still runs when no pass is due
#: (a runtime closes through ``pause_worker``, which wakes it at once; this is a backstop)
_WATCH_BACKSTOP_S = 60.0


class SessionLayer:
    """Starts (and restarts) the sessions' Agents; owns the durable worker.

    ``spawn_tool(session_id, agent)`` is the ``spawn_subagent`` tool of a session whose
    agent has ``subagents = true``; ``tell_supervisor`` reports a crashed Agent."""

    def __init__(
        self,
        wiring: Wiring,
        layer: ProviderLayer,
        *,
        tools: ToolRegistry,
        health_view: HealthView,
        committer: Committer | None,
        dead_letters: pykka.ActorRef[Any],
        tell_supervisor: Callable[[object], None],
        spawn_tool: Callable[[str, str], Tool],
    ) -> None:
        self._w = wiring
        self._layer = layer
        self._tools = tools
        self._health_view = health_view
        self._committer = committer
        self._dead_letters = dead_letters
        self._tell_supervisor = tell_supervisor
        self._spawn_tool = spawn_tool
        self._handles: dict[str, SessionHandle] = {}  # the sessions whose Agent is up
        self._resend_stop = threading.Event()  # set as the runtime closes
        self._resend_due = threading.Event()  # set by the watch's timer, and as it closes
        self._resend_lock = threading.Lock()
        self._resend_watch: threading.Thread | None = None
        self._resend_timer: TimerHandle | None = None
        # passivated (stopped while idle, started again on demand): kept only while the
        # host holds the handle, so a weeks-long process keeps nothing per session it has
        # ever served; one the host let go of starts again from its log, as after a restart
        self._asleep: weakref.WeakValueDictionary[str, SessionHandle] = (
            weakref.WeakValueDictionary()
        )
        self._context: ContextLayer | None = None
        self._durable: Durability | None = None
        #: counts a tell the activation worker refused once it was given up on (None: it
        #: was not), for ``rt.given_up()``
        self._worker_refused: Callable[[object], None] | None = None

    def start(
        self,
        context: ContextLayer | None,
        *,
        on_worker_crash: Callable[[Callable[[], None], str], object] | None = None,
        given_up: Callable[[str], bool] = lambda _part: False,
    ) -> None:
        """Start the activation worker (the context engine, when there is one, is up);
        ``on_worker_crash(restart, reason)`` hears of a worker that died, ``given_up(part)``
        says whether supervision gave up on a part (``activations``, ``context``)."""
        self._context = context
        self._given_up = given_up
        self._durable = Durability(
            self._w.store,
            self._w.clock,
            self._w.scheduler,
            self._w.config.activations,
            agent_for=self.agent_for_wake,
            passivate=self.passivate,
            stopping=lambda: not self._w.running(),
            on_crash=on_worker_crash,
            given_up=partial(given_up, "activations"),
        )
        if self._stopped_by() == "context":  # given up on while the worker was not up yet
            self._durable.stop_leasing()
        threading.Thread(target=self._resend_cut_short, name="stalwart-resend", daemon=True).start()

    def _resend_cut_short(self) -> None:
        """Start the Agent of every session whose reply or notice a close or a crash cut
        short mid-send, or whose given-up message nobody told the user about
        (:func:`~stalwart.actors.left_unsaid`): the Agent says it as it starts (a send
        young enough to be still under way elsewhere once its sender's timeout is past).
        Without this, a session with no work due would never start again, and its user
        would never hear.

        Runs beside the worker: once over every recent session as it starts (what the
        last runtime left; this thread, ``stalwart-resend``, then ends), and then, in
        ``stalwart-resend-watch``, every :data:`RESEND_SWEEP_S` on the runtime's Clock
        (a scheduler timer: a test moves it with ``FakeClock.advance``) over the
        sessions whose log moved since it last looked and has been quiet for a send's
        timeout and grace: a worker of the same log that stopped or hung mid-send
        (frozen, partitioned, killed and not restarted) leaves a settled session nobody
        would start again."""
        looked = self._sweep_logged({}, None)
        if looked is None:
            return
        with self._resend_lock:
            if self._resend_stop.is_set() or not self._w.running():
                return
            watch = partial(self._watch_cut_short, looked)
            self._resend_watch = threading.Thread(
                target=watch, name="stalwart-resend-watch", daemon=True
            )
            self._resend_watch.start()
            self._arm_watch()

    def _arm_watch(self) -> None:
        """The watch's next pass, :data:`RESEND_SWEEP_S` from now (under the lock)."""
        if not self._resend_stop.is_set():
            at = self._w.clock.now() + RESEND_SWEEP_S
            self._resend_timer = self._w.scheduler.schedule(at, self._watch_due)

    def _watch_due(self, _fired_at: float) -> None:
        self._resend_due.set()  # the scheduler's thread (or the test's advance) only wakes it

    def _watch_cut_short(self, looked: dict[str, float]) -> None:
        """The passes after the first, each when the timer :meth:`_arm_watch` set fires,
        while the runtime runs."""
        quiet_s = self._w.config.dead_letters.announce_timeout_ms / 1000 + RESEND_GRACE_S
        while True:
            due = self._resend_due.wait(_WATCH_BACKSTOP_S)
            if self._resend_stop.is_set() or not self._w.running():
                return
            if not due:
                continue
            self._resend_due.clear()
            found = self._sweep_logged(looked, quiet_s)
            if found is None:
                return  # the runtime closed under the pass
            looked = found
            with self._resend_lock:
                self._arm_watch()
            log.debug("runtime.resend_watch_passed", sessions=len(looked))  # and the next armed

    def _sweep_logged(
        self, looked: dict[str, float], quiet_s: float | None
    ) -> dict[str, float] | None:
        """A pass, its failure logged (what it looked at; ``looked`` again after a
        failure, None once the runtime has closed)."""
        try:
            return self._sweep(looked, quiet_s)
        except StalwartError as exc:  # a closed store, an unreadable streams index
            if not self._w.running():
                return None
            log.warning("runtime.resend_sweep_failed", error_class=type(exc).__name__)
        except Exception:  # a bug: logged (a background thread has nobody to raise to)
            log.exception("runtime.resend_sweep_failed")
        return looked

    def _sweep(self, looked: dict[str, float], quiet_s: float | None) -> dict[str, float]:
        """One pass; ``quiet_s`` None looks at every session of the last hour, else only
        at those whose log moved since ``looked`` and has been quiet that long. What it
        looked at, for the next pass."""
        now = self._w.clock.now()
        seen: dict[str, float] = {}
        for info in self._w.store.streams():
            stream, last_ts = info.stream, info.last_ts
            if not stream.startswith("session:") or now - last_ts > RESEND_WITHIN_S:
                continue
            if quiet_s is not None and (looked.get(stream) == last_ts or now - last_ts < quiet_s):
                if stream in looked:
                    seen[stream] = looked[stream]
                continue
            if not self._w.running():
                break
            seen[stream] = last_ts
            session_id = stream.removeprefix("session:")
            try:
                if self.get(session_id) is not None or not left_unsaid(self._w.store, stream, now):
                    continue
                log.info("runtime.resend_cut_short", session=session_id)
                self.agent_for_wake(session_id, True)
            except StalwartError as exc:  # a damaged stream: the others still go
                log.warning(
                    "runtime.resend_failed", session=session_id, error_class=type(exc).__name__
                )
        return seen

    def let_sends_end(self, handles: list[SessionHandle]) -> None:
        """Give the Agents' sends in flight up to ``dead_letters.close_grace_ms`` to end,
        so their outcomes are in the log before the Agents stop (the runtime closes). One
        cut short is sent again by the next runtime."""
        grace_s = self._w.config.dead_letters.close_grace_ms / 1000
        clock = _REAL_TIME  # the sends are real I/O: a fake clock does not move meanwhile
        give_up = clock.monotonic() + grace_s
        waiting = [handle.ref for handle in handles] if grace_s > 0 else []
        while waiting:
            asked = [(ref, ref.ask(SendsPending(), block=False)) for ref in waiting]
            waiting = []
            for ref, answer in asked:
                try:
                    if answer.get(timeout=max(0.0, give_up - clock.monotonic())):
                        waiting.append(ref)
                except pykka.Timeout:  # too busy to say: counted as still sending
                    waiting.append(ref)
                except pykka.ActorDeadError:
                    pass
            if not waiting or clock.monotonic() >= give_up:
                break
            time.sleep(CLOSE_POLL_S)
        if waiting:
            log.warning("runtime.sends_cut_short", sessions=len(waiting), grace_s=grace_s)

    def pause_worker(self) -> None:
        """No new leases (the process stops); the running wakes keep theirs. The watch
        for replies left unsent ends."""
        with self._resend_lock:
            self._resend_stop.set()
            self._resend_due.set()
            watch, timer = self._resend_watch, self._resend_timer
        if timer is not None:
            timer.cancel()
        if watch is not None and watch is not threading.current_thread():
            watch.join(timeout=STOP_TIMEOUT_S)
        if self._durable is not None:
            self._durable.closing()

    def stop_worker(self) -> None:
        """Hand back the leases of the wakes still running (their Agents are stopped) and
        stop the worker."""
        if self._durable is not None:
            self._durable.stop()

    def take(self) -> list[SessionHandle]:
        """Every session's handle, forgotten (the runtime closes; under its lock)."""
        handles = list(self._handles.values())
        self._handles.clear()
        self._asleep.clear()
        return handles

    def get(self, session_id: str) -> SessionHandle | None:
        handle = self._handles.get(session_id)
        return self._asleep.get(session_id) if handle is None else handle

    def count(self) -> int:
        return len(self._handles) + len(self._asleep)

    def address(self, session_id: str) -> tuple[str, str, str, str | None] | None:
        """The session's agent, channel, conversation and thread: its handle's, else what
        its ``session:created`` recorded (a session this runtime holds no handle for:
        started before a restart, or passivated and let go of); None for a session the
        log does not hold."""
        handle = self.get(session_id)
        if handle is not None:
            return handle.agent, handle.channel, handle.conversation, handle.thread
        created = self._created(session_id)
        if created is None:
            return None
        agent, channel = self._recorded(session_id, created.agent, created.channel)
        conversation = session_id if created.conversation is None else created.conversation
        return agent, channel, conversation, created.thread

    # -- Agents --------------------------------------------------------------------------------

    def session(
        self,
        session_id: str,
        agent: str,
        channel: str,
        conversation: str | None,
        thread: str | None,
    ) -> SessionHandle:
        """See :meth:`Runtime.session` (under the runtime's lock, while it runs)."""
        check_session_id(session_id)
        running = self.get(session_id)
        if running is not None:
            if session_id in self._asleep and not running.ref.is_alive():
                self._start_again(session_id, running)  # the same session, woken up
            return running
        created = self._created(session_id)
        return self._begin(session_id, created, agent, channel, conversation, thread)

    def _begin(
        self,
        session_id: str,
        created: SessionCreated | None,
        agent: str,
        channel: str,
        conversation: str | None,
        thread: str | None,
    ) -> SessionHandle:
        """A handle for a session this runtime holds none for. One that ran before (a
        passivated one its host let go of, or another process's) runs with what its
        ``created`` recorded, as a wake's does; a new one with the arguments."""
        if created is not None:  # the call's agent and channel stand in for gone ones
            recorded = self._recorded(session_id, created.agent, created.channel, (agent, channel))
            agent, channel = recorded
            conversation, thread = created.conversation, created.thread
        handle = self.start_agent(session_id, agent, channel, conversation, thread)
        self._handles[session_id] = handle
        return handle

    def start_agent(
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
        """The session's Agent; an unsupervised one (a run's) has no durable worker, no
        context engine, no own tools, no restarts and no dead-letter queue."""
        settings = self._w.config.agent(agent)
        target = target or self._target(channel)
        durable = self._durable if supervised else None
        if durable is not None:  # the session exists when session() returns
            self._record_created(session_id, agent, channel, conversation, thread)
            durable.started(session_id)  # passivated once idle, like any Agent
        context = self._context if supervised else None
        tools = self._own_tools(session_id, agent, settings, durable, context, supervised)
        ref = AgentActor.start(
            session_id,
            self._w.store,
            self._w.clock,
            self._w.scheduler,
            self._w.portal,
            self._layer.caller(
                agent,
                skip=self._health_view.is_degraded,
                timer=self._w.timer,
            ),
            tools,
            target,
            conversation=conversation,
            thread=thread,
            settings=self._loop_settings(settings),
            is_degraded=self._health_view.is_degraded,
            # a run's answer reaches its parent as the run's result: a failed private send
            # has nothing for the queue to retry, on a channel no operator configured
            dead_letters=self._dead_letters if supervised else None,
            agent_name=agent,
            on_crash=partial(self.agent_crashed, session_id) if supervised else None,
            policy=durable.policy if durable is not None else None,
            worker=self._tell_worker if durable is not None else None,
            jitter_ms=durable.jitter_ms if durable is not None else None,
            hold=self._layer.sink.hold if durable is not None else None,
            context=context.gate if context is not None else None,
            profile=context.profile(agent) if context is not None else None,
            channel_name=channel,
        )
        post = partial(self.post, session_id) if durable is not None else None
        revive = partial(self._revive, session_id) if durable is not None else None
        folded = partial(self._folded, session_id) if durable is not None else None
        return SessionHandle(
            session_id,
            ref,
            agent=agent,
            channel=channel,
            conversation=conversation,
            thread=thread,
            post=post,
            revive=revive,
            folded=folded,
        )

    def _target(self, channel: str) -> Channel:
        target = self._w.channels.get(channel)
        if target is None:
            available = sorted(self._w.channels) or "none"
            raise ConfigError(
                f"no channel named {channel!r} (available: {available})",
                key=f"channels.{channel}",
            )
        return target

    def _loop_settings(self, settings: AgentSettings) -> AgentLoopSettings:
        config = self._w.config
        return AgentLoopSettings(
            max_steps=settings.max_steps,
            tool_limit=settings.tool_limit,
            execution_timeout_ms=config.supervision.execution_timeout_ms,
            send_timeout_ms=config.dead_letters.announce_timeout_ms,
            system_prompt=settings.system_prompt,
            context_window=settings.context_window,
        )

    def _record_created(
        self,
        session_id: str,
        agent: str,
        channel: str,
        conversation: str | None,
        thread: str | None,
    ) -> None:
        created = SessionCreated(
            agent=agent, channel=channel, conversation=conversation, thread=thread
        )
        with contextlib.suppress(ConcurrencyError):
            self._w.store.append(
                f"session:{session_id}",
                [NewEvent(event=created, ts=self._w.clock.now())],
                expected_version=NO_STREAM,
            )

    def _own_tools(
        self,
        session_id: str,
        agent: str,
        settings: AgentSettings,
        durable: Durability | None,
        context: ContextLayer | None,
        supervised: bool,
    ) -> ToolRegistry:
        """The runtime's registry, plus the session's built-ins when it has any."""
        own: list[Tool] = []
        if settings.subagents and supervised:
            own.append(self._spawn_tool(session_id, agent))
        if durable is not None and self._committer is not None:
            own.extend(
                draft_tools(
                    self._w.store,
                    self._layer.sink,
                    self._w.clock,
                    session_id,
                    self._committer,
                    max_bytes=self._w.config.activations.max_draft_bytes,
                )
            )
        if context is not None:
            own.extend(context.tools(session_id, None))
        return SessionTools(self._tools, *own) if own else self._tools

    def _start_again(self, session_id: str, handle: SessionHandle) -> pykka.ActorRef[Any]:
        """A new Agent behind the host's handle (which stays valid)."""
        fresh = self.start_agent(
            session_id, handle.agent, handle.channel, handle.conversation, handle.thread
        )
        handle.ref = fresh.ref
        self._asleep.pop(session_id, None)
        self._handles[session_id] = handle
        return handle.ref

    def _revive(self, session_id: str) -> pykka.ActorRef[Any] | None:
        """A passivated session's Agent, started again for its handle (None when the
        runtime is closed, or the Agent is down for another reason: a crash in its
        restart's backoff, or one supervision gave up on). An Agent the sweep is still
        stopping is waited for first."""
        with self._w.lock:
            handle = self.get(session_id)
            if not self._w.running() or handle is None:
                return None
            if session_id not in self._asleep:
                return handle.ref if handle.ref.is_alive() else None
            stopping = handle.ref
        stopping.actor_stopped.wait(STOP_TIMEOUT_S)
        with self._w.lock:
            handle = self.get(session_id)
            if not self._w.running() or handle is None:
                return None
            if handle.ref.is_alive():  # started again meanwhile (a wake)
                return handle.ref
            if session_id not in self._asleep:
                return None
            return self._start_again(session_id, handle)

    def _folded(self, session_id: str) -> AgentReport | None:
        """The session's report from the log, for a handle whose Agent is down and not
        passivated (None once the runtime is closed)."""
        if not self._w.running():
            return None
        session, activations = load_session(self._w.store, session_id)
        return AgentReport(session=session, queued=activations.backlog)

    # -- crashes, wakes, passivation -----------------------------------------------------------

    def agent_crashed(self, session_id: str, reason: str) -> None:
        """A session's Agent died of an exception (its thread): tell the supervisor."""
        handle = self.get(session_id)
        crashed = Crashed(
            actor=f"session:{session_id}",
            reason=reason,
            restart=partial(self._restart, session_id),
            session=session_id,
            channel=handle.channel if handle is not None else "",
            conversation=handle.conversation if handle is not None else session_id,
            thread=handle.thread if handle is not None else None,
        )
        self._tell_supervisor(crashed)
        # a wake it was running is retried with backoff
        self._tell_worker(WakeFailed(f"session:{session_id}", "agent_crashed"))

    def _restart(self, session_id: str) -> None:
        """Start the session's Agent again (it rebuilds from its stream)."""
        with self._w.lock:
            handle = self.get(session_id)
            if not self._w.running() or handle is None or handle.ref.is_alive():
                return
            self._start_again(session_id, handle)
        log.info("runtime.session_restarted", session=session_id)

    def agent_for_wake(self, session_id: str, start: bool) -> pykka.ActorRef[Any] | None:
        """The Agent a wake goes to: the running one, or one started from the session's
        recorded agent and channel (after a takeover or a passivation)."""
        with self._w.lock:
            if not self._w.running():
                return None
            handle = self.get(session_id)
            if handle is not None and handle.ref.is_alive():
                return handle.ref
            if not start:
                return None
            try:
                if handle is not None:  # passivated or crashed: the host's handle stays valid
                    return self._start_again(session_id, handle)
                check_session_id(session_id)
                created = self._created(session_id)
                agent, channel = "default", DEFAULT_CHANNEL  # _begin takes the recorded
                if created is None:  # none recorded (an old log): what its fold says
                    session, _ = load_session(self._w.store, session_id)
                    agent, channel = self._recorded(session_id, session.agent, session.channel)
                return self._begin(session_id, created, agent, channel, None, None).ref
            except ConfigError as exc:
                log.warning("runtime.wake_without_agent", session=session_id, key=exc.key)
            except SessionActionError:  # an id no session can have: no Agent can run it
                log.warning("runtime.wake_without_agent", session=session_id, key="session_id")
            return None

    def _recorded(
        self,
        session_id: str,
        agent: str,
        channel: str | None,
        instead: tuple[str, str] = ("default", DEFAULT_CHANNEL),
    ) -> tuple[str, str]:
        """The agent and channel a session recorded, or ``instead`` (a host's call: its
        own; a wake: the defaults) when this config has none of that name (an operator
        renamed or removed it), said in the log. An agent ``instead`` does not name
        either is the config's ``default``, else its first: a session whose agent is
        gone still runs in a config that has no ``default``."""
        agents = self._w.config.agents
        if agent not in agents:
            if agent:
                log.warning("runtime.agent_not_configured", session=session_id, agent=agent)
            agent = instead[0]
            if agent not in agents and agents:
                agent = "default" if "default" in agents else next(iter(agents))
        if channel is None:
            return agent, instead[1]
        # a log written before sessions recorded the channel's key may name the channel
        found = channel_named(self._w.channels, channel)
        if found is None:
            log.warning("runtime.channel_not_configured", session=session_id, channel=channel)
            return agent, instead[1]
        return agent, next(key for key, known in self._w.channels.items() if known is found)

    def _created(self, session_id: str) -> SessionCreated | None:
        """The session's ``session:created`` (None: a new session, none recorded, or one
        that cannot be read: the Agent's own start then fails, and is reported, as a
        crash)."""
        try:
            for record in self._w.store.read_stream(f"session:{session_id}", 1, 1):
                if isinstance(record.event, SessionCreated):
                    return record.event
        except CorruptRecordError:
            pass
        return None

    def passivate(self, session_id: str, ref: pykka.ActorRef[Any]) -> bool:
        """Stop the session's Agent ``ref``, which said it is idle. Its handle stays valid
        while the host holds it: the next wake, or ``handle.status()``, starts it again.
        The session is marked passivated before its Agent stops, so a host's ``status()``
        in between waits for the stop and starts a new one. False when another Agent
        runs the session now."""
        with self._w.lock:
            handle = self.get(session_id)
            if handle is None or not ref.is_alive():
                return True
            if handle.ref is not ref:
                return False
            self._handles.pop(session_id, None)
            self._asleep[session_id] = handle
        log.info("runtime.passivated", session=session_id)
        stop_actors([ref])
        return True

    # -- what a host does to a session (see Runtime) -------------------------------------------

    def post(self, session_id: str, text: str, message_id: str | None) -> None:
        """A user message, durable on return (``activation:ready``); the worker runs it."""
        if not self._w.running():
            raise RuntimeError(f"session {session_id!r} is stopped: its runtime was closed")
        send_message(self._w.store, session_id, text, message_id=message_id, ts=self._w.clock.now())
        self.nudge()
        self._worker_runs(session_id)

    def nudge(self) -> None:
        self._tell_worker(None)

    def _tell_worker(self, message: object | None) -> None:
        """Tell the durable worker ``message`` (None: a nudge), for the Agents and the
        host's calls. Once the worker was given up on, the tell is refused (the work is
        in the log) and counted where ``rt.given_up()`` reads it."""
        durable = self._durable
        if durable is None:
            return
        durable.tell(message)
        refused = self._worker_refused
        if refused is not None:
            refused(Nudge() if message is None else message)

    def part_given_up(self, part: str, refused: Callable[[object], None]) -> None:
        """Supervision gave up on ``part`` (under the restarts lock); ``refused(message)``
        counts a tell it refused. The activation worker's tells are counted from now on.
        Without the context engine no turn can be assembled: every wake leased here would
        fail until it is abandoned, so the worker leases nothing more and leaves the
        sessions' work to another worker on the store, or the next runtime."""
        if part == "activations":
            self._worker_refused = refused
        if part == "context" and self._durable is not None:
            self._durable.stop_leasing()
            log.error("runtime.sessions_stopped", part=part)

    def _stopped_by(self) -> str | None:
        """The part given up on that stops this runtime running sessions' work, if any."""
        if self._durable is None:
            return None
        for part in _ESSENTIAL:
            if (part != "context" or self._context is not None) and self._given_up(part):
                return part
        return None

    def _worker_runs(self, session_id: str) -> None:
        """After a session's work was recorded: SessionsStoppedError when supervision gave
        up on the activation worker or the context engine, so nothing in this runtime
        will run it (another worker on the store, or the next runtime, does)."""
        part = self._stopped_by()
        if part is None:
            return
        stream = f"session:{session_id.removeprefix('session:')}"
        log.error("runtime.work_not_run", session=stream, part=part)
        raise SessionsStoppedError(
            f"recorded for {stream!r}, but this runtime runs no session's work any more: "
            f"supervision gave up on its {_ESSENTIAL[part]} after repeated crashes "
            "(another worker on the store, or the next runtime, runs it)",
            part=part,
            session=stream,
        )

    def confirm(self, session_id: str, request_id: str, *, allow: bool) -> str:
        now = self._w.clock.now()
        resumed = confirm(self._w.store, session_id, request_id, allow=allow, ts=now)
        self.nudge()
        self._worker_runs(session_id)
        return resumed

    def submit_tool_result(self, session_id: str, request_id: str, output: str) -> str:
        now = self._w.clock.now()
        resumed = submit_tool_result(self._w.store, session_id, request_id, output, ts=now)
        self.nudge()
        self._worker_runs(session_id)
        return resumed

    def interrupt(self, session_id: str, reason: str) -> list[str]:
        cancelled = interrupt(self._w.store, session_id, reason, ts=self._w.clock.now())
        # the session's Agent, whether the host named the session or its stream
        bare = session_id.removeprefix("session:")
        ref = self.agent_for_wake(bare, False)
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(LeaseLost(f"session:{bare}", None))
        self.nudge()
        return cancelled

    def wake_at(self, session_id: str, at: float, text: str, dedupe_key: str | None) -> str:
        assert self._durable is not None
        activation_id = schedule_wake(
            self._w.store,
            session_id,
            at,
            now=self._w.clock.now(),
            policy=self._durable.policy,
            text=text,
            dedupe_key=dedupe_key,
            owner=self._durable.owner,
        )
        self.nudge()
        self._worker_runs(session_id)
        return activation_id

    def worker(self, timeout: float) -> WorkerReport:
        assert self._durable is not None
        return self._durable.report(timeout)
