"""Supervision review, second pass: restarts, the supervisor's own crash, what a host
asks of a part that is restarting.

A real LMDB store, the fake provider over loopback, a MemoryChannel; a FakeClock drives
every backoff. Actors are crashed for real (told an object they do not understand).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pykka
import pytest

from stalwart.actors import (
    ActivationWorker,
    Announcer,
    Crashed,
    DeadLetterActor,
    ProviderHealthActor,
    SupervisorActor,
)
from stalwart.actors._restarts import DECISION_RETRY_S
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import REGISTRY, default_knobs
from stalwart.clock import FakeClock
from stalwart.events import SupervisorGaveUp, SupervisorRestarted
from stalwart.runtime import Runtime
from stalwart.state import verify
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, has, log_until, of, runtime_config, until


def only(kind: type[pykka.Actor]) -> pykka.ActorRef[Any]:
    """The one running actor of ``kind`` (pykka's registry: no runtime internals)."""
    [ref] = pykka.ActorRegistry.get_by_class(kind)
    return ref


def decided(store: EventStore, count: int) -> list[Any]:
    """The ``runtime`` stream's restart decisions once there are ``count``."""
    kinds = (SupervisorRestarted, SupervisorGaveUp)
    return of(kinds, log_until(store, "runtime", has(kinds, count)))


def restart_decisions(store: EventStore, count: int) -> list[Any] | None:
    """The ``runtime`` stream's restart decisions when there are ``count`` (else None)."""
    found = of((SupervisorRestarted, SupervisorGaveUp), list(store.read_stream("runtime")))
    return found if len(found) >= count else None


def armed(rt: Runtime) -> None:
    """The runtime's last restart decision has its timer armed (decided under the lock)."""
    with rt._restarts_lock:
        pass


def clean(store: EventStore) -> None:
    """``stalwart replay --verify`` re-derives every decision of the log."""
    report = verify(list(store.read_all()), REGISTRY, defaults=default_knobs())
    assert report.findings == (), report.findings


# -- a crash told while the supervisor is down ------------------------------------------------


# Was: DEFECT: an Agent crashing in the supervisor's restart backoff stayed down, unrecorded
def test_an_agent_that_crashes_while_the_supervisor_restarts_is_still_restarted(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    """The runtime told the supervisor ``Crashed`` and dropped it when the supervisor was
    down (its own restart's backoff): the Agent stayed down for good, and the log said
    nothing of its crash. Now the crash is held and decided by the restarted supervisor."""
    session = rt.session("s1", channel="chat")
    only(SupervisorActor).tell(object())
    [first] = decided(store, 1)
    assert first.actor == "supervisor"
    armed(rt)
    dying = session.ref
    dying.tell(object())  # the Agent crashes while no supervisor runs
    assert dying.actor_stopped.wait(GUARD)
    clock.advance(0.11)  # the supervisor's backoff: it runs again, and hears of the crash
    [_, second] = until(lambda: restart_decisions(store, 2), timeout=3.0)
    assert (second.actor, second.reason, second.restarts) == ("session:s1", "TypeError", 1)
    rt.runs()  # the new supervisor has armed the Agent's restart
    clock.advance(0.11)
    until(lambda: session.ref is not dying and session.ref.is_alive())
    assert session.status(timeout=GUARD).idle
    clean(store)


class GatedStore:
    """Passes every call to the store it wraps, but, once armed, holds the next reader of
    the ``runtime`` stream until released: the supervisor busy deciding a crash, so that
    what is told to it meanwhile waits in its mailbox. A test double of the store's
    speed, not of stalwart."""

    def __init__(self, inner: EventStore) -> None:
        self._inner = inner
        self._armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def arm(self) -> None:
        self._armed.set()

    def read_stream(self, stream: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        if stream == "runtime" and self._armed.is_set():
            self._armed.clear()
            self.entered.set()
            assert self.release.wait(GUARD)
        return self._inner.read_stream(stream, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# Was: DEFECT: a Crashed in a dying supervisor's mailbox was dropped: no restart, no record
def test_crashes_in_a_dying_supervisors_mailbox_reach_its_successor(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """pykka drops the messages told to an actor that dies before it handled them: a
    ``Crashed`` queued behind the message that killed the supervisor was lost, and its
    actor never restarted (nor was its crash recorded). The dying supervisor hands them
    to the next one."""
    gated = GatedStore(store)
    config = runtime_config(fake.base_url)
    with Runtime(config, store=gated, clock=clock, channels={"chat": chat}) as rt:  # type: ignore[arg-type]
        restarted: list[int] = []

        def crash(n: int) -> Crashed:
            return Crashed(
                actor=f"session:x{n}", reason="TypeError", restart=lambda: restarted.append(n)
            )

        supervisor = only(SupervisorActor)
        gated.arm()
        supervisor.tell(crash(0))  # it decides this one, held up by the store...
        assert gated.entered.wait(GUARD)
        supervisor.tell(object())  # ...with the message that kills it behind,
        supervisor.tell(crash(1))  # and two more crashes behind that
        supervisor.tell(crash(2))
        gated.release.set()
        records = decided(store, 2)
        assert [r.actor for r in records] == ["session:x0", "supervisor"]
        armed(rt)
        clock.advance(0.11)  # the supervisor runs again...
        clock.advance(DECISION_RETRY_S)  # ...and is told the crashes the dead one never handled
        records = decided(store, 4)
        assert [r.actor for r in records[2:]] == ["session:x1", "session:x2"]
        rt.runs()  # their restarts are armed
        clock.advance(0.11)
        until(lambda: sorted(restarted) == [0, 1, 2])
        clean(store)


# -- what a host asks of a part that is restarting --------------------------------------------


PARTS = [
    (SupervisorActor, "supervisor", lambda rt, t: rt.runs(timeout=t)),
    (DeadLetterActor, "deadletter", lambda rt, t: rt.dead_letters(timeout=t)),
    (Announcer, "announcer", lambda rt, t: rt.announcements(timeout=t)),
    (ProviderHealthActor, "health:main", lambda rt, t: rt.health(timeout=t)),
    (ActivationWorker, "activations", lambda rt, t: rt.worker(timeout=t)),
]


# Was: DEFECT: rt.runs() and the like raised pykka.ActorDeadError while their part restarted
@pytest.mark.parametrize(("kind", "part", "asked"), PARTS, ids=[p[1] for p in PARTS])
def test_asking_a_part_in_its_restarts_backoff_is_answered_once_it_runs_again(
    rt: Runtime,
    store: EventStore,
    clock: FakeClock,
    kind: type[pykka.Actor],
    part: str,
    asked: Callable[[Runtime, float], object],
) -> None:
    """``rt.runs()`` (and ``dead_letters``, ``announcements``, ``health``, ``worker``)
    raised pykka's ``ActorDeadError`` at the host while the part was down between its
    crash and its restart: a traceback from a library the host never chose, where the
    docs promise an answer or a TimeoutError naming the part. Now the part is asked once
    it runs again, within the timeout."""
    only(kind).tell(object())
    [restarted] = decided(store, 1)
    assert restarted.actor == part
    armed(rt)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(asked, rt, GUARD)
        clock.advance(0.11)  # the backoff: the part runs again and answers
        assert answer.result(GUARD + 1) is not None


# Was: DEFECT: a part that stayed down was pykka.ActorDeadError, not TimeoutError naming it
@pytest.mark.parametrize(("kind", "part", "asked"), PARTS, ids=[p[1] for p in PARTS])
def test_asking_a_part_that_stays_down_is_a_timeout_naming_it(
    rt: Runtime,
    store: EventStore,
    kind: type[pykka.Actor],
    part: str,
    asked: Callable[[Runtime, float], object],
) -> None:
    """A part that does not come back within the timeout (given up on, or a backoff the
    clock has not reached) is a TimeoutError that names it, not ActorDeadError."""
    only(kind).tell(object())
    decided(store, 1)
    armed(rt)
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.05 s: it is down"):
        asked(rt, 0.05)
