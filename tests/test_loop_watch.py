"""The loop watch: a blocked I/O loop is said once, with where it is blocked, and its end.

Real parts: the real IoPortal and Scheduler; time from the FakeClock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from stalwart.actors import IoPortal, LoopWatch, Scheduler
from stalwart.clock import FakeClock
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, runtime_config, until


def _said(logs: list[Any], event: str) -> list[Any]:
    return [entry for entry in logs if entry["event"] == event]


async def _nothing() -> None:
    return None


def _settle(portal: IoPortal) -> None:
    """Wait until the loop ran everything handed to it so far (a beat included)."""
    portal.submit(_nothing).result(GUARD)


@contextmanager
def _blocked_loop(clock: FakeClock) -> Iterator[threading.Event]:
    """A watched portal (a beat every 1 s, said after 5 s) whose loop a synchronous call
    in ``blocking_sdk_call`` blocks until the yielded gate is opened (at the latest on
    leaving)."""
    gate = threading.Event()
    entered = threading.Event()

    async def blocking_sdk_call() -> None:
        entered.set()
        gate.wait(GUARD)  # a synchronous call on the loop: what the watch is for

    with Scheduler(clock) as scheduler, IoPortal() as portal:
        watch = LoopWatch(portal, scheduler, clock, every_s=1.0, after_s=5.0).start()
        try:
            _settle(portal)
            portal.submit(blocking_sdk_call)
            assert entered.wait(GUARD)
            yield gate
        finally:
            gate.set()
            watch.stop()


def test_a_blocked_loop_is_said_once_with_where_then_its_end(
    clock: FakeClock, logs: list[Any]
) -> None:
    with _blocked_loop(clock) as gate:
        for _ in range(5):
            clock.advance(1.0)
        assert _said(logs, "io.loop_blocked") == []  # the beat has waited 4-5 s
        clock.advance(1.0)
        [blocked] = _said(logs, "io.loop_blocked")
        assert blocked["log_level"] == "warning"
        assert blocked["blocked_s"] >= 5.0
        assert any("in blocking_sdk_call" in frame for frame in blocked["where"])
        assert any("test_loop_watch.py" in frame for frame in blocked["where"])
        for _ in range(10):
            clock.advance(1.0)
        assert len(_said(logs, "io.loop_blocked")) == 1  # once per episode
        gate.set()
        until(lambda: _said(logs, "io.loop_unblocked"))
    [unblocked] = _said(logs, "io.loop_unblocked")
    assert unblocked["blocked_s"] >= 15.0


def test_a_free_loop_is_never_said_blocked_whatever_the_clock_does(
    clock: FakeClock, logs: list[Any]
) -> None:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        watch = LoopWatch(portal, scheduler, clock, every_s=1.0, after_s=2.0).start()
        for step in (0.5, 1.0, 30.0, 3600.0, 1.0, 1.0):
            _settle(portal)
            clock.advance(step)
        _settle(portal)
        watch.stop()
        pending = scheduler.pending()
        clock.advance(10.0)
        assert scheduler.pending() == pending  # stopped: not armed again
    assert _said(logs, "io.loop_blocked") == []


def test_bad_settings_are_refused(clock: FakeClock) -> None:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        for every_s, after_s in ((0.0, 5.0), (2.0, 1.0)):
            with pytest.raises(ValueError, match="every_s"):
                LoopWatch(portal, scheduler, clock, every_s=every_s, after_s=after_s)


def test_the_runtime_watches_its_loop(
    store: EventStore, clock: FakeClock, fake: FakeProvider, logs: list[Any]
) -> None:
    gate = threading.Event()

    async def blocking_tool() -> None:
        gate.wait(GUARD)

    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock) as rt:
        try:
            rt.portal.submit(blocking_tool)
            for _ in range(8):
                clock.advance(1.0)
            until(lambda: _said(logs, "io.loop_blocked"))
        finally:
            gate.set()
        until(lambda: _said(logs, "io.loop_unblocked"))


def test_a_clock_that_jumps_is_not_taken_for_a_long_wait(clock: FakeClock, logs: list[Any]) -> None:
    """A FakeClock moved by minutes at once: the beat has waited that long on the clock,
    but only as many checks as ``after_s`` holds say the loop did not take it."""
    with _blocked_loop(clock):
        for _ in range(5):  # the beat, then four checks
            clock.advance(60.0)
        assert _said(logs, "io.loop_blocked") == []
        clock.advance(60.0)  # the fifth check
        assert len(_said(logs, "io.loop_blocked")) == 1


def test_a_restarted_watch_checks_on_one_timer(clock: FakeClock, logs: list[Any]) -> None:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        idle = scheduler.pending()
        watch = LoopWatch(portal, scheduler, clock, every_s=1.0, after_s=2.0)
        for _ in range(3):
            watch.start()
            watch.start()  # a second start while running changes nothing
            assert scheduler.pending() == idle + 1
            for _ in range(3):
                _settle(portal)
                clock.advance(1.0)
            assert scheduler.pending() == idle + 1
            watch.stop()
            assert scheduler.pending() == idle
    assert _said(logs, "io.loop_blocked") == []
