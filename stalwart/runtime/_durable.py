"""A runtime's durable sessions: its activation worker and the agents' side of it.

The runtime's sessions run in durable mode: a user message is an ``activation:ready``
appended before ``send`` returns, the :class:`~stalwart.actors.ActivationWorker` leases
it, and the session's Agent runs it as one bounded wake with fenced appends. A wake for
a session this process has no Agent for (another process died holding it, or the agent
was passivated) starts one from the session's recorded agent and channel.

Passivation: an Agent whose session has had no wake for ``passivate_after_ms`` is stopped
(its state is the log); the next wake starts it again from its snapshot and tail.
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

__all__ = ["Durability", "policy_of"]

log = get_logger(__name__)


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
    ``idle(session_id)`` stops an idle Agent.
    ``on_crash(restart, reason)`` hears of a worker that died of an exception; calling
    ``restart()`` starts a new one, under a new owner name (as a new process would: the
    leases the dead one held are taken over when they expire).
    """

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        settings: ActivationSettings,
        *,
        agent_for: Callable[[str, bool], pykka.ActorRef[Any] | None],
        passivate: Callable[[str], bool],
        stopping: Callable[[], bool] = lambda: False,
        on_crash: Callable[[Callable[[], None], str], object] | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy_of(settings)
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._agent_for = agent_for
        self._passivate = passivate
        self._stopping = stopping
        self._on_crash = on_crash
        self._rng = random.SystemRandom()
        self._last_wake: dict[str, float] = {}
        self._handoff = threading.Lock()
        self._timer = ("durable:passivate", new_id())
        self.owner = ""
        self.worker = self._start_worker()
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

    def tell(self, message: object | None) -> None:
        """For the Agents: None nudges the worker (work was appended), or a WakeEnded."""
        if isinstance(message, WakeEnded):
            self._last_wake[message.stream] = self._clock.now()
        try:
            self.worker.tell(Nudge() if message is None else message)
        except pykka.ActorDeadError:
            log.warning("durable.worker_dead")

    def nudge(self) -> None:
        self.tell(None)

    def jitter_ms(self) -> int:
        limit = self.settings.jitter_ms
        return self._rng.randint(0, limit) if limit else 0

    def report(self, timeout: float) -> WorkerReport:
        report = self.worker.ask(WorkerStatus(), timeout=timeout)
        assert isinstance(report, WorkerReport)
        return report

    def closing(self) -> None:
        """The process stops: the worker leases nothing more (before the Agents stop)."""
        self._scheduler.cancel(self._timer)
        with contextlib.suppress(pykka.ActorDeadError):
            self.worker.tell(Closing())

    def stop(self) -> None:
        """Hand the running wakes' leases back (their Agents are stopped), then stop."""
        self._scheduler.cancel(self._timer)
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            released = self.worker.ask(Release(), timeout=5.0)
            if released:
                log.info("durable.leases_released", count=released)
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            self.worker.stop(timeout=5.0)

    def _wake(self, wake: Wake) -> bool | None:
        # one step with the passivation sweep's check-and-stop: a wake is never handed
        # to an Agent the sweep is stopping (it starts a new one once that one is gone)
        with self._handoff:
            ref = self._agent_for(wake.stream.removeprefix("session:"), True)
            if ref is None:
                # the runtime is closing: not a failed wake, a lease to hand back
                return None if self._stopping() else False
            self._last_wake[wake.stream] = self._clock.now()
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
        every = self.settings.passivate_after_ms
        if not every:
            return
        at = self._clock.now() + max(every / 2, 1_000) / 1000
        self._scheduler.schedule(at, self._sweep, key=self._timer)

    def _sweep(self, at: float) -> None:
        """Stop the Agents of sessions with no wake for ``passivate_after_ms`` that say
        they are idle (no wake, no turn, no send in flight); the next sweep tries again
        for the others."""
        try:
            limit = self.settings.passivate_after_ms / 1000
            running = self.report(timeout=5.0).running if self.worker.is_alive() else {}
            for stream in list(self._last_wake):
                with self._handoff:  # the hand-off cannot come between check and stop
                    last = self._last_wake.get(stream)
                    if last is None or stream in running or at - last < limit:
                        continue
                    if self._passivate(stream.removeprefix("session:")):
                        del self._last_wake[stream]
        except (pykka.ActorDeadError, pykka.Timeout) as exc:  # the worker is restarting
            log.warning("durable.sweep_skipped", error=type(exc).__name__)
        finally:
            self._arm_passivation()
