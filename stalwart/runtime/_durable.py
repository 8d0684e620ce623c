"""A runtime's durable sessions: its activation worker and the agents' side of it.

The runtime's sessions run in durable mode: a user message is an ``activation:ready``
appended before ``send`` returns, the :class:`~stalwart.actors.ActivationWorker` leases
it, and the session's Agent runs it as one bounded wake with fenced appends. A wake for
a session this process has no Agent for (another process died holding it, or the agent
was passivated) starts one from the session's recorded agent and channel.

Passivation: an Agent whose session has had no wake (nor been started) for
``passivate_after_ms`` is stopped (its state is the log); the next wake starts it again
from its snapshot and tail. The sweep runs on its own thread: the scheduler's callback
only signals it, so the sweep's asks never hold up the runtime's timers.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    Abandoned,
    ActivationWorker,
    Closing,
    IsIdle,
    LeaseLost,
    Nudge,
    Release,
    Scheduler,
    Wake,
    WakeEnded,
    WorkerReport,
    WorkerStatus,
)
from stalwart.clock import Clock
from stalwart.config import ActivationSettings
from stalwart.ids import new_id
from stalwart.state import ActivationPolicy
from stalwart.store import EventStore

from ._handles import STOP_TIMEOUT_S, ask_part

__all__ = ["Durability", "policy_of"]

log = get_logger(__name__)

#: How long the passivation sweep waits for an Agent to say whether it is idle (a busy
#: one is left for the next sweep).
IDLE_ASK_S = 1.0


def policy_of(settings: ActivationSettings) -> ActivationPolicy:
    """The pure policies' knobs from the config's ``activations`` section."""
    return ActivationPolicy(
        lease_ttl_ms=settings.lease_ttl_ms,
        renew_every_ms=settings.renew_every_ms,
        backoff_base_ms=settings.backoff_base_ms,
        backoff_cap_ms=settings.backoff_cap_ms,
        max_attempts=settings.max_attempts,
        max_pending_wakes=settings.max_pending_wakes,
        max_wake_horizon_ms=settings.max_wake_horizon_ms,
    )


class Durability:
    """The worker of one runtime, and what its Agents are given to reach it.

    ``agent_for(session_id, start)`` returns the session's Agent ref (starting it when
    ``start``), or None when it cannot; ``stopping()`` says whether the runtime is closing
    (a wake it cannot hand over then is not a failure: its lease is handed back).
    ``passivate(session_id, ref)`` stops the session's Agent ``ref`` (which said it is
    idle) and marks it passivated; whether it did (False: another Agent runs it now).
    The session layer calls :meth:`started` for every supervised Agent it starts, so the
    sweep looks at every live Agent, not only those that had a wake.
    ``on_crash(restart, reason)`` hears of a worker that died of an exception; calling
    ``restart()`` starts a new one, under a new owner name (as a new process would: the
    leases the dead one held are taken over when they expire). ``given_up()`` says
    whether supervision gave up on the worker (no new one will start in this runtime).
    """

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        settings: ActivationSettings,
        *,
        agent_for: Callable[[str, bool], pykka.ActorRef[Any] | None],
        passivate: Callable[[str, pykka.ActorRef[Any]], bool],
        stopping: Callable[[], bool] = lambda: False,
        on_crash: Callable[[Callable[[], None], str], object] | None = None,
        given_up: Callable[[], bool] = lambda: False,
    ) -> None:
        self.settings = settings
        self.given_up = given_up
        self.policy = policy_of(settings)
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._agent_for = agent_for
        self._passivate = passivate
        self._stopping = stopping
        self._on_crash = on_crash
        self._rng = random.SystemRandom()
        # when each session's Agent last had a wake handed to it, ended one, or started
        self._last_seen: dict[str, float] = {}
        self._handoff = threading.Lock()
        self._timer = ("durable:passivate", new_id())
        self._sweep_due = threading.Condition()
        self._sweep_wanted = False
        self._sweeping = True
        self._sweeper: threading.Thread | None = None
        #: the tells the worker could not take since it died (logged at the first)
        self._refused = 0
        self._refused_lock = threading.Lock()
        self.owner = ""
        self.worker = self._start_worker()
        if settings.passivate_after_ms:
            self._sweeper = threading.Thread(
                target=self._sweep_loop, name="stalwart-passivation", daemon=True
            )
            self._sweeper.start()
            self._arm_passivation()

    def _start_worker(self) -> pykka.ActorRef[Any]:
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{new_id()[:8]}"
        settings = self.settings
        return ActivationWorker.start(
            self._store,
            self._clock,
            self._scheduler,
            self.policy,
            owner=self.owner,
            wake=self._wake,
            lost=self._lost,
            abandoned=self._abandoned,
            poll_ms=settings.poll_ms,
            jitter_ms=self.jitter_ms,
            claim_batch=settings.claim_batch,
            claim_hold_ms=settings.claim_hold_ms,
            on_crash=self._crashed if self._on_crash is not None else None,
        )

    def _crashed(self, reason: str) -> None:
        if self._on_crash is not None:
            self._on_crash(self.restart_worker, reason)

    def restart_worker(self) -> None:
        """Start a new worker in place of one that died (the Agents reach it through
        :meth:`tell`); it reads the log for due work as any worker starting does."""
        self.worker = self._start_worker()
        self._count_refused("durable.worker_restarted")

    def tell(self, message: object | None) -> None:
        """For the Agents: None nudges the worker (work was appended), or a WakeEnded."""
        if isinstance(message, WakeEnded):
            self._last_seen[message.stream] = self._clock.now()
        try:
            self.worker.tell(Nudge() if message is None else message)
        except pykka.ActorDeadError:
            self._worker_dead()

    def _worker_dead(self) -> None:
        """A tell the worker could not take (it is restarting, or was given up on; nothing
        is lost: the work is in the log): logged the first time, then counted (every
        Agent's every append nudges it)."""
        with self._refused_lock:
            self._refused += 1
            first = self._refused == 1
        if first:
            log.warning("durable.worker_dead", given_up=self.given_up())

    def _count_refused(self, event: str) -> None:
        """Say how many tells the dead worker refused (if any), and count from 0 again."""
        with self._refused_lock:
            refused, self._refused = self._refused, 0
        if refused:
            log.info(event, refused=refused)

    def nudge(self) -> None:
        self.tell(None)

    def jitter_ms(self) -> int:
        limit = self.settings.jitter_ms
        return self._rng.randint(0, limit) if limit else 0

    def report(self, timeout: float) -> WorkerReport:
        """What the worker holds; one restarting is asked once it runs again (TimeoutError
        when it does not within ``timeout``, as when it does not answer)."""
        report = ask_part(
            lambda: self.worker, WorkerStatus(), timeout, "activation worker", self.given_up
        )
        assert isinstance(report, WorkerReport)
        return report

    def started(self, session_id: str) -> None:
        """A session's Agent was started (for a host's handle, a wake, a restart, a
        resend): it is passivated once idle for ``passivate_after_ms`` from now."""
        self._last_seen[f"session:{session_id}"] = self._clock.now()

    def closing(self) -> None:
        """The process stops: the worker leases nothing more and the sweep ends (before
        the Agents stop)."""
        self._stop_sweeping()
        self.stop_leasing()

    def stop_leasing(self) -> None:
        """The worker leases nothing more (the wakes it runs keep their leases): what is
        due is left to another worker on the store, or the next runtime."""
        with contextlib.suppress(pykka.ActorDeadError):
            self.worker.tell(Closing())

    def stop(self) -> None:
        """Hand the running wakes' leases back (their Agents are stopped), then stop."""
        self._stop_sweeping()
        if self._sweeper is not None:
            self._sweeper.join(STOP_TIMEOUT_S)
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            released = self.worker.ask(Release(), timeout=5.0)
            if released:
                log.info("durable.leases_released", count=released)
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            self.worker.stop(timeout=5.0)
        self._count_refused("durable.tells_refused")

    def _wake(self, wake: Wake) -> bool | None:
        # one step with the passivation sweep's check-and-stop: a wake is never handed
        # to an Agent the sweep is stopping (it starts a new one once that one is gone)
        with self._handoff:
            ref = self._agent_for(wake.stream.removeprefix("session:"), True)
            if ref is None:
                # the runtime is closing: not a failed wake, a lease to hand back
                return None if self._stopping() else False
            self._last_seen[wake.stream] = self._clock.now()
            try:
                ref.tell(wake)
            except pykka.ActorDeadError:
                return None if self._stopping() else False
            return True

    def _lost(self, lost: LeaseLost) -> None:
        ref = self._agent_for(lost.stream.removeprefix("session:"), False)
        if ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(lost)

    def _abandoned(self, abandoned: Abandoned) -> None:
        """The worker gave up on a wake: the session's Agent (started for it if need be)
        tells the user and closes the turn the wake left running."""
        with self._handoff:  # as a wake: never to an Agent the sweep is stopping
            ref = self._agent_for(abandoned.stream.removeprefix("session:"), True)
            if ref is None:
                log.error("durable.abandoned_untold", stream=abandoned.stream)
                return
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(abandoned)

    # -- passivation ------------------------------------------------------------------------

    def _arm_passivation(self) -> None:
        every = max(self.settings.passivate_after_ms / 2, 1_000) / 1000
        self._scheduler.schedule(self._clock.now() + every, self._sweep_wanted_at, key=self._timer)

    def _sweep_wanted_at(self, _at: float) -> None:
        """The scheduler's callback: signal the sweeper (cheap), and arm the next one."""
        with self._sweep_due:
            if not self._sweeping:
                return
            self._sweep_wanted = True
            self._sweep_due.notify()
        self._arm_passivation()

    def _stop_sweeping(self) -> None:
        self._scheduler.cancel(self._timer)
        with self._sweep_due:
            self._sweeping = False
            self._sweep_due.notify()

    def _sweep_loop(self) -> None:
        """The sweeper's thread: one sweep per signal (signals that come during a sweep
        make one more), until the process stops."""
        while True:
            with self._sweep_due:
                while self._sweeping and not self._sweep_wanted:
                    self._sweep_due.wait()
                if not self._sweeping:
                    return
                self._sweep_wanted = False
            try:
                self._sweep()
            except Exception:  # a bug: logged, and the next sweep tries again
                log.exception("durable.sweep_failed")

    def _sweep(self) -> None:
        """Stop the Agents of sessions with no wake (nor start) for ``passivate_after_ms``
        that say they are idle (no wake, no turn, no send in flight); the next sweep
        tries again for the others. The candidates are all asked at once, outside the
        hand-off lock; the stop re-checks, under it, that no wake was handed over since."""
        now = self._clock.now()
        limit = self.settings.passivate_after_ms / 1000
        running = self._running()
        if running is None:
            return
        asked: list[tuple[str, float, pykka.ActorRef[Any], pykka.Future[Any]]] = []
        for stream, seen in list(self._last_seen.items()):
            if stream in running or now - seen < limit:
                continue
            ref = self._agent_for(stream.removeprefix("session:"), False)
            if ref is None:  # no live Agent (stopped, or given up on): nothing to stop
                self._forget(stream, seen)
                continue
            with contextlib.suppress(pykka.ActorDeadError):
                asked.append((stream, seen, ref, ref.ask(IsIdle(), block=False)))
        for stream, seen, ref, answer in asked:
            if not self._said_idle(answer):
                continue
            with self._handoff:  # the hand-off cannot come between the check and the stop
                if self._last_seen.get(stream) != seen:
                    continue  # a wake was handed over (or the Agent started) meanwhile
                if self._passivate(stream.removeprefix("session:"), ref):
                    self._forget(stream, seen)

    def _running(self) -> dict[str, int] | None:
        """The wakes the worker runs (None: it does not say now, the sweep is skipped);
        none once it was given up on (an Agent that says it is idle is stopped still)."""
        if self.given_up():
            return {}
        try:
            return dict(self.report(timeout=STOP_TIMEOUT_S).running)
        except TimeoutError as exc:  # the worker is restarting, or does not answer
            log.warning("durable.sweep_skipped", error=type(exc).__name__)
            return None

    def _forget(self, stream: str, seen: float) -> None:
        if self._last_seen.get(stream) == seen:
            del self._last_seen[stream]

    @staticmethod
    def _said_idle(answer: pykka.Future[Any]) -> bool:
        """Whether an Agent answered that it is idle (a busy one waits for the next sweep)."""
        try:
            return bool(answer.get(timeout=IDLE_ASK_S))
        except (pykka.ActorDeadError, pykka.Timeout):
            return False
