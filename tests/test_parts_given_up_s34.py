"""A runtime part supervision gave up on: nothing waits for it for ever.

Each part is crashed for real (told an object it does not understand) until the runtime
gives up on it (``supervisor:gave_up``); a ``FakeClock`` drives the restarts' backoff.
Then what would have waited on it is seen to end: a run's handle, a ``spawn_subagent``
call, a host's ask. A real LMDB store, the fake provider over loopback, a MemoryChannel.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest

from stalwart.actors import Announcer, RunReport, SupervisorActor, failure_notice
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import SubagentRecoveryDecided
from stalwart.runtime import Runtime
from stalwart.runtime._tools import spawn_tool_fn
from stalwart.store import EventStore
from stalwart.testing import Fail, FakeProvider
from tests._runtime_support import (
    GUARD,
    agent_settings,
    give_up_on,
    has,
    log_until,
    of,
    runtime_config,
)


def config(base_url: str) -> Config:
    return runtime_config(base_url, agents={"default": agent_settings(subagents=True)})


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


async def answer(report: RunReport) -> str:
    return "the answer"


async def broken(report: RunReport) -> str:
    raise RuntimeError("the host's work failed")


# -- the announcer given up on ----------------------------------------------------------------


# Was: DEFECT: a run that ended after the announcer was given up on never resolved its handle
def test_a_run_that_ends_after_the_announcer_was_given_up_on_resolves_its_handle(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_on(rt, store, clock, Announcer)
    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=answer)
    ended = handle.result(GUARD)
    assert (ended.outcome, ended.result) == ("succeeded", "the answer")
    assert rt.run(handle.run_id) is None  # let go of, as any ended run


# Was: DEFECT: a run that failed after the announcer was given up on was never recovered
def test_a_run_that_fails_after_the_announcer_was_given_up_on_still_has_its_recovery(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_on(rt, store, clock, Announcer)
    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=broken)
    assert handle.result(GUARD).outcome == "failed"
    records = log_until(store, f"session:{handle.run_id}", has(SubagentRecoveryDecided))
    [decided] = of(SubagentRecoveryDecided, records)
    assert decided.action in ("respawn", "respawn_continue")  # the supervisor settled it


# -- the supervisor given up on ---------------------------------------------------------------


# Was: DEFECT: a run whose actor crashed after the supervisor was given up on never ended
def test_a_run_whose_actor_crashes_after_the_supervisor_was_given_up_on_resolves_failed(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    async def hang(report: RunReport) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    give_up_on(rt, store, clock, SupervisorActor)
    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=hang)
    handle.status(GUARD)  # its actor runs
    assert handle.ref is not None
    handle.ref.tell(object())  # the run's actor crashes: nothing can restart it now
    ended = handle.result(GUARD)
    assert ended.outcome == "failed"
    assert ended.notice == failure_notice("write code", "failed", 0)  # the clock stood still
    assert not handle.supervised


# Was: DEFECT: a spawn_subagent call waited an hour for a recovery no supervisor would decide
def test_a_spawn_tool_call_answers_with_the_notice_when_no_supervisor_decides_a_recovery(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    give_up_on(rt, store, clock, SupervisorActor)
    fake.add(Fail(status=400))  # the sub-session's model call: the run fails
    spawn_subagent = spawn_tool_fn(rt, "p1", "default")

    async def call() -> str:
        return await spawn_subagent(task="look it up", task_class="research")

    said = rt.portal.submit(call).result(GUARD * 2)
    assert said == failure_notice("look it up", "failed", 0)  # the run's static notice


# Was: DEFECT: asking a part given up on waited out the whole timeout before saying so
def test_asking_a_part_given_up_on_fails_at_once_and_says_so(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_on(rt, store, clock, SupervisorActor)
    began = time.monotonic()  # real-time: the ask's own wait is on the system clock
    with pytest.raises(TimeoutError, match="gave up on it"):
        rt.runs(timeout=60.0)
    assert time.monotonic() - began < GUARD  # real-time: the bound is a real wait
    assert rt.dead_letters(GUARD).entries == ()  # the other parts answer as ever
