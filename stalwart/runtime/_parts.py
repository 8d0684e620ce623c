"""A runtime's restartable parts: the dead-letter queue, one health actor per provider,
the supervisor and the announcer; started, asked, stopped, and started again after a
crash. The restart decision is the one a session gets (one_for_one, intensity, backoff),
taken here since the supervisor may be the part that died. The actors hold a
:class:`LiveRef` to each part instead of its ``ActorRef``, so a restart needs no
re-wiring."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    DEADLETTER_STREAM,
    Announcer,
    Batch,
    Crashed,
    DeadLetterActor,
    Drain,
    Enqueue,
    GetBatches,
    GetHealth,
    GetRuns,
    HealthChanged,
    HealthReport,
    HealthView,
    ProviderHealthActor,
    QueueState,
    RunEnded,
    RunWatch,
    SupervisorActor,
    Track,
)
from stalwart.actors._announcer import Untrack
from stalwart.actors._deadletter import entry_event
from stalwart.actors._restarts import Restarts
from stalwart.errors import StalwartError
from stalwart.events import SupervisorGaveUp
from stalwart.state import DEADLETTER, DeadLetterState
from stalwart.store import NewEvent, load_state

from ._handles import DEFAULT_CHANNEL, LiveRef, ask_part, monotonic
from ._runs import RunLayer
from ._wiring import Wiring, stop_actors

__all__ = ["PartsLayer"]

log = get_logger(__name__)


#: how long a runtime's start waits for a provider's health actor to fold its stream
#: before it starts the dead-letter queue regardless
HEALTH_START_S = 30.0
#: the ``rule`` of a provider's :class:`HealthReport` once its health actor was given
#: up on: no actor watches the provider any more, it is called as if healthy (its
#: breaker guards the calls), ``since`` is when the runtime gave up on the actor
UNWATCHED = "unwatched"


class PartsLayer:
    """Starts, asks, stops and restarts the runtime's infrastructure actors.

    ``restarts_lock`` is held while a crash is decided (the decision appended, its
    restart timer armed)."""

    def __init__(
        self, wiring: Wiring, health_view: HealthView, *, restarts_lock: threading.Lock
    ) -> None:
        self._w = wiring
        self._health_view = health_view
        self._restarts_lock = restarts_lock
        self._restarts: Restarts | None = None
        self._runs: RunLayer | None = None
        self._dead_letters: pykka.ActorRef[Any] | None = None
        self._health: dict[str, pykka.ActorRef[Any]] = {}
        self._supervisor: pykka.ActorRef[Any] | None = None
        self._announcer: pykka.ActorRef[Any] | None = None
        #: the parts supervision gave up on, and how many tells each refused since
        self._given_up: dict[str, int] = {}
        self._given_up_lock = threading.Lock()
        #: one entry recorded for a given-up dead-letter queue at a time: two tells of one
        #: answer (a held copy and its asker's retell) fold and append one after the other
        self._entry_lock = threading.Lock()
        #: told the name of each part given up on (see on_given_up)
        self._given_up_listeners: list[Callable[[str, Callable[[object], None]], None]] = []
        self.dead_letters_ref = LiveRef(lambda: self._dead_letters, "deadletter", hold=True)
        # held: a crash told while the supervisor restarts is decided once it runs again
        self.supervisor_ref = LiveRef(lambda: self._supervisor, "supervisor", hold=True)
        # held: a run that ends while the announcer restarts is told it once it runs again
        self.announcer_ref = LiveRef(lambda: self._announcer, "announcer", hold=True)

    def start(self, runs: RunLayer) -> None:
        """One health actor per provider, each started (it folded its stream and
        published what it says: the dead-letter queue's first tick must see a provider
        the log says is degraded), then the dead-letter queue, the supervisor and the
        announcer (over ``runs``)."""
        self._runs = runs
        self._restarts = self._make_restarts()
        for provider in self._w.config.providers:
            self._health[provider] = self._start_health(provider)
        for ref in self._health.values():  # answered once its start is over
            with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):  # crashed: restarts
                ref.ask(GetHealth(), timeout=HEALTH_START_S)
        self._dead_letters = self._start_dead_letters()
        self.dead_letters_ref.flush()  # a recovery a health actor told it meanwhile
        self._supervisor = self._start_supervisor()
        self.supervisor_ref.flush()
        self._announcer = self._start_announcer()
        self.announcer_ref.flush()  # a run the supervisor's first sweep started meanwhile

    def _make_restarts(self) -> Restarts:
        return Restarts(
            store=self._w.store,
            clock=self._w.clock,
            scheduler=self._w.scheduler,
            portal=self._w.portal,
            channels=self._w.channels,
            dead_letters=None,
            settings=self._w.config.supervision,
            send_timeout_s=self._w.config.dead_letters.announce_timeout_ms / 1000,
            default_channel=DEFAULT_CHANNEL,
            tell=lambda _message: None,  # no notices: an infrastructure give-up is logged
            retry=self._retold,
            end_run=self._gave_up,  # a part's give-up (its Crashed names it as its run)
            key="runtime",
            runtime=self._w.instance,
        )

    def _start_dead_letters(self) -> pykka.ActorRef[Any]:
        return DeadLetterActor.start(
            store=self._w.store,
            clock=self._w.clock,
            scheduler=self._w.scheduler,
            portal=self._w.portal,
            channels=self._w.channels,
            settings=self._w.config.dead_letters,
            on_crash=partial(self.crashed, "deadletter", self._restart_dead_letters),
            any_degraded=self._health_view.any_degraded,
            runtime=self._w.instance or None,
            hand_over=self.dead_letters_ref.hand_over,  # held for the restarted queue
        )

    def _start_health(self, provider: str) -> pykka.ActorRef[Any]:
        restart = partial(self._restart_health, provider)
        return ProviderHealthActor.start(
            self._w.store,
            self._w.clock,
            self._w.scheduler,
            provider,
            self._w.config.health,
            [self._on_health_changed],
            self._health_view,
            on_crash=partial(self.crashed, f"health:{provider}", restart),
        )

    def _start_supervisor(self) -> pykka.ActorRef[Any]:
        assert self._runs is not None
        config = self._w.config
        return SupervisorActor.start(
            store=self._w.store,
            clock=self._w.clock,
            scheduler=self._w.scheduler,
            portal=self._w.portal,
            channels=self._w.channels,
            dead_letters=self.dead_letters_ref,
            spawner=self._runs.respawn,
            splitters=self._runs.splitter_of,
            works=self._runs.holds_work,
            settings=config.subagents,
            announce_timeout_ms=config.dead_letters.announce_timeout_ms,
            default_channel=DEFAULT_CHANNEL,
            supervision=config.supervision,
            runtime=self._w.instance,
            on_crash=partial(self.crashed, "supervisor", self._restart_supervisor),
            on_run_ended=self._runs.ended,
            retell=self.supervisor_ref.tell,
            hand_over=self.supervisor_ref.hand_over,
        )

    def _start_announcer(self) -> pykka.ActorRef[Any]:
        assert self._runs is not None
        subagents = self._w.config.subagents
        return Announcer.start(
            store=self._w.store,
            clock=self._w.clock,
            scheduler=self._w.scheduler,
            portal=self._w.portal,
            channels=self._w.channels,
            supervisor=self.supervisor_ref,
            on_ended=self._runs.ended,
            dead_letters=self.dead_letters_ref,
            debounce_ms=subagents.announce_debounce_ms,
            max_wait_ms=subagents.announce_max_wait_ms,
            send_timeout_ms=self._w.config.dead_letters.announce_timeout_ms,
            on_crash=partial(self.crashed, "announcer", self._restart_announcer),
        )

    # -- crashes and restarts ------------------------------------------------------------------

    def crashed(self, part: str, restart: Callable[[], object], reason: str) -> None:
        """An infrastructure actor died of an exception (its ``on_failure``, its thread):
        the same decision as for a session (one_for_one, intensity, backoff), taken here
        since the supervisor may be the one that died; a give-up is appended and logged
        at ERROR only (no single session to notify)."""
        restarts = self._restarts
        if restarts is None or not self._w.running():
            return
        # ``run`` names the part: a give-up is handed to _gave_up, not to a session
        crashed = Crashed(actor=part, reason=reason, restart=restart, notify=False, run=part)
        with self._restarts_lock:
            restarts.crashed(crashed)

    def _retold(self, crashed: Crashed) -> None:
        """A crash whose decision waited for the store, told again (by a scheduler
        timer): decided on a thread of its own, since the decision reads and appends and
        the store may still be slow to answer."""

        def decide() -> None:
            restarts = self._restarts
            if restarts is not None and self._w.running():
                with self._restarts_lock:
                    restarts.crashed(crashed)

        threading.Thread(target=decide, name="stalwart-restart-decision", daemon=True).start()

    def restart(self, part: str, start: Callable[[], None]) -> None:
        """Run ``start`` (the part's actor started again) while the runtime runs."""
        with self._w.lock:
            if not self._w.running():
                return
            start()
        log.info("runtime.part_restarted", part=part)

    def _restart_dead_letters(self) -> None:
        """Start the dead-letter actor again (it rebuilds its queue from its stream); the
        agents, the supervisor and the announcer hold a :class:`LiveRef` to it."""

        def start() -> None:
            self._dead_letters = self._start_dead_letters()
            held = self.dead_letters_ref.flush()  # the entries told while it was down
            if held:
                log.info("runtime.dead_letters_held", delivered=held)

        self.restart("deadletter", start)

    def _restart_health(self, provider: str) -> None:
        """Start a provider's health actor again (it folds ``provider:<name>`` again)."""

        def start() -> None:
            self._health[provider] = self._start_health(provider)

        self.restart(f"health:{provider}", start)

    def _restart_supervisor(self) -> None:
        """Start the supervisor again (it sweeps what the log says at once), then tell it
        what was told to the one that died and what came while it was down (a crashed
        actor's :class:`Crashed` above all: nothing else would restart that actor)."""

        def start() -> None:
            self._supervisor = self._start_supervisor()
            held = self.supervisor_ref.flush()
            if held:
                log.info("runtime.supervisor_held", delivered=held)

        self.restart("supervisor", start)

    def _restart_announcer(self) -> None:
        """Start the announcer again and tell it the runs still tracked (before the runs
        can reach it through their :class:`LiveRef`), then the runs' ends told while it
        was down. The batches it held are lost with it; the supervisor's sweep announces
        them once they are owed (``owed_completion``)."""
        assert self._runs is not None
        runs = self._runs

        def start() -> None:
            announcer = self._start_announcer()
            for track in runs.tracks():
                announcer.tell(track)
            self._announcer = announcer
            held = self.announcer_ref.flush()
            if held:
                log.info("runtime.announcer_held", delivered=held)

        self.restart("announcer", start)

    def tell_supervisor(self, message: object) -> None:
        """Tell the supervisor ``message``; while it is down (its restart's backoff) the
        message is held and told to the restarted one (given up on: see _gave_up)."""
        with contextlib.suppress(pykka.ActorDeadError):  # not started yet
            self.supervisor_ref.tell(message)

    # -- parts given up on ---------------------------------------------------------------------

    def _gave_up(self, part: str, _decision: SupervisorGaveUp) -> None:
        """Supervision gave up on ``part`` (``supervisor:gave_up`` is in the log; under
        the restarts lock): nothing starts it again in this runtime, so nothing may wait
        for it. What its :class:`LiveRef` held, and every later tell, goes to what stands
        in for it: a run's end still resolves its handle and reaches the supervisor, a
        run whose actor crashes with no supervisor is ended for its handle, a dead-letter
        entry is recorded for the next queue on the log, and what no one can do any more
        is refused (logged once)."""
        if part.startswith("health:"):  # its report says so before the part is given up
            self._health_unwatched(part.removeprefix("health:"))
        with self._given_up_lock:
            self._given_up.setdefault(part, 0)
        stand_ins: dict[str, tuple[LiveRef, Callable[[Any], None]]] = {
            "announcer": (self.announcer_ref, self._without_announcer),
            "supervisor": (self.supervisor_ref, self._without_supervisor),
            "deadletter": (self.dead_letters_ref, self._without_dead_letters),
        }
        held = 0
        if part == "supervisor" and self._runs is not None:
            self._runs.unsupervised()  # before the held tells: no recovery is awaited
        if part in stand_ins:
            ref, stand_in = stand_ins[part]
            held = ref.give_up(stand_in)
        log.error("runtime.part_given_up", part=part, held=held)
        for listener in self._given_up_listeners:
            try:
                listener(part, partial(self._refused, part))
            except Exception:  # a listener never fails the decision (a crash's thread)
                log.exception("runtime.given_up_listener_failed", part=part)

    def on_given_up(self, listener: Callable[[str, Callable[[object], None]], None]) -> None:
        """Tell ``listener`` the name of each part given up on from now, with what counts
        a tell that part refused (for :meth:`given_up`: a part the runtime holds no
        :class:`LiveRef` to, such as the activation worker, is told through its
        listener). Under the restarts lock: keep it cheap, no asks."""
        self._given_up_listeners.append(listener)

    def _health_unwatched(self, provider: str) -> None:
        """A provider's health actor given up on no longer speaks for it: a degradation
        it published could never end (only that actor decides the recovery), and every
        Agent would defer every message for the rest of the runtime's life. The view says
        healthy instead (the calls go to the provider; its breaker guards them), and the
        dead-letter queue stops holding its retries for it."""
        was = self._health_view.get(provider)
        unwatched = HealthReport(provider=provider, rule=UNWATCHED, since=self._w.clock.now())
        self._health_view.publish(unwatched)
        if was is not None and was.degraded:
            log.warning("runtime.health_unwatched", provider=provider)
            self.dead_letters_ref.tell(Drain(provider))

    def given_up(self) -> dict[str, int]:
        """The parts supervision gave up on, each with how many tells it refused since."""
        with self._given_up_lock:
            return dict(self._given_up)

    def is_given_up(self, part: str) -> bool:
        """Whether supervision gave up on ``part`` (it does not run again here)."""
        with self._given_up_lock:
            return part in self._given_up

    def _down(self, part: str) -> Callable[[], bool]:
        """Whether supervision gave up on ``part`` (asked while it is down)."""
        return partial(self.is_given_up, part)

    def _without_announcer(self, message: object) -> None:
        """A tell to the announcer given up on: a run's end goes where it would have sent
        it (the supervisor, which settles a failure; the run's handle). A success's
        completion is announced by the supervisor's sweep once owed, as after a crash."""
        if isinstance(message, Track | Untrack):
            return  # nothing batches completions any more
        if not isinstance(message, RunEnded) or self._runs is None:
            self._refused("announcer", message)
            return
        self.tell_supervisor(message)
        try:
            self._runs.ended(message)
        except Exception:  # a stand-in never raises (it runs on a run's thread)
            log.exception("runtime.run_end_failed", run=message.run_id)

    def _without_supervisor(self, message: object) -> None:
        """A tell to the supervisor given up on: a run's actor that crashed is ended for
        its handle (nothing restarts it here; the next runtime's supervisor sweeps the
        run); a run's end needs nothing more here (no recovery is decided in this
        runtime); the rest is refused. A session's Agent that crashed is started again
        by the activation worker, which retries the wake it ran."""
        runs = self._runs
        if isinstance(message, Crashed) and message.run is not None and runs is not None:
            runs.lost(message.run.removeprefix("session:"))
        elif not isinstance(message, RunEnded):
            self._refused("supervisor", message)

    def _without_dead_letters(self, message: object) -> None:
        """A tell to the dead-letter queue given up on: an entry (a failed send's
        :class:`Enqueue`) is recorded in the queue's stream as the queue records one, so
        the next runtime's queue (or another process's on the store) retries it; the
        rest is refused."""
        if not isinstance(message, Enqueue):
            self._refused("deadletter", message)
            return
        try:
            with self._entry_lock:
                entry_id = self._record_entry(message)
        except StalwartError as exc:  # a stand-in never raises: said, as the queue would
            log.error(
                "runtime.dead_letter_unrecorded",
                announcement_id=message.announcement_id,
                error_class=type(exc).__name__,
            )
            return
        log.warning(
            "runtime.dead_letter_recorded",
            entry_id=entry_id,
            announcement_id=message.announcement_id,
            channel=message.channel,
            reason=message.reason,
        )

    def _record_entry(self, message: Enqueue) -> str:
        """Append ``announcement:dead_lettered`` for ``message`` (its entry id), unless an
        entry of its announcement is queued with retries left (one entry per
        announcement, as the queue keeps it)."""
        store = self._w.store
        try:
            state = load_state(store, DEADLETTER_STREAM, DEADLETTER)
        except StalwartError:  # the stream cannot be folded: recorded all the same
            state = None
        if state is not None:
            retries = self._w.config.dead_letters.max_retries
            for queued in DEADLETTER.folder(state).queued_of(message.announcement_id):
                if queued.attempts < retries and not queued.refused:
                    return queued.entry_id
        event = entry_event(message)
        store.append(DEADLETTER_STREAM, [NewEvent(event=event, ts=self._w.clock.now())])
        return event.entry_id

    def _refused(self, part: str, message: object) -> None:
        """A tell ``part`` given up on cannot take: counted, and logged the first time."""
        with self._given_up_lock:
            count = self._given_up.get(part, 0) + 1
            self._given_up[part] = count
        if count == 1:
            log.error("runtime.tell_refused", part=part, message=type(message).__name__)

    def _on_health_changed(self, changed: HealthChanged) -> None:
        """A health listener (the health actor's thread): a recovery drains the queue
        (held while the queue restarts, so a recovery meanwhile is not lost)."""
        if changed.status == "healthy":
            self.dead_letters_ref.tell(Drain(changed.provider))

    # -- what the runtime asks of them (see Runtime), and stopping -----------------------------

    # (each asks the part running now, and one that is restarting once it runs again:
    # TimeoutError, never pykka's ActorDeadError, when it does not within the timeout)

    def runs(self, timeout: float) -> dict[str, RunWatch]:
        runs = ask_part(
            lambda: self._supervisor, GetRuns(), timeout, "supervisor", self._down("supervisor")
        )
        assert isinstance(runs, dict)
        return runs

    def announcements(self, timeout: float) -> dict[str, Batch]:
        batches = ask_part(
            lambda: self._announcer, GetBatches(), timeout, "announcer", self._down("announcer")
        )
        assert isinstance(batches, dict)
        return batches

    def health(self, timeout: float) -> dict[str, HealthReport]:
        """Every provider's report within ``timeout`` in all: each health actor is asked
        at once, before any answer is waited for, so slow ones do not add up."""
        deadline = monotonic() + timeout
        with self._w.lock:
            asked = {provider: self._ask_health(provider) for provider in self._health}
        return {
            provider: self._health_of(provider, timeout, deadline, future)
            for provider, future in asked.items()
        }

    def _ask_health(self, provider: str) -> pykka.Future[Any] | None:
        """``GetHealth`` asked of the provider's health actor now (None: it is down)."""
        ref = self._health.get(provider)
        if ref is None or not ref.is_alive() or self.is_given_up(f"health:{provider}"):
            return None
        return ref.ask(GetHealth(), block=False)

    def _health_of(
        self,
        provider: str,
        timeout: float,
        deadline: float,
        asked: pykka.Future[Any] | None,
    ) -> HealthReport:
        """The provider's report, asked of its health actor (``asked``: already asked)
        by ``deadline``; once that actor was given up on, the report the runtime
        published for it (rule :data:`UNWATCHED`)."""
        given_up = self._down(f"health:{provider}")
        if not given_up():
            try:
                report = ask_part(
                    partial(self._health.get, provider),
                    GetHealth(),
                    timeout,
                    f"health actor of {provider!r}",
                    given_up,
                    asked=asked,
                    deadline=deadline,
                )
            except TimeoutError:
                if not given_up():  # given up on while asked: unwatched, as below
                    raise
            else:
                assert isinstance(report, HealthReport)
                return report
        report = self._health_view.get(provider)
        return report if report is not None else HealthReport(provider=provider, rule=UNWATCHED)

    def dead_letters(self, timeout: float) -> DeadLetterState:
        state = ask_part(
            lambda: self._dead_letters,
            QueueState(),
            timeout,
            "dead-letter queue",
            self._down("deadletter"),
        )
        assert isinstance(state, DeadLetterState)
        return state

    def stop_supervision(self) -> None:
        stop_actors([self._announcer, self._supervisor])

    def stop_health(self) -> None:
        stop_actors(list(self._health.values()))

    def stop_dead_letters(self) -> None:
        stop_actors([self._dead_letters])
