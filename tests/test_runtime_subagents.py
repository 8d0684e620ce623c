"""Sub-agents in the Runtime: host spawns, the spawn tool, batched completions, restarts.

A real LMDB store in tmp_path, the fake provider over loopback, MemoryChannels passed in,
a ``FakeClock`` driving every deadline (the watchdog, the debounce, the restart backoff).
Tests wait on futures, on the log and on the channel, never on a sleep.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import GAVE_UP_TEXT, TIMED_OUT_SENTENCE, RunReport
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    SupervisorGaveUp,
    SupervisorRestarted,
    TurnCompleted,
)
from stalwart.runtime import SPAWN_TOOL, Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import GUARD, delivered, has, log_until, of

AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
}


def config(base_url: str, **extra: Any) -> Config:
    data: dict[str, Any] = {
        "providers": {"main": {"kind": "openai", "base_url": base_url}},
        "agents": {"default": AGENT | {"subagents": True}, "plain": dict(AGENT)},
    }
    return parse_config(data | extra)


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


async def hang(report: RunReport) -> str:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


# -- host spawns ----------------------------------------------------------------------------


def test_a_host_spawn_with_work_returns_its_result_and_is_announced(
    rt: Runtime, chat: MemoryChannel, clock: FakeClock, store: EventStore
) -> None:
    async def work(report: RunReport) -> str:
        report.progress(12, step=1)
        return "the answer"

    # the progress report is told before the result: both are in the log by the end
    handle = rt.spawn("p1", "find the answer", task_class="research", channel="chat", work=work)
    ended = handle.result(GUARD)
    assert (ended.outcome, ended.result) == ("succeeded", "the answer")
    assert handle.status().status == "succeeded"
    assert of(SubagentProgress, list(store.read_stream(handle.stream)))[0].tokens == 12
    clock.advance(rt.config.subagents.announce_debounce_ms / 1000)
    [message] = delivered(rt, chat, 1)
    assert message.text == "Sub-agent task completed:\nthe answer"
    assert message.conversation == "p1"


def test_a_hung_work_is_force_failed_at_exactly_its_limit_with_one_notice(
    rt: Runtime, chat: MemoryChannel, clock: FakeClock, store: EventStore
) -> None:
    handle = rt.spawn("p1", "format the table", task_class="formatting", channel="chat", work=hang)
    assert handle.status().status == "running"  # asked: the watchdog is armed
    limit_s = rt.config.subagents.class_timeouts_ms.formatting / 1000
    clock.advance(limit_s - 0.001)
    assert handle.status().status == "running"
    clock.advance(0.001)
    ended = handle.result(GUARD)
    assert ended.outcome == "timed_out"
    [timeout] = of(SubagentWatchdogTimeout, list(store.read_stream(handle.stream)))
    assert timeout.elapsed_ms == timeout.limit_ms == 120_000
    [notice] = delivered(rt, chat, 1)
    assert TIMED_OUT_SENTENCE in notice.text
    assert "format the table" in notice.text
    records = log_until(
        store, handle.stream, lambda rs: len(rs) > 0 and rs[-1].type.endswith("delivered")
    )
    queued = of(AnnouncementQueued, records)
    assert [q.kind for q in queued] == ["failure_notice"]


def test_a_timed_out_run_is_respawned_through_the_runtime_with_the_same_work(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    handle = rt.spawn("p1", "format the table", task_class="formatting", channel="chat", work=hang)
    handle.status()
    clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
    assert handle.result(GUARD).outcome == "timed_out"
    second = _respawned(store, 2)
    again = rt.run(second)
    assert again is not None
    assert again.parent == "p1"
    state = again.status()
    assert (state.status, state.attempt, state.task_class) == ("running", 2, "formatting")


def _attempt(store: EventStore, attempt: int) -> str | None:
    for info in store.streams():
        first = next(iter(store.read_stream(info.stream, 1, 1)), None)
        if isinstance(first.event if first else None, SubagentSpawned):
            assert first is not None
            if first.event.attempt == attempt:
                return info.stream.removeprefix("session:")
    return None


def _respawned(store: EventStore, attempt: int) -> str:
    """The run id of the lineage's ``attempt``, once it is spawned (woken by appends)."""
    give_up = time.monotonic() + GUARD
    while True:
        head = store.head()  # before the look: a spawn appended meanwhile wakes the wait
        found = _attempt(store, attempt)
        if found:
            return found
        assert time.monotonic() < give_up, f"attempt {attempt} was never spawned"
        store.wait_for(head + 1, give_up - time.monotonic())


def test_a_crashed_run_is_restarted_and_its_watchdog_still_fires(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    handle = rt.spawn("p1", "write code", task_class="code", channel="chat", work=hang)
    handle.status()
    dying = handle.ref
    assert dying is not None
    dying.tell(object())  # the run's actor does not understand it: it crashes
    records = log_until(store, "runtime", has(SupervisorRestarted))
    assert of(SupervisorRestarted, records)[0].actor == handle.stream
    rt.runs()
    clock.advance(0.11)
    assert handle.ref is not dying
    assert handle.status().status == "running"  # the restarted actor, rebuilt from its stream
    clock.advance(rt.config.subagents.class_timeouts_ms.code / 1000)
    assert handle.result(GUARD).outcome == "timed_out"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"task_class": "poetry"}, "task_class"),
        ({"custom_timeout_ms": 60_000}, "reason"),
        ({"custom_timeout_ms": 99_000_000, "reason": "long"}, "custom_timeout_ms"),
        ({"task_class": "code", "channel": "nowhere"}, "channel"),
    ],
)
def test_a_refused_spawn_raises_and_appends_nothing(
    rt: Runtime, store: EventStore, options: dict[str, Any], field: str
) -> None:
    head = store.head()
    with pytest.raises(SpawnRefusedError) as refused:
        rt.spawn("p1", "do it", work=hang, **options)
    assert refused.value.field == field
    assert store.head() == head


# -- the spawn_subagent tool ----------------------------------------------------------------


def test_a_model_driven_sub_agent_answers_the_parents_model_through_the_tool(
    rt: Runtime, chat: MemoryChannel, fake: FakeProvider, store: EventStore
) -> None:
    args = {"task": "summarise the report", "task_class": "research"}
    call = FakeToolCall(id="c1", name=SPAWN_TOOL, arguments=args)
    fake.add(
        Answer(text="", tool_calls=(call,)),
        Answer(text="The report says 42."),
        Answer(text="My sub-agent found: 42."),
    )
    rt.session("p1", channel="chat").send("what does the report say?")
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "My sub-agent found: 42."
    parent, sub, final = fake.requests
    assert SPAWN_TOOL in [t["function"]["name"] for t in parent.body["tools"]]
    assert sub.body["messages"][-1] == {"role": "user", "content": "summarise the report"}
    assert "tools" not in sub.body or SPAWN_TOOL not in str(sub.body["tools"])  # no nesting
    last = final.body["messages"][-1]
    assert (last["role"], last["content"]) == ("tool", "The report says 42.")
    run = _attempt(store, 1)
    assert run is not None
    records = list(store.read_stream(f"session:{run}"))
    assert of(SubagentSpawned, records)[0].parent == "p1"
    assert of(SubagentProgress, records)[-1].tokens > 0  # the sub-session's prompt activity
    [completed] = of(SubagentCompleted, records)
    assert (completed.outcome, completed.result) == ("succeeded", "The report says 42.")


class _FailingSink(MemoryChannel):
    """A run's private channel whose one send fails (a MemoryChannel never does alone)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.fail_next(kind="server_error")


def test_a_runs_private_answer_that_fails_to_send_is_not_dead_lettered(
    rt: Runtime, store: EventStore, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's answer reaches its parent as the run's result, not through the private
    channel: a failed private send is recorded, but gives the dead-letter queue no entry
    for a channel no operator configured (and no retry could reach)."""
    monkeypatch.setattr("stalwart.runtime._runs.MemoryChannel", _FailingSink)
    fake.add(Answer(text="found it"))
    handle = rt.spawn("p1", "look it up", task_class="research", announce=False)
    result = handle.result(GUARD)
    assert (result.outcome, result.result) == ("succeeded", "found it")
    records = list(store.read_stream(f"session:{handle.run_id}"))
    [failed] = of(AnnouncementSendFailed, records)
    assert failed.error_class == "server_error"
    assert of(AnnouncementDeadLettered, list(store.read_all())) == []


def test_a_refused_tool_spawn_is_a_clear_tool_error_for_the_model(
    rt: Runtime, chat: MemoryChannel, fake: FakeProvider
) -> None:
    call = FakeToolCall(id="c1", name=SPAWN_TOOL, arguments={"task": "x", "task_class": "poetry"})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="I could not delegate that."))
    rt.session("p1", channel="chat").send("delegate")
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "I could not delegate that."
    last = fake.requests[-1].body["messages"][-1]
    assert last["role"] == "tool"
    assert "unknown task class 'poetry'" in last["content"]


def test_the_tool_is_offered_only_where_the_config_enables_it(
    rt: Runtime, chat: MemoryChannel, fake: FakeProvider
) -> None:
    rt.session("p2", agent="plain", channel="chat").send("hi")
    delivered(rt, chat, 1)
    offered = [t["function"]["name"] for t in fake.requests[0].body.get("tools") or ()]
    assert SPAWN_TOOL not in offered


# -- batched completion announcements -------------------------------------------------------


async def done(report: RunReport) -> str:
    return "ok"


def test_completions_are_batched_after_the_debounce(
    rt: Runtime, chat: MemoryChannel, clock: FakeClock
) -> None:
    rt.spawn("p1", "a", task_class="code", channel="chat", work=done).result(GUARD)
    clock.advance(0.3)
    rt.spawn("p1", "b", task_class="code", channel="chat", work=done).result(GUARD)
    rt.spawn("p2", "c", task_class="code", channel="chat", work=done).result(GUARD)
    clock.advance(0.49)  # 0.49 s after the latest completion: still waiting
    assert len(rt.announcements()["p1"].runs) == 2
    clock.advance(0.02)
    messages = delivered(rt, chat, 2)
    assert not rt.announcements()
    by_parent = {m.conversation: m.text for m in messages}
    assert by_parent["p1"] == "2 sub-agent tasks completed:\n1. ok\n2. ok"
    assert by_parent["p2"] == "Sub-agent task completed:\nok"


def test_a_steady_stream_of_completions_is_still_delivered_at_the_max_wait(
    rt: Runtime, chat: MemoryChannel, clock: FakeClock
) -> None:
    for index in range(13):  # one every 0.4 s: the 0.5 s debounce never runs out
        if index:
            clock.advance(0.4)
        rt.spawn("p1", f"t{index}", task_class="code", channel="chat", work=done).result(GUARD)
        assert "p1" in rt.announcements()
    clock.advance(0.19)  # 4.99 s after the first
    assert len(rt.announcements()["p1"].runs) == 13
    clock.advance(0.02)  # 5.01 s
    [message] = delivered(rt, chat, 1)
    assert message.text.startswith("13 sub-agent tasks completed:")
    assert not rt.announcements()


# -- supervision restarts -------------------------------------------------------------------


def test_a_crashing_agent_is_restarted_then_given_up_after_the_fourth_crash_in_5s(
    rt: Runtime, chat: MemoryChannel, clock: FakeClock, store: EventStore
) -> None:
    session = rt.session("s1", channel="chat")
    for crash, backoff_ms in enumerate([100, 200, 400], 1):
        dying = session.ref
        dying.tell(object())  # the Agent does not understand it: an unhandled exception
        records = log_until(store, "runtime", has(SupervisorRestarted, crash))
        restarted = of(SupervisorRestarted, records)[-1]
        assert (restarted.actor, restarted.restarts) == ("session:s1", crash)
        assert (restarted.backoff_ms, restarted.reason) == (backoff_ms, "TypeError")
        rt.runs()  # the supervisor has armed the restart
        clock.advance(backoff_ms / 1000 - 0.005)  # the backoff (margins for float time)
        assert session.ref is dying
        clock.advance(0.01)
        assert session.ref is not dying
        assert session.status(timeout=GUARD).idle  # rebuilt from its stream
    session.ref.tell(object())
    records = log_until(store, "runtime", has(SupervisorGaveUp))
    [gave_up] = of(SupervisorGaveUp, records)
    assert (gave_up.actor, gave_up.session, gave_up.restarts) == ("session:s1", "s1", 3)
    [notice] = delivered(rt, chat, 1)
    assert (notice.text, notice.conversation, notice.kind) == (GAVE_UP_TEXT, "s1", "failure_notice")
    queued = of(AnnouncementQueued, log_until(store, "runtime", has(AnnouncementDelivered)))
    assert [q.kind for q in queued] == ["failure_notice"]
    clock.advance(10.0)
    assert not session.ref.is_alive()
    report = session.status(timeout=GUARD)  # folded from the log: nothing starts the Agent
    assert report.idle
    assert not session.ref.is_alive()
    assert len(of(SupervisorRestarted, list(store.read_stream("runtime")))) == 3


def test_a_crash_after_a_calm_window_is_restarted_again(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    session = rt.session("s1", channel="chat")
    for crash in range(1, 6):  # five crashes, each more than 5 s after the one before
        session.ref.tell(object())
        records = log_until(store, "runtime", has(SupervisorRestarted, crash))
        assert of(SupervisorRestarted, records)[-1].backoff_ms == 100
        rt.runs()
        clock.advance(6.0)
        assert session.ref.is_alive()
    assert not of(SupervisorGaveUp, list(store.read_stream("runtime")))
    assert isinstance(session.ref, pykka.ActorRef)
    assert of(TurnCompleted, list(store.read_stream("session:s1"))) == []


def test_a_run_left_by_a_dead_process_is_swept_and_resumed_by_the_parents_agent(
    rt: Runtime, clock: FakeClock, store: EventStore
) -> None:
    rt.session("alice", agent="plain", channel="chat")
    # what a process that died mid-run leaves in the log: a spawn and some progress
    store.append(
        "session:orphan",
        [
            SubagentSpawned(
                parent="alice",
                task="reconcile invoices",
                task_class="custom",
                timeout_ms=1_000,
                timeout_reason="test",
                channel="chat",
                conversation="alice",
            ),
            SubagentProgress(tokens=10, step=1),
        ],
    )
    settings = rt.config.subagents
    clock.advance((1_000 + settings.ghost_grace_ms + settings.ghost_sweep_interval_ms) / 1000)
    second = _respawned(store, 2)
    records = log_until(store, f"session:{second}", has(SubagentCompleted))
    [completed] = of(SubagentCompleted, records)
    assert completed.outcome == "succeeded"  # not refused for want of an agent named default
    calls = [r.event for r in store.read_stream("provider:main")]
    assert {getattr(call, "agent", None) for call in calls} >= {"plain"}


@pytest.mark.timeout(90)
def test_more_model_driven_runs_than_the_default_thread_limit_all_answer(
    rt: Runtime, fake: FakeProvider
) -> None:
    """Each model-driven run waits for its sub-session's answer on a worker thread for its
    whole life. Those waits must not take the I/O loop's shared worker threads (anyio's
    default limit: 40), which every append of a model call (and every sync tool) needs:
    with 48 runs at once, all of them still get their answers."""
    runs = 48
    assert runs > 40  # anyio's default thread limiter
    fake.set_default(Answer(text="done"))
    handles = [rt.spawn("p1", f"task {n}", task_class="research") for n in range(runs)]
    results = [handle.result(GUARD * 3) for handle in handles]
    assert [r.outcome for r in results] == ["succeeded"] * runs
    assert {r.result for r in results} == {"done"}


@pytest.mark.timeout(90)
def test_more_spawn_tool_calls_than_the_default_thread_limit_all_answer(
    rt: Runtime, fake: FakeProvider
) -> None:
    """The ``spawn_subagent`` tool waits for its run on a worker thread for the run's
    whole life. Forty-eight such calls at once (forty-eight parent turns, each with its
    tool call under way) must not take every one of the I/O loop's shared worker threads
    (anyio's default limit, 40), which the runs' own model calls need for their appends:
    every call gets its run's answer."""
    from stalwart.runtime._tools import spawn_tool_fn

    calls = 48
    fake.set_default(Answer(text="done"))
    spawn_subagent = spawn_tool_fn(rt, "p1", "default")

    async def all_at_once() -> list[str]:
        answers = [""] * calls

        async def one(n: int) -> None:
            answers[n] = await spawn_subagent(task=f"task {n}", task_class="research")

        async with anyio.create_task_group() as group:
            for n in range(calls):
                group.start_soon(one, n)
        return answers

    assert rt.portal.submit(all_at_once).result(GUARD * 3) == ["done"] * calls
