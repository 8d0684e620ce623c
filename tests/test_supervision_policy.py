"""Restart intensity for one_for_one: more than 3 restarts in 5 s gives up; backoff."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.actors import Crashed, IoPortal, Scheduler
from stalwart.actors._restarts import Restarts
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, SupervisionSettings, parse_config
from stalwart.errors import ConfigError
from stalwart.events import RecordedEvent, RuntimeStopped, SupervisorGaveUp, SupervisorRestarted
from stalwart.state import decide_restart, restart_backoff_ms, restart_history
from stalwart.store import EventStore
from stalwart.testing import recorded
from tests._runtime_support import of

T0 = 1_700_000_000.0
MS = 0.001
V = SupervisionSettings()
KNOBS = {
    "max_restarts": V.max_restarts,
    "within_ms": V.within_ms,
    "backoff_base_ms": V.restart_backoff_base_ms,
    "backoff_cap_ms": V.restart_backoff_cap_ms,
}


def crash(history: tuple[float, ...], now: float) -> SupervisorRestarted | SupervisorGaveUp:
    return decide_restart("agent:a", history, now, reason="crashed", **KNOBS)


def test_the_defaults() -> None:
    assert Config().supervision == V
    assert (V.max_restarts, V.within_ms) == (3, 5_000)
    assert (V.restart_backoff_base_ms, V.restart_backoff_cap_ms) == (100, 1_000)
    with pytest.raises(ConfigError) as info:
        parse_config({"supervision": {"restart_backoff_cap_ms": 50}})
    assert info.value.key == "supervision.restart_backoff_cap_ms"


def test_three_restarts_in_five_seconds_then_it_gives_up() -> None:
    history: tuple[float, ...] = ()
    backoffs = []
    for i in range(3):
        decided = crash(history, T0 + i)
        assert isinstance(decided, SupervisorRestarted)
        assert (decided.restarts, decided.window_ms, decided.max_restarts) == (i + 1, 5_000, 3)
        backoffs.append(decided.backoff_ms)
        history = (*history, T0 + i)
    assert backoffs == [100, 200, 400]
    assert crash(history, T0 + 3) == SupervisorGaveUp(
        actor="agent:a", restarts=3, window_ms=5_000, max_restarts=3, reason="crashed"
    )


def test_a_restart_counts_while_it_is_less_than_the_window_old() -> None:
    history = (T0, T0 + 1, T0 + 2)
    assert isinstance(crash(history, T0 + 5 - MS), SupervisorGaveUp)
    decided = crash(history, T0 + 5)  # the first one is exactly 5 s old: it left the window
    assert isinstance(decided, SupervisorRestarted)
    assert (decided.restarts, decided.backoff_ms) == (3, 400)


def test_a_calm_period_resets_the_backoff_and_the_cap_holds() -> None:
    decided = crash((T0, T0 + 1), T0 + 60)
    assert isinstance(decided, SupervisorRestarted)
    assert (decided.restarts, decided.backoff_ms) == (1, 100)
    assert [restart_backoff_ms(n, base_ms=100, cap_ms=1_000) for n in range(6)] == [
        100,
        200,
        400,
        800,
        1_000,
        1_000,
    ]
    assert restart_backoff_ms(10_000, base_ms=100, cap_ms=1_000) == 1_000


def _record(event: SupervisorRestarted | RuntimeStopped, ts: float, n: int) -> RecordedEvent:
    return recorded(event, stream="runtime", version=n, ts=ts)


def test_the_history_comes_from_the_log() -> None:
    def restarted(actor: str) -> SupervisorRestarted:
        return SupervisorRestarted(actor=actor, restarts=1, backoff_ms=100, reason="r")

    log = [
        _record(restarted("agent:a"), T0, 1),
        _record(restarted("agent:b"), T0 + 1, 2),
        _record(RuntimeStopped(), T0 + 2, 3),
        _record(restarted("agent:a"), T0 + 3, 4),
    ]
    assert restart_history(log, "agent:a") == (T0, T0 + 3)
    assert restart_history(log, "agent:c") == ()


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(0, 3, allow_nan=False), max_size=40))
def test_never_more_than_the_limit_in_any_window_and_decisions_replay(gaps: list[float]) -> None:
    log: list[RecordedEvent] = []
    now = T0
    for n, gap in enumerate(gaps, 1):
        now += gap
        history = restart_history(log, "agent:a")
        decided = crash(history, now)
        if isinstance(decided, SupervisorGaveUp):
            assert sum(1 for t in history if now - t < 5) == 3
            break
        log.append(_record(decided, now, n))
    times = [r.ts for r in log]
    for t in times:
        assert sum(1 for u in times if t <= u < t + 5) <= 3
    for index, record in enumerate(log):
        assert crash(restart_history(log[:index], "agent:a"), record.ts) == record.event


# -- a crash decided again after a store error --------------------------------------------------


def _restarts(
    store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
) -> Restarts:
    return Restarts(
        store=store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels={"chat": MemoryChannel("chat")},
        dead_letters=None,
        settings=SupervisionSettings(),
        send_timeout_s=1.0,
        default_channel="chat",
        tell=lambda _message: None,
        key="test",
    )


def test_a_retried_crash_whose_decision_was_written_is_not_decided_twice(
    store: EventStore, clock: FakeClock
) -> None:
    """A decision's append may be written though it raised (a lost connection): the
    retry finds it by ``crash_id`` and acts on it, with no second decision."""
    restarted: list[str] = []
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        restarts = _restarts(store, clock, scheduler, portal)
        first = Crashed(actor="session:s1", reason="E", restart=lambda: restarted.append("s1"))
        restarts.crashed(first)
        clock.advance(1.0)  # past the backoff: restarted
        again = dataclasses.replace(first, retry=True)  # as if the append had raised
        restarts.crashed(again)
        clock.advance(1.0)
    decisions = of(SupervisorRestarted, list(store.read_stream("runtime")))
    assert [d.crash_id for d in decisions] == [first.crash_id]
    assert restarted == ["s1", "s1"]  # acted on, each time it was told


def test_a_retried_crash_with_no_decision_yet_is_decided(
    store: EventStore, clock: FakeClock
) -> None:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        restarts = _restarts(store, clock, scheduler, portal)
        crash = Crashed(actor="session:s1", reason="E", restart=lambda: None, retry=True)
        restarts.crashed(crash)
    decisions = of(SupervisorRestarted, list(store.read_stream("runtime")))
    assert [d.crash_id for d in decisions] == [crash.crash_id]
