"""Review of the scheduler and of the passivation of idle Agents: defects found, each
shown by a test that failed on the code before its fix.

Real parts only: a real LMDB store in ``tmp_path``, the loopback fake provider, a
``MemoryChannel`` and the fake clock. Each docstring says what is wrong and what a host
should get instead.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pykka
import pytest

from stalwart.actors import AgentStatus, Scheduler
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import ActivationLeased
from stalwart.runtime import Runtime, SessionHandle
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, delivered, has, log_until, runtime_config

#: passivate_after_ms in these tests: the sweep runs every 30 s of fake time
IDLE_MS = 60_000


def _runtime(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, **extra: Any
) -> Runtime:
    activations = {"passivate_after_ms": IDLE_MS, **extra}
    cfg = runtime_config(fake.base_url, activations=activations)
    return Runtime(cfg, store=store, clock=clock, channels={"chat": chat})


def _idle_for(clock: FakeClock, seconds: float) -> None:
    """Let ``seconds`` of fake time pass, one sweep period (30 s) at a time."""
    steps = int(seconds // 30) + 1
    for _ in range(steps):
        clock.advance(30.0)


def _swept_until_stopped(clock: FakeClock, ref: pykka.ActorRef[Any]) -> bool:
    """Let fake time pass a sweep period (30 s) at a time until the sweep has stopped
    ``ref`` (True), for at most ``GUARD`` seconds of real time. A wake that settles only
    after the first periods passed (a loaded machine) is passivated by a later one."""
    give_up = time.monotonic() + GUARD
    _idle_for(clock, 90.0)
    while not ref.actor_stopped.wait(0.2):
        if time.monotonic() > give_up:
            return False
        clock.advance(30.0)
    return True


def _passivated(rt: Runtime, clock: FakeClock, chat: MemoryChannel) -> SessionHandle:
    """Session ``s1`` on ``chat``, answered once, then passivated by the sweep."""
    session = rt.session("s1", channel="chat")
    session.send("one")
    delivered(rt, chat, 1)
    assert _swept_until_stopped(clock, session.ref), "precondition: the sweep passivates s1"
    return session


# -- passivation: which Agents the sweep ever looks at ---------------------------------------


@pytest.mark.timeout(60)
def test_an_agent_revived_by_its_handle_is_passivated_again(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect (stalwart/runtime/_durable.py:Durability._sweep, with
    _sessions.py:SessionLayer._revive): the sweep only considers the sessions in
    ``_last_wake`` and deletes a session's entry when it passivates it; only a *wake*
    puts it back. An Agent started again for its host's handle (``handle.status()``, or
    ``rt.session(id)``) therefore lives for ever: a host that polls the status of its
    sessions (a dashboard) revives every passivated Agent once, and from then on none of
    them is ever stopped again, which is the thread-per-session cost passivation exists
    to avoid ("Thousands of sessions do not need thousands of live threads").

    Expected: an Agent revived only to answer ``status()`` is stopped again once it has
    been idle for ``passivate_after_ms``, like any idle Agent."""
    with _runtime(store, clock, fake, chat) as rt:
        session = _passivated(rt, clock, chat)
        assert session.status(GUARD).session.turns == 1  # revives the Agent
        revived = session.ref
        assert revived.is_alive()
        _idle_for(clock, 10 * IDLE_MS / 1000)  # ten idle periods, twenty sweeps
        # the sweep runs on its own thread: wait (real time) for the stop it decided
        assert revived.actor_stopped.wait(GUARD), (
            "the Agent revived by handle.status() was never passivated again"
        )


@pytest.mark.timeout(60)
def test_an_agent_whose_session_never_had_a_wake_is_passivated(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect (stalwart/runtime/_durable.py:Durability._sweep): a session enters the
    sweep's ``_last_wake`` only when a wake is handed to its Agent or ends. The Agent of a
    session the host opened (``rt.session(id)``) and that has had no message yet, or one
    the start-up resend started (``_resend_cut_short``), is never looked at by the sweep
    and never stopped. docs/sessions.md: "An Agent whose session has had no wake for
    ``passivate_after_ms`` (5 min) is stopped"; a host that opens a session per
    connected user gets a live thread per user who never says anything.

    Expected: after ``passivate_after_ms`` (and a sweep) with no wake, the idle Agent is
    stopped; its handle still works (``status()`` starts it again)."""
    with _runtime(store, clock, fake, chat) as rt:
        session = rt.session("quiet", channel="chat")
        first = session.ref
        assert session.status(GUARD).session.turns == 0  # the Agent is up and idle
        _idle_for(clock, 10 * IDLE_MS / 1000)
        assert first.actor_stopped.wait(GUARD), (
            "an Agent idle for ten idle periods was never stopped"
        )


# -- passivation: the sweep blocks the scheduler's thread and the wake hand-off -------------


def _busy_for(refs: list[pykka.ActorRef[Any]], count: int) -> None:
    """Leave ``count`` AgentStatus tells in each idle Agent's mailbox (what a host polling
    its sessions' status in a burst leaves there): the Agents stay idle, but answer
    late. The tells are queued with the interpreter's thread switches held off, so the
    Agents cannot drain them while they are being told (an Agent drains about as fast as
    one thread can tell)."""
    status = AgentStatus()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    try:
        for ref in refs:
            for _ in range(count):
                ref.tell(status)
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.timeout(60)
def test_a_wake_due_during_a_sweep_is_not_held_up_by_busy_agents(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect (stalwart/runtime/_durable.py:Durability._sweep and
    _sessions.py:SessionLayer.passivate): the passivation sweep is a scheduler callback,
    yet it asks the worker for a report (up to 5 s), asks every idle-looking Agent
    ``IsIdle`` (up to ``IDLE_ASK_S`` = 1 s each) and waits for each stop (up to 5 s), all
    on the scheduler's thread (inside ``advance()`` with a fake clock) and while holding
    the hand-off lock. docs/scheduler.md: callbacks "must be cheap:
    ``actor_ref.tell(...)``, never an ``ask`` or I/O". Every other timer of the runtime
    (lease renewals, watchdogs, execution timeouts, the worker's ticks) and every wake
    hand-off waits behind it: one second per Agent that is slow to answer.

    Here two idle Agents have a full mailbox when the sweep runs; a delayed wake of an
    unrelated session falls due one second (fake) after the sweep. Its timer (the
    worker's tick) fires, and the wake is leased, only after the sweep's two ``IsIdle``
    asks time out (2 s of real time), although nothing about that session is busy.

    Expected: the sweep does not block the scheduler (it tells, and stops Agents off the
    scheduler's thread), so the wake is answered about as fast as with no sweep."""
    # poll_ms at its maximum: the worker's only tick before the wake is the one at its
    # run time, so the wake is leased when (and only when) that timer fires
    with _runtime(store, clock, fake, chat, poll_ms=60_000) as rt:
        busy = [rt.session(name, channel="chat") for name in ("b1", "b2")]
        for count, session in enumerate(busy, start=1):
            session.send("hello")
            delivered(rt, chat, count)
        rt.session("other", channel="chat")
        clock.advance(30.0)  # the first sweep: nothing idle for 60 s yet
        start = clock.now()
        rt.wake_at("other", start + 31.0, "check the refund landed")
        _busy_for([session.ref for session in busy], 120_000)
        began = time.monotonic()
        clock.advance(31.0)  # the sweep (start + 30), then the wake's tick (start + 31)
        log_until(store, "session:other", has(ActivationLeased))
        took = time.monotonic() - began
        delivered(rt, chat, 3)
    assert took < 1.0, f"a wake due 1 s after the sweep was leased {took:.2f} s (real) late"


# -- passivation: the host's handle while the sweep stops its Agent --------------------------


@pytest.mark.timeout(90)
def test_a_handle_asked_while_the_sweep_stops_its_agent_keeps_working(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect (stalwart/runtime/_sessions.py:SessionLayer.passivate and ._revive):
    ``passivate`` stops the Agent first and only afterwards, under the runtime's lock,
    marks the session ``_passivated``. A ``handle.status()`` that lands in between finds
    the Agent dead and ``_revive`` refuses to start it again (it is "not passivated":
    the runtime takes it for an Agent down for another reason), so ``status()`` raises
    ``RuntimeError("session 's1' is stopped: its runtime was closed")`` while the runtime
    runs. docs/sessions.md: passivation keeps "the host's ``SessionHandle`` ... valid:
    ``handle.status()`` starts it again to answer".

    Here a host thread polls ``status()`` while the sweep passivates the session, a few
    rounds (each round the session answers a message, then sits idle past
    ``passivate_after_ms``).

    Expected: every ``status()`` answers (the session is marked passivated before, or
    atomically with, its Agent being stopped)."""
    errors: list[str] = []
    with _runtime(store, clock, fake, chat) as rt:
        session = rt.session("s1", channel="chat")
        for round_ in range(1, 31):
            session.send(f"message {round_}")
            delivered(rt, chat, round_)
            stopping = session.ref
            done = threading.Event()

            def poll(done: threading.Event = done) -> None:
                while not done.is_set():
                    try:
                        session.status(GUARD)
                    except RuntimeError as exc:
                        errors.append(str(exc))
                        return

            poller = threading.Thread(target=poll, name="host-status-poller")
            poller.start()
            try:
                # the sweep passivates s1 while the host polls
                assert _swept_until_stopped(clock, stopping), "precondition: s1 was passivated"
            finally:
                done.set()
                poller.join(GUARD)
            if errors:
                break
        assert rt.running
    assert not errors, f"status() failed while the runtime runs (round {round_}): {errors[0]}"


# -- the scheduler on a fake clock ------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_timer_that_fell_due_while_stopped_fires_at_start(clock: FakeClock) -> None:
    """Defect (stalwart/actors/_scheduler.py:Scheduler.start with a FakeClock): timers are
    kept across a stop, and a deadline that has passed "fires at once" (docs/scheduler.md);
    on a ``SystemClock`` the thread fires such a timer as soon as ``start()`` runs. On a
    fake clock ``start()`` only arms the overdue helper for timers *scheduled* at or before
    ``now()`` later on, so a timer whose deadline the clock passed while the scheduler was
    stopped waits for the next ``advance()``, one the caller may never make: the very
    "wait for an advance the test never makes" the helper thread exists to prevent.

    Expected: ``start()`` fires (on the helper thread) every timer already due, as the
    real clock's thread does."""
    fired = threading.Event()
    scheduler = Scheduler(clock)
    scheduler.schedule(clock.now() + 1, lambda _at: fired.set(), key="due-while-stopped")
    clock.advance(2)  # the scheduler is not started: nothing fires (documented)
    scheduler.start()
    try:
        # real-time: the overdue timer fires on the helper thread, asynchronously
        assert fired.wait(2.0), "a timer due before start() never fired without an advance"
    finally:
        scheduler.stop()
