"""ProviderHealthActor: degraded / recovered decided once, recorded first, replayable.

A real LMDB store in tmp_path, a FakeClock and a Scheduler it drives: the quiet-window
timer fires inside ``clock.set()``. Outcomes are awaited through ``ask`` (with a timeout)
and through listeners' conditions, never with sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pykka
import pytest

from stalwart.actors import (
    CallOutcome,
    GetHealth,
    HealthChanged,
    HealthReport,
    HealthView,
    PollHealth,
    ProviderHealthActor,
    Scheduler,
)
from stalwart.clock import FakeClock
from stalwart.config import HealthSettings
from stalwart.events import (
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
    RecordedEvent,
)
from stalwart.state import HEALTH, PROBE_AGENT, decide_health, fold
from stalwart.store import EventStore

T0 = 1_800_000_000.0  # the conftest clock's start
MS = 0.001
WAIT_S = 5.0
STREAM = "provider:p"
H = HealthSettings()
KNOBS = {
    "window_ms": H.window_ms,
    "min_agents": H.min_agents,
    "consecutive": H.consecutive_failures,
}


def failed(agent: str, provider: str = "p") -> ProviderCallFailed:
    return ProviderCallFailed(provider=provider, model="m", agent=agent, error_class="server_error")


def succeeded(agent: str) -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="p", model="m", agent=agent)


class Recorder:
    """A callable listener that lets a test wait for the n-th HealthChanged."""

    def __init__(self) -> None:
        self.got: list[HealthChanged] = []
        self._cond = threading.Condition()

    def __call__(self, changed: HealthChanged) -> None:
        with self._cond:
            self.got.append(changed)
            self._cond.notify_all()

    def wait(self, count: int) -> list[HealthChanged]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.got) >= count, WAIT_S), self.got
            return list(self.got)


class Inbox(pykka.ThreadingActor):
    """An actor listener: keeps what it is told, ``ask("got")`` returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[Any] = []

    def on_receive(self, message: Any) -> Any:
        if message == "got":
            return list(self.got)
        self.got.append(message)
        return None


Start = Callable[..., pykka.ActorRef[Any]]


@pytest.fixture
def start(lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler) -> Iterator[Start]:
    refs: list[pykka.ActorRef[Any]] = []

    def starter(
        *listeners: Any, provider: str = "p", view: HealthView | None = None, follow: bool = True
    ) -> pykka.ActorRef[Any]:
        ref = ProviderHealthActor.start(
            lmdb_store, clock, scheduler, provider, H, listeners, view, follow=follow
        )
        refs.append(ref)
        return ref

    yield starter
    for ref in refs:
        ref.stop(timeout=WAIT_S)


def append(store: EventStore, event: Event, stream: str = STREAM) -> RecordedEvent:
    [record] = store.append(stream, [event])
    return record


def poll(ref: pykka.ActorRef[Any]) -> HealthReport:
    report = ref.ask(PollHealth(), timeout=WAIT_S)
    assert isinstance(report, HealthReport)
    return report


def decisions(store: EventStore, stream: str = STREAM) -> list[RecordedEvent]:
    return [
        r
        for r in store.read_stream(stream)
        if isinstance(r.event, ProviderDegraded | ProviderRecovered)
    ]


def assert_replays(store: EventStore, stream: str = STREAM) -> None:
    """Every decision is what the pure policy gives on the fold before it, at its ts."""
    records = list(store.read_stream(stream))
    for index, record in enumerate(records):
        if isinstance(record.event, ProviderDegraded | ProviderRecovered):
            state = fold(HEALTH, stream, records[:index])
            assert decide_health(state, record.ts, **KNOBS) == [record.event], record


# -- degraded ------------------------------------------------------------------------------


def test_failures_from_two_agents_degrade_once_and_tell_listeners_once(
    lmdb_store: EventStore, clock: FakeClock, start: Start
) -> None:
    inbox = Inbox.start()
    try:
        recorder, view = Recorder(), HealthView()
        ref = start(inbox, recorder, view=view)
        append(lmdb_store, failed("a"))
        clock.advance(30)
        append(lmdb_store, failed("b"))  # the follower wakes the actor: nobody tells it
        [changed] = recorder.wait(1)
        assert (changed.provider, changed.status, changed.rule) == ("p", "degraded", "agents")
        assert changed.at == T0 + 30
        append(lmdb_store, failed("c"))  # already degraded: no second decision
        report = poll(ref)
        assert (report.degraded, report.since, report.rule) == (True, T0 + 30, "agents")
        assert report.deadline == T0 + 90
        assert view.is_degraded("p")
        assert view["p"] == report
        [degraded] = decisions(lmdb_store)
        assert degraded.event == ProviderDegraded(
            provider="p", rule="agents", agents=("a", "b"), failures=2, window_ms=60_000
        )
        assert degraded.version == changed.version == 3
        assert recorder.got == [changed]
        assert inbox.ask("got", timeout=WAIT_S) == [changed]
        assert_replays(lmdb_store)
    finally:
        inbox.stop(timeout=WAIT_S)


def test_three_consecutive_failures_from_one_agent_degrade(
    lmdb_store: EventStore, clock: FakeClock, start: Start
) -> None:
    recorder = Recorder()
    ref = start(recorder, follow=False)  # fed by CallOutcome hints alone
    outcomes = []
    for _ in range(2):
        outcomes.append(append(lmdb_store, failed("a")))
        clock.advance(1)
    for record in outcomes * 3:  # a hint told twice is still one event: no double count
        assert not ref.ask(CallOutcome(record), timeout=WAIT_S).degraded
    record = append(lmdb_store, failed("a"))
    report = ref.ask(CallOutcome(record), timeout=WAIT_S)
    assert (report.degraded, report.rule) == (True, "consecutive")
    [degraded] = decisions(lmdb_store)
    assert degraded.event == ProviderDegraded(
        provider="p", rule="consecutive", agents=("a",), failures=3, window_ms=60_000
    )
    assert [c.status for c in recorder.wait(1)] == ["degraded"]
    assert_replays(lmdb_store)


@pytest.mark.parametrize(("gap", "degrades"), [(60.0, False), (60 - MS, True)])
def test_failures_a_window_apart_do_not_combine(
    lmdb_store: EventStore, clock: FakeClock, start: Start, gap: float, degrades: bool
) -> None:
    ref = start()
    append(lmdb_store, failed("a"))
    assert not poll(ref).degraded
    clock.set(T0 + gap)
    append(lmdb_store, failed("b"))
    assert poll(ref).degraded is degrades
    assert len(decisions(lmdb_store)) == int(degrades)


def test_failures_are_attributed_to_the_provider_that_failed(
    lmdb_store: EventStore, start: Start
) -> None:
    view = HealthView()
    p, q = start(view=view), start(provider="q", view=view)
    foreign = append(lmdb_store, failed("a", "q"), "provider:q")
    append(lmdb_store, failed("b", "q"), "provider:q")
    assert not p.ask(CallOutcome(foreign), timeout=WAIT_S).degraded  # not p's stream
    assert poll(q).degraded
    assert not poll(p).degraded
    assert (view.is_degraded("q"), view.is_degraded("p"), sorted(view)) == (
        True,
        False,
        ["p", "q"],
    )
    assert decisions(lmdb_store) == []
    assert len(decisions(lmdb_store, "provider:q")) == 1


# -- recovered -----------------------------------------------------------------------------


def _degrade(store: EventStore, ref: pykka.ActorRef[Any]) -> None:
    append(store, failed("a"))
    append(store, failed("b"))
    assert poll(ref).degraded


def test_the_timer_alone_recovers_exactly_a_window_after_the_last_failure(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler, start: Start
) -> None:
    recorder = Recorder()
    ref = start(recorder)
    _degrade(lmdb_store, ref)
    clock.set(T0 + 30)
    append(lmdb_store, failed("a"))  # still failing: the quiet window restarts
    deadline = T0 + 90
    assert poll(ref).deadline == deadline
    assert scheduler.next_deadline() == deadline
    clock.set(deadline - MS)
    assert ref.ask(GetHealth(), timeout=WAIT_S).degraded
    assert [c.status for c in recorder.got] == ["degraded"]
    clock.set(deadline)  # fires the timer; nobody polls or asks
    _, recovered = recorder.wait(2)
    assert (recovered.status, recovered.rule, recovered.at) == ("healthy", "quiet_window", deadline)
    report = ref.ask(GetHealth(), timeout=WAIT_S)
    assert (report.degraded, report.since, report.deadline) == (False, deadline, None)
    assert scheduler.pending() == 0
    assert [r.event for r in decisions(lmdb_store)][1:] == [
        ProviderRecovered(provider="p", rule="quiet_window")
    ]
    clock.advance(600)
    assert not poll(ref).degraded
    assert len(decisions(lmdb_store)) == 2
    assert len(recorder.got) == 2
    assert_replays(lmdb_store)


@pytest.mark.parametrize(("agent", "rule"), [(PROBE_AGENT, "probe"), ("a", "success")])
def test_a_success_while_degraded_recovers_at_once(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    start: Start,
    agent: str,
    rule: str,
) -> None:
    recorder = Recorder()
    ref = start(recorder)
    _degrade(lmdb_store, ref)
    clock.advance(5)
    append(lmdb_store, succeeded(agent))
    _, recovered = recorder.wait(2)
    assert (recovered.status, recovered.rule, recovered.at) == ("healthy", rule, T0 + 5)
    report = poll(ref)
    assert (report.degraded, report.rule, report.deadline) == (False, rule, None)
    assert scheduler.pending() == 0  # the quiet-window timer is disarmed
    assert len(decisions(lmdb_store)) == 2
    assert_replays(lmdb_store)


def test_a_restarted_actor_resumes_degraded_and_still_recovers_by_timer(
    lmdb_store: EventStore, clock: FakeClock, start: Start
) -> None:
    first = start()
    _degrade(lmdb_store, first)
    assert first.stop(timeout=WAIT_S)
    clock.set(T0 + 10)
    recorder = Recorder()
    second = start(recorder)
    report = second.ask(GetHealth(), timeout=WAIT_S)
    assert (report.degraded, report.since, report.rule, report.deadline) == (
        True,
        T0,
        "agents",
        T0 + 60,
    )
    assert recorder.got == []  # the episode was announced by the first actor
    clock.set(T0 + 60)
    [recovered] = recorder.wait(1)
    assert (recovered.status, recovered.rule, recovered.at) == ("healthy", "quiet_window", T0 + 60)
    assert len(decisions(lmdb_store)) == 2
    assert_replays(lmdb_store)


def test_a_deadline_that_passed_while_no_actor_ran_is_decided_on_start(
    lmdb_store: EventStore, clock: FakeClock, start: Start
) -> None:
    first = start()
    _degrade(lmdb_store, first)
    assert first.stop(timeout=WAIT_S)
    clock.set(T0 + 120)
    recorder = Recorder()
    second = start(recorder)
    [recovered] = recorder.wait(1)
    assert (recovered.rule, recovered.at) == ("quiet_window", T0 + 120)
    assert not second.ask(GetHealth(), timeout=WAIT_S).degraded
    assert_replays(lmdb_store)


# -- concurrency and replay ----------------------------------------------------------------


def test_concurrent_callers_never_lose_or_duplicate_a_decision(
    lmdb_store: EventStore, clock: FakeClock, start: Start
) -> None:
    recorder = Recorder()
    ref = start(recorder)
    rounds = 150
    errors: list[BaseException] = []

    def caller(offset: int) -> None:
        try:
            for i in range(rounds):
                for event in (failed("a"), failed("b"), succeeded(f"s{i % 3}")):
                    record = append(lmdb_store, event)
                    if i % 2:
                        ref.tell(CallOutcome(record))  # hints and the follower, mixed
                if i % 3 == offset:  # let the actor in now and then: it decides between
                    poll(ref)  # bursts, while the other caller keeps appending
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 6)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    final = poll(ref)
    made = decisions(lmdb_store)
    statuses = ["degraded" if isinstance(r.event, ProviderDegraded) else "healthy" for r in made]
    assert len(made) >= 10  # many episodes, decided while the callers appended
    assert statuses == ["degraded", "healthy"] * (len(made) // 2) + ["degraded"] * (len(made) % 2)
    assert [(c.version, c.status) for c in recorder.got] == [
        (r.version, s) for r, s in zip(made, statuses, strict=True)
    ]
    state = fold(HEALTH, STREAM, lmdb_store.read_stream(STREAM))
    assert decide_health(state, clock.now(), **KNOBS) == []  # nothing owed
    assert final.version == state.version
    assert_replays(lmdb_store)
