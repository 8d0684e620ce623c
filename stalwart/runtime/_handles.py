"""What a host holds: a running session's handle and a sub-agent run's handle."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    AgentReport,
    AgentStatus,
    GetRun,
    RunEnded,
    Spawn,
    UserMessage,
    Work,
)
from stalwart.clock import SystemClock
from stalwart.errors import SessionActionError
from stalwart.state import RUN, RunState
from stalwart.store import EventStore, load_state

__all__ = [
    "DEFAULT_CHANNEL",
    "RUNTIME_STREAM",
    "STOP_TIMEOUT_S",
    "LiveRef",
    "RunHandle",
    "RunSpec",
    "SessionHandle",
    "ask",
    "ask_part",
]

log = get_logger(__name__)

#: The stream ``runtime:started`` / ``runtime:stopped`` go to.
RUNTIME_STREAM = "runtime"
#: How long ``close()`` waits for each part (an actor, the clients, a thread) to stop.
STOP_TIMEOUT_S = 5.0
#: The channel every runtime has when the config names none.
DEFAULT_CHANNEL = "console"


def ask(ref: pykka.ActorRef[Any], message: object, timeout: float, part: str) -> Any:
    """``ref.ask(message)`` for a host's call: TimeoutError (naming ``part`` and the
    timeout) when no answer came within ``timeout`` seconds, never pykka's own Timeout."""
    return answer_of(ref.ask(message, block=False), timeout, part, timeout)


def answer_of(future: pykka.Future[Any], wait: float, part: str, timeout: float) -> Any:
    """The answer of an ask already made (``future``), waited for ``wait`` seconds: the
    TimeoutError of :func:`ask` (naming ``part`` and the host's ``timeout``, not what
    was left of it) when none came."""
    try:
        return future.get(timeout=max(wait, 0.0))
    except pykka.Timeout:
        raise TimeoutError(f"the {part} did not answer within {timeout:g} s") from None


#: How often :func:`ask_part` looks again for a part that is down (real seconds).
PART_POLL_S = 0.01
#: a wait's real time (a fake clock cannot bound a thread's wait)
_WAITS = SystemClock()


def monotonic() -> float:
    """The real time the host's calls' deadlines are on (see :func:`ask_part`)."""
    return _WAITS.monotonic()


def ask_part(
    current: Callable[[], pykka.ActorRef[Any] | None],
    message: object,
    timeout: float,
    part: str,
    given_up: Callable[[], bool] = lambda: False,
    *,
    asked: pykka.Future[Any] | None = None,
    deadline: float | None = None,
) -> Any:
    """:func:`ask` for a host's call to a part the runtime restarts (``current()`` is
    its actor now, None before it starts): while the part is down (between a crash and
    its restart, which the supervision backoff puts at most a second away) it is asked
    again once it runs, within ``timeout`` in all. A part still down then is a
    TimeoutError naming it, as a part that did not answer; one down that supervision
    gave up on (``given_up()``) is that TimeoutError at once, saying so: it will not run
    again in this runtime. pykka's ActorDeadError never reaches the host.

    ``asked`` is an ask of the part already made (its answer is waited for first), and
    ``deadline`` (on :func:`monotonic`) when the call ends, for a caller that asks
    several parts at once within one ``timeout``."""
    if deadline is None:
        deadline = _WAITS.monotonic() + timeout
    waits = threading.Event()  # never set: a wait that nothing cuts short
    while True:
        ref = current()
        left = deadline - _WAITS.monotonic()
        if asked is not None or (ref is not None and ref.is_alive()):
            if asked is None:
                assert ref is not None
                asked = ref.ask(message, block=False)
            try:
                return answer_of(asked, left, part, timeout)
            except pykka.ActorDeadError:  # it died while asked: its successor answers
                asked = None
                left = deadline - _WAITS.monotonic()
        if given_up():
            raise TimeoutError(
                f"the {part} does not run: supervision gave up on it after repeated "
                "crashes (supervisor:gave_up in the runtime stream)"
            )
        if left <= 0:
            raise TimeoutError(
                f"the {part} did not answer within {timeout:g} s: it is down "
                "(restarting after a crash, or given up on)"
            )
        waits.wait(min(PART_POLL_S, left))


#: How many tells a holding :class:`LiveRef` keeps while its part is down.
HELD_TELLS = 10_000
#: How long a waiting :class:`LiveRef`'s ask with no timeout waits for its part to run
#: again (a restart's backoff is at most ``supervision.restart_backoff_cap_ms``).
DOWN_WAIT_S = 30.0


class LiveRef(pykka.ActorRef[Any]):
    """The ref the runtime holds *now* for a part it restarts (the dead-letter queue, the
    supervisor, the announcer): what an actor is given instead of the part's ``ActorRef``,
    so a restart needs no re-wiring. ``tell`` / ``ask`` / ``is_alive`` look ``current()``
    up at use time (ActorDeadError when there is none, or while it is down).

    With ``hold=True`` a ``tell`` while the part is down (between its crash and its
    restart) is kept instead, up to :data:`HELD_TELLS`, and :meth:`flush` delivers what
    was kept once the part runs again: the dead-letter queue loses no entry to its own
    restart. While anything is kept, a tell goes behind it: told after it once the part
    runs again (before its restart's flush, if that is still due), kept behind it while
    the part is down, so no tell overtakes an older one. A dying
    part gives what it never handled to :meth:`hand_over`, which keeps it ahead of the
    tells kept since, so the successor takes them all in order. Once the
    part is given up on (:meth:`give_up`), what was kept and every later ``tell`` go to
    the ``fallback`` the runtime gave instead, in the order they came (a tell while the
    kept ones are still being handed over goes behind them): no tell waits for a restart
    that will not come.

    With ``down_for_good`` (whether the part will not run again: given up on, or the
    runtime stopped) an ``ask`` while the part is down waits for its restart, within the
    ask's ``timeout`` (:data:`DOWN_WAIT_S` without one), instead of failing:
    ActorDeadError once the time is up, and at once when ``down_for_good()``. An ask
    the part took and died with is not asked again of its successor (it may be what
    killed it)."""

    def __init__(
        self,
        current: Callable[[], pykka.ActorRef[Any] | None],
        name: str,
        *,
        hold: bool = False,
        down_for_good: Callable[[], bool] | None = None,
    ) -> None:
        # no super().__init__(): there is no single actor behind it
        self._current = current
        self._name = name
        self._hold = hold
        self._down_for_good = down_for_good
        self._held: list[Any] = []
        self._lock = threading.Lock()
        #: what a tell goes to once the part was given up on (None: it was not)
        self._fallback: Callable[[Any], None] | None = None
        #: what waits to be handed to the fallback, in order, and whether a thread is
        #: handing it on now (see :meth:`_hand_on`)
        self._handing: list[Any] = []
        self._handing_on = False

    def _ref(self) -> pykka.ActorRef[Any]:
        ref = self._current()
        if ref is None:
            raise pykka.ActorDeadError(f"{self._name} is not running")
        return ref

    def is_alive(self) -> bool:
        ref = self._current()
        return ref is not None and ref.is_alive()

    @property
    def given_up(self) -> bool:
        """Whether the part was given up on (its tells go to the fallback)."""
        return self._fallback is not None

    def tell(self, message: Any) -> None:
        if not self._hold:
            self._ref().tell(message)
            return
        with self._lock:
            try:
                # what is kept goes first: a part running again takes it now, before this
                # tell (its restart's flush may be due, or never come: a part first
                # started after a tell was kept for it)
                if self._held and self._tell_kept() < 0:
                    raise pykka.ActorDeadError(f"{self._name} has tells kept for it")
                self._ref().tell(message)
                return
            except pykka.ActorDeadError:
                fallback = self._fallback
                if fallback is None:
                    if len(self._held) >= HELD_TELLS:
                        raise
                    self._held.append(message)
                    return
                hands_on = self._queue_for_fallback([message])
        if hands_on:
            self._hand_on(fallback)

    def flush(self) -> int:
        """Deliver the tells kept while the part was down (in order); how many. When the
        part died again before it took them all (its restart's start failed, say), the
        rest stay kept, in order, for its next successor (or the fallback once it is
        given up on); what it took and never handled comes back ahead of them
        (:meth:`hand_over`)."""
        with self._lock:
            held, self._held = self._held, []
            delivered = self._tell_in_order(held)
            if delivered < len(held):
                self._held = held[delivered:]  # no tell came meanwhile: the lock
                log.info("runtime.part_died_in_flush", part=self._name, kept=len(self._held))
        return delivered

    def hand_over(self, messages: Sequence[Any]) -> None:
        """What a part that died never handled (``messages``, oldest first, as its
        ``take_inbox()`` gave them), for its successor: kept ahead of every tell kept
        since (those came after them: a tell refused by the closing inbox, the rest of a
        :meth:`flush` cut short), told to a successor that runs already when nothing is
        kept, or handed to the fallback once the part was given up on. Kept beyond
        :data:`HELD_TELLS` (what an inbox held is not refused); never raises."""
        with self._lock:
            fallback = self._fallback
            if fallback is None:
                rest = list(messages)
                if not self._held:  # nothing kept: a successor running takes them now
                    rest = rest[self._tell_in_order(rest) :]
                self._held[:0] = rest
                return
            hands_on = self._queue_for_fallback(messages)
        if hands_on:
            self._hand_on(fallback)

    def _tell_kept(self) -> int:
        """Tell what is kept to the part running now (under the lock), in order: how many
        it took, or -1 when it did not take them all (the rest stay kept, in order)."""
        held, self._held = self._held, []
        delivered = self._tell_in_order(held)
        if delivered < len(held):
            self._held = held[delivered:]
            return -1
        return delivered

    def _tell_in_order(self, messages: Sequence[Any]) -> int:
        """Tell ``messages`` to the part running now (under the lock), in order, until
        one is refused: how many it took."""
        ref = self._current()
        for delivered, message in enumerate(messages):
            try:
                if ref is None:
                    raise pykka.ActorDeadError(f"{self._name} is not running")
                ref.tell(message)
            except pykka.ActorDeadError:
                return delivered
        return len(messages)

    def give_up(self, fallback: Callable[[Any], None]) -> int:
        """The part was given up on: hand what was kept to ``fallback`` (in order), and
        every later tell while it is down; how many were kept. ``fallback`` never
        raises (a tell from a dying actor's hand-over, a scheduler timer)."""
        with self._lock:
            held, self._held = self._held, []
            self._fallback = fallback
            hands_on = self._queue_for_fallback(held)
        if hands_on:
            self._hand_on(fallback)
        return len(held)

    def _queue_for_fallback(self, messages: Sequence[Any]) -> bool:
        """Put ``messages`` behind what waits for the fallback (under the lock): whether
        the caller is to hand them on (no other thread is handing on now)."""
        self._handing.extend(messages)
        if self._handing_on or not self._handing:
            return False
        self._handing_on = True
        return True

    def _hand_on(self, fallback: Callable[[Any], None]) -> None:
        """Hand what waits to ``fallback`` in the order it came, until nothing waits;
        outside the lock (it may tell another part). A tell made meanwhile, from another
        thread or from the fallback itself, is handed on here after what came before it,
        and its own call returns at once: before, it went to the fallback at once, ahead
        of the kept tells a give-up was still handing over (a dead-letter entry recorded
        before older ones of its conversation, and retried first)."""
        while True:
            with self._lock:
                waiting, self._handing = self._handing, []
                if not waiting:
                    self._handing_on = False
                    return
            for message in waiting:
                try:
                    fallback(message)
                except Exception:  # a stand-in never raises; if one did, the rest go on
                    log.exception("runtime.part_stand_in_failed", part=self._name)

    def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
        if self._down_for_good is None:
            return self._ref().ask(message, block=block, timeout=timeout)
        deadline = _WAITS.monotonic() + (DOWN_WAIT_S if timeout is None else timeout)
        ref = self._running(deadline, self._down_for_good)
        if timeout is not None:  # the wait for the restart is part of the ask's time
            timeout = max(deadline - _WAITS.monotonic(), 0.0)
        return ref.ask(message, block=block, timeout=timeout)

    def _running(self, deadline: float, down_for_good: Callable[[], bool]) -> pykka.ActorRef[Any]:
        """The part's actor once it runs (ActorDeadError when it does not by ``deadline``,
        and at once when ``down_for_good()``)."""
        waits = threading.Event()  # never set: a wait that nothing cuts short
        waited = False
        while True:
            ref = self._current()
            if ref is not None and ref.is_alive():
                return ref
            left = deadline - _WAITS.monotonic()
            if left <= 0 or down_for_good():
                raise pykka.ActorDeadError(f"{self._name} is not running")
            if not waited:
                waited = True
                log.info("runtime.part_awaited", part=self._name)
            waits.wait(min(PART_POLL_S, left))

    def stop(self, *, block: bool = True, timeout: float | None = None) -> Any:
        return self._ref().stop(block=block, timeout=timeout)

    def __str__(self) -> str:
        return f"LiveRef({self._name}: {self._current()})"

    def __repr__(self) -> str:
        return f"<{self}>"


class SessionHandle:
    """One running session: tell it user messages, ask it for its report."""

    def __init__(
        self,
        session_id: str,
        ref: pykka.ActorRef[Any],
        *,
        agent: str,
        channel: str,
        conversation: str | None = None,
        thread: str | None = None,
        post: Callable[[str, str | None], None] | None = None,
        revive: Callable[[], pykka.ActorRef[Any] | None] | None = None,
        folded: Callable[[], AgentReport | None] | None = None,
    ) -> None:
        self.session_id = session_id
        self._post = post
        self._revive = revive  # the Agent again, after a passivation (None: closed)
        self._folded = folded  # the report from the log, with no Agent (None: closed)
        self.agent = agent
        self.channel = channel
        self.conversation = conversation if conversation is not None else session_id
        self.thread = thread
        self.ref = ref  # replaced when the supervisor restarts the session's agent

    @property
    def stream(self) -> str:
        return f"session:{self.session_id}"

    def send(self, text: str, *, message_id: str | None = None) -> None:
        """Give the session a user message. A durable session (every session a runtime
        starts) records it as an ``activation:ready`` before returning: a crash after
        ``send`` returns never loses it. Otherwise the agent is told it.

        TypeError, before anything is recorded, for a ``text`` or ``message_id`` that is
        not a string; SessionActionError ``empty_message`` for an empty or blank ``text``;
        RuntimeError once the session's agent has stopped (the runtime was
        closed)."""
        if not isinstance(text, str):
            raise TypeError(f"a message's text is a str, not {type(text).__name__}")
        if message_id is not None and not isinstance(message_id, str):
            raise TypeError(f"a message_id is a str or None, not {type(message_id).__name__}")
        if not text.strip():  # in either mode: a turn with nothing to answer
            stream = f"session:{self.session_id}"
            raise SessionActionError(
                f"message refused for {stream!r}: the text is empty",
                reason="empty_message",
                session=stream,
            )
        if self._post is not None:
            self._post(text, message_id)
            return
        try:
            self.ref.tell(UserMessage(text, message_id))
        except pykka.ActorDeadError:
            raise self._stopped() from None

    def status(self, timeout: float = STOP_TIMEOUT_S) -> AgentReport:
        """The agent's :class:`AgentReport` (``idle``, ``queued``, ``step``, the session).

        A passivated session's Agent is started again to answer (it rebuilds from the
        log). One that is down for another reason (it crashed and its restart waits for
        the supervisor's backoff, or supervision gave up on it) is not started: the
        report is folded from the log (``queued`` counts the pending activations, ``step``
        is 0). RuntimeError once the runtime was closed."""
        try:
            report = ask(self.ref, AgentStatus(), timeout, f"session {self.session_id!r}")
        except pykka.ActorDeadError:
            report = self._without_agent(timeout)
        assert isinstance(report, AgentReport)
        return report

    def _without_agent(self, timeout: float) -> AgentReport:
        ref = self._revive() if self._revive is not None else None
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                report = ask(ref, AgentStatus(), timeout, f"session {self.session_id!r}")
                assert isinstance(report, AgentReport)
                return report
        folded = self._folded() if self._folded is not None else None
        if folded is None:
            raise self._stopped()
        return folded

    def _stopped(self) -> RuntimeError:
        return RuntimeError(f"session {self.session_id!r} is stopped: its runtime was closed")

    def __repr__(self) -> str:
        return f"SessionHandle({self.session_id!r}, agent={self.agent!r}, channel={self.channel!r})"


class RunHandle:
    """One sub-agent run: wait for how it ended, or fold its state from the log."""

    def __init__(
        self,
        run_id: str,
        parent: str,
        store: EventStore,
        ended: Future[RunEnded],
        actor: Callable[[], pykka.ActorRef[Any] | None] = lambda: None,
        *,
        supervised: Callable[[], bool] = lambda: True,
    ) -> None:
        self.run_id = run_id
        self.parent = parent
        self._store = store
        self._ended = ended
        self._actor = actor
        self._supervised = supervised

    @property
    def stream(self) -> str:
        return f"session:{self.run_id}"

    def result(self, timeout: float | None = None) -> RunEnded:
        """How the run ended (:class:`RunEnded`: ``outcome``, ``result`` of a success, or
        the static ``notice`` of a failure); TimeoutError if it has not within ``timeout``;
        ``concurrent.futures.CancelledError`` if the runtime closed first (the run will not
        end in this runtime: its stream says where it stood, and the supervisor of the next
        runtime on the store sweeps or recovers it)."""
        return self._ended.result(timeout)

    def done(self) -> bool:
        return self._ended.done()

    @property
    def supervised(self) -> bool:
        """Whether the runtime's supervisor still runs, so that a failed run's recovery
        (a retry, a split) is decided in this runtime. False once supervision gave up on
        the supervisor: a failure is then final here (the next runtime on the log decides
        its recovery)."""
        return self._supervised()

    @property
    def ref(self) -> pykka.ActorRef[Any] | None:
        """The run's actor while the runtime keeps it (None once it ended)."""
        return self._actor()

    def status(self, timeout: float = STOP_TIMEOUT_S) -> RunState:
        """The run's :class:`~stalwart.state.RunState`: asked of its actor while it runs
        (so its watchdog is armed when this returns), else folded from its stream."""
        ref = self._actor()
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                state = ask(ref, GetRun(), timeout, f"run {self.run_id!r}")
                assert isinstance(state, RunState)
                return state
        return load_state(self._store, self.stream, RUN, use_snapshots=False)

    def __repr__(self) -> str:
        return f"RunHandle({self.run_id!r}, parent={self.parent!r}, done={self.done()})"


class RunSpec:
    """What the runtime keeps of a run until it ends: its actor, its handle's future,
    and how to run it again (the host's ``work``, or None for a model-driven run)."""

    def __init__(self, spawn: Spawn, work: Work | None, agent: str) -> None:
        self.spawn = spawn
        self.work = work
        self.agent = agent
        self.ended: Future[RunEnded] = Future()
        self.ref: pykka.ActorRef[Any] | None = None
