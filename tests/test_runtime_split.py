"""The recovery protocol's ``split`` (seed 002: "failed twice? break the task into smaller
pieces or escalate"): ``rt.spawn(..., splitter=)``.

A work that hangs on every attempt times out twice under a ``FakeClock``; the supervisor
then asks the lineage's splitter and spawns one model-driven run per subtask, or
escalates when there is no splitter or it gives nothing. Waits on the log, never a sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    SubagentCompleted,
    SubagentRecoveryDecided,
    SubagentSpawned,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, delivered, has, log_until, of
from tests.test_runtime_subagents import config, hang

BIG = "reconcile every invoice of 2025"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        provider.set_default(Answer(text="part done"))
        yield provider


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def spawns(store: EventStore) -> dict[str, SubagentSpawned]:
    """Every run in the log, by run id: its ``subagent:spawned``."""
    found: dict[str, SubagentSpawned] = {}
    for info in store.streams():
        first = next(iter(store.read_stream(info.stream, 1, 1)), None)
        if first is not None and isinstance(first.event, SubagentSpawned):
            found[info.stream.removeprefix("session:")] = first.event
    return found


def wait_for_run(store: EventStore, found: Callable[[SubagentSpawned], bool]) -> str:
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()  # before the look: a spawn appended meanwhile wakes the wait
        for run_id, spawned in spawns(store).items():
            if found(spawned):
                return run_id
        assert time.monotonic() < give_up, "no such run was ever spawned"
        store.wait_for(head + 1, give_up - time.monotonic())


def fail_twice(
    rt: Runtime, clock: FakeClock, store: EventStore, **options: Any
) -> SubagentRecoveryDecided:
    """Spawn a hanging formatting run, let its two attempts time out: the last decision."""
    limit_s = rt.config.subagents.class_timeouts_ms.formatting / 1000
    first = rt.spawn("p1", BIG, task_class="formatting", channel="chat", work=hang, **options)
    first.status()  # asked: its watchdog is armed
    clock.advance(limit_s)
    assert first.result(GUARD).outcome == "timed_out"
    second = wait_for_run(store, lambda s: s.attempt == 2)
    handle = rt.run(second)
    assert handle is not None
    handle.status()
    clock.advance(limit_s)
    records = log_until(store, f"session:{second}", has(SubagentRecoveryDecided))
    [decided] = of(SubagentRecoveryDecided, records)
    assert decided.attempt == 2
    return decided


def test_a_run_failed_twice_is_split_into_one_run_per_subtask_whose_results_are_announced(
    rt: Runtime, clock: FakeClock, store: EventStore, chat: MemoryChannel
) -> None:
    asked: list[tuple[str, str]] = []

    def splitter(task: str, context: str) -> Sequence[str]:
        asked.append((task, context))
        return ["reconcile January", " reconcile February ", ""]

    decided = fail_twice(rt, clock, store, splitter=splitter)
    assert (decided.action, decided.reason) == ("split", "attempts_exhausted")
    assert decided.subtasks == ("reconcile January", "reconcile February")
    assert asked == [(BIG, "")]  # the lineage's task, called once
    runs = {}
    for subtask in decided.subtasks:
        run_id = wait_for_run(store, lambda s, t=subtask: s.task == t)
        runs[subtask] = run_id
        spawned = spawns(store)[run_id]
        assert (spawned.attempt, spawned.parent) == (1, "p1")
        assert (spawned.task_class, spawned.timeout_ms) == ("formatting", 120_000)
        assert (spawned.channel, spawned.conversation) == ("chat", "p1")
        [completed] = of(
            SubagentCompleted, log_until(store, f"session:{run_id}", has(SubagentCompleted))
        )
        assert (completed.outcome, completed.result) == ("succeeded", "part done")
    give_up = time.monotonic() + GUARD
    while len(getattr(rt.announcements().get("p1"), "runs", ())) < 2:
        assert time.monotonic() < give_up, "the subtasks' results were never batched"
    clock.advance(rt.config.subagents.announce_debounce_ms / 1000)
    messages = delivered(rt, chat, 3)  # two failure notices, then the batch
    assert messages[-1].text == "2 sub-agent tasks completed:\n1. part done\n2. part done"
    assert len(spawns(store)) == 4  # no third attempt of the big task


@pytest.mark.parametrize(
    ("splitter", "reason"),
    [
        (lambda task, context: [], "splitter_empty"),
        (lambda task, context: ["  "], "splitter_empty"),
        (lambda task, context: 1 / 0, "splitter_failed:ZeroDivisionError"),
    ],
)
def test_a_splitter_that_gives_nothing_or_raises_escalates(
    rt: Runtime,
    clock: FakeClock,
    store: EventStore,
    splitter: Callable[[str, str], Sequence[str]],
    reason: str,
) -> None:
    decided = fail_twice(rt, clock, store, splitter=splitter)
    assert (decided.action, decided.reason, decided.subtasks) == ("escalate", reason, ())
    assert rt.runs()  # the supervisor is alive and answers
    assert len(spawns(store)) == 2


def test_without_a_splitter_a_run_failed_twice_escalates_as_before(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    decided = fail_twice(rt, clock, store)
    assert (decided.action, decided.reason, decided.subtasks) == (
        "escalate",
        "attempts_exhausted",
        (),
    )
    assert len(spawns(store)) == 2
