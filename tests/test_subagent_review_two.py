"""Second adversarial review of sub-agent runs: odd host input, the announcer's batches,
the recovery protocol's split, and what replay verification says about a race.

A real LMDB store in tmp_path, the fake provider over loopback, MemoryChannels, a
``FakeClock`` for every deadline. Waits are on the log, a run's handle or small real-time
bounds (never a timeout a fake clock could fire).
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import pytest

from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    AnnouncementQueued,
    SubagentCompleted,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentWatchdogTimeout,
)
from stalwart.runtime import RunHandle, Runtime
from stalwart.store import EventStore
from stalwart.testing import Fail, FakeProvider
from tests._runtime_support import GUARD, delivered, has, log_until, of
from tests.test_runtime_split import BIG, fail_twice, spawns
from tests.test_runtime_subagents import config

#: How long (real seconds) a run that should end at once may take before it counts as
#: never ending (no clock deadline is involved: only the actors' own messages).
PROMPTLY = 2.0


@pytest.fixture
def ops() -> MemoryChannel:
    return MemoryChannel("ops")


@pytest.fixture
def rt(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    ops: MemoryChannel,
) -> Iterator[Runtime]:
    channels = {"chat": chat, "ops": ops}
    with Runtime(config(fake.base_url), store=store, clock=clock, channels=channels) as rt:
        yield rt


def ends_promptly(handle: RunHandle, clock: FakeClock, *, step_s: float = 0.1) -> bool:
    """Whether the run ends within :data:`PROMPTLY` real seconds while ``clock`` moves in
    ``step_s`` steps (far less than any run limit: only restart backoffs can pass)."""
    give_up = time.monotonic() + PROMPTLY
    while time.monotonic() < give_up:
        if handle.done():
            return True
        clock.advance(step_s)
        time.sleep(0.02)  # real-time: the actors run on their own threads
    return handle.done()


# -- odd host input: what the store cannot record --------------------------------------------


# Was: DEFECT: rt.spawn(custom_timeout_ms=90_000.0, reason=...) (a float, e.g. 1.5 * 60_000)
# passes spawn_timeout's range check (stalwart/state/_subagent.py:131 `1 <= custom <=
# max` accepts floats and bools) so no SpawnRefusedError is raised; the run's actor then
# fails to append its subagent:spawned (EventError, stalwart/actors/_subagent.py:224),
# crash-loops until supervision gives up, and SupervisorActor._given_up
# (stalwart/actors/_supervisor.py:375) returns for a stream with no spawn, so nobody ends
# the run: its handle never resolves. Fix: spawn_timeout must refuse a non-int (and a
# bool) custom_timeout_ms with SpawnRefusedError(field="custom_timeout_ms"); and a run
# whose actor is given up before its spawn is recorded must still be ended (RunEnded
# "failed" to on_run_ended) so its handle resolves.
@pytest.mark.parametrize("custom", [90_000.0, True], ids=["float", "bool"])
def test_a_custom_timeout_that_is_not_an_int_is_refused_or_the_run_still_ends(
    rt: Runtime, clock: FakeClock, store: EventStore, custom: Any
) -> None:
    async def work(report: RunReport) -> str:
        return "done"

    options: dict[str, Any] = {"custom_timeout_ms": custom, "reason": "big", "work": work}
    try:
        handle = rt.spawn("p1", "tidy the notes", channel="chat", **options)
    except SpawnRefusedError as refused:
        field = refused.field
    else:
        assert ends_promptly(handle, clock), "the spawn was accepted but its run never ended"
        return
    assert field == "custom_timeout_ms"


# Was: DEFECT: a RunReport call with a value the store cannot encode (a pathlib.Path artifact,
# a token estimate like len(text) / 4) is told to the actor unchecked
# (stalwart/actors/_subagent.py:151-155) and appended (_observe, :294); the EventError
# crashes the SubAgentActor, whose on_failure cancels the work (:242), and the restarted
# actor does not run it again: the work's result is lost and the run idles until its
# watchdog, then is reported timed out (and respawned to do it all again). Fix: check
# the report's values in RunReport (TypeError in the work's own thread) or coerce them
# (str(path), int(tokens)), and never let one bad report crash the run's actor (drop it
# with a log line).
@pytest.mark.parametrize(
    "bad_report",
    [
        lambda report: report.artifact(pathlib.Path("out/notes.md"), "ab" * 32),  # type: ignore[arg-type]
        lambda report: report.progress(len("twelve chars") / 4, step=1),  # type: ignore[arg-type]
    ],
    ids=["path-artifact", "float-tokens"],
)
def test_a_report_the_store_cannot_record_does_not_lose_the_runs_result(
    rt: Runtime, clock: FakeClock, bad_report: Any
) -> None:
    async def work(report: RunReport) -> str:
        with contextlib.suppress(Exception):  # a report refused at once is fine
            bad_report(report)
        await anyio.sleep(0.05)  # the report reaches the actor before the result
        return "the answer"

    handle = rt.spawn("p1", "write the notes", task_class="code", channel="chat", work=work)
    assert ends_promptly(handle, clock), "the run's result was lost: it waits for its watchdog"
    ended = handle.result(0)
    assert (ended.outcome, ended.result) == ("succeeded", "the answer")


# Was: DEFECT: a work that returns something the store cannot encode (a str with a lone
# surrogate, as a model's JSON "\udce9" decodes to, or a non-str) makes
# SubAgentActor._completed (stalwart/actors/_subagent.py:304-305) append a
# subagent:completed that raises EventError: the actor crashes, its restart does not run
# the work again, and the finished run sits "running" until its watchdog, then is
# announced as timed out ("did not complete in time") and respawned to fail the same way.
# Fix: _work_done (:161-167) must turn a result that is not storable text into a failed
# outcome (error_class "TypeError"/"UnicodeEncodeError") or a sanitised str
# (errors="replace"), so the run ends at once.
@pytest.mark.parametrize("result", ["caf\udce9", 42], ids=["lone-surrogate", "int"])
def test_a_result_the_store_cannot_record_still_ends_the_run_at_once(
    rt: Runtime, clock: FakeClock, store: EventStore, result: Any
) -> None:
    async def work(report: RunReport) -> str:
        return result  # type: ignore[no-any-return]

    handle = rt.spawn("p1", "say hello", task_class="code", channel="chat", work=work)
    assert ends_promptly(handle, clock), "a finished run is left running until its watchdog"
    assert handle.result(0).outcome in ("succeeded", "failed")
    assert not of(SubagentWatchdogTimeout, list(store.read_stream(handle.stream)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reason", "because \udce9"),
        ("reason", 42),
        ("conversation", "room-\ud800"),
        ("conversation", 7),
    ],
)
def test_a_spawn_whose_reason_or_conversation_cannot_be_recorded_is_refused(
    rt: Runtime, store: EventStore, field: str, value: Any
) -> None:
    # Was: DEFECT: rt.spawn checked only the task: a reason or conversation the log cannot
    # store started a run whose actor could not record its spawn (it failed once given up).
    options: dict[str, Any] = {"custom_timeout_ms": 60_000, "reason": "a long import"}
    options[field] = value
    head = store.head()
    with pytest.raises(SpawnRefusedError) as refused:
        rt.spawn("p1", "import the ledger", **options)
    assert refused.value.field == field
    assert store.head() == head


# -- completion announcements ---------------------------------------------------------------


# DEFECT: the Announcer batches completions by parent only (stalwart/actors/_announcer.py:
# 165-176) and sends the batch on the channel/conversation/thread of the latest run
# added, so a run spawned with channel="ops", conversation="ops-room" has its result
# announced on "chat" in the parent's conversation (and recorded so in its stream),
# contradicting docs/embedding.md ("The run's failure notice and completion go to
# `channel`"). Fix: key the batches by (parent, channel, conversation, thread).
def test_runs_of_one_parent_are_announced_on_the_channel_each_asked_for(
    rt: Runtime, clock: FakeClock, store: EventStore, chat: MemoryChannel, ops: MemoryChannel
) -> None:
    async def to_ops(report: RunReport) -> str:
        return "ops result"

    async def to_chat(report: RunReport) -> str:
        return "chat result"

    first = rt.spawn(
        "p1", "check the pager", task_class="code", channel="ops", conversation="ops-room",
        work=to_ops,
    )  # fmt: skip
    assert first.result(GUARD).outcome == "succeeded"
    second = rt.spawn("p1", "reply to Ann", task_class="code", channel="chat", work=to_chat)
    assert second.result(GUARD).outcome == "succeeded"
    give_up = time.monotonic() + GUARD
    while len(getattr(rt.announcements().get("p1"), "runs", ())) < 2:
        assert time.monotonic() < give_up, "the completions were never batched"
    clock.advance(rt.config.subagents.announce_debounce_ms / 1000)
    records = log_until(store, first.stream, has(AnnouncementQueued))
    [queued] = of(AnnouncementQueued, records)
    assert queued.channel == "ops"
    [to_room] = delivered(rt, ops, 1)
    assert to_room.conversation == "ops-room"
    assert "ops result" in to_room.text
    assert all("ops result" not in message.text for message in chat.messages)


# -- the recovery protocol's split ----------------------------------------------------------


# DEFECT: a splitter that returns the lineage's own task as a subtask (a naive
# `task.split(" and ")` on a task with no " and ") makes an unbounded recovery loop:
# RunLayer._split (stalwart/runtime/_runs.py:268-269) registers the subtask as a
# model-driven lineage under the very key of the original one, and splitter_of
# (:257-259) matches the subtask's runs to the original lineage's splitter (same text, or
# text + "\n\n..."), so each subtask run failed twice is split again, for ever (hundreds of
# runs and model calls within seconds), contradicting docs/resilience.md ("they have no
# splitter of their own"). Fix: remember split runs by run id (or record their origin in
# subagent:spawned) and never give them a splitter; key lineages by a lineage id, not by
# (parent, task) text.
def test_a_subtask_equal_to_its_lineage_task_is_escalated_not_split_again(
    rt: Runtime, clock: FakeClock, store: EventStore, fake: FakeProvider
) -> None:
    fake.set_default(Fail(status=400))  # every model-driven subtask fails at once

    def splitter(task: str, context: str) -> Sequence[str]:
        return task.split(" and ")  # no " and " in the task: [task]

    decided = fail_twice(rt, clock, store, splitter=splitter)
    assert decided.subtasks == (BIG,)
    known = set(spawns(store))
    give_up = time.monotonic() + GUARD
    while not (
        later := [
            run_id
            for run_id, spawned in spawns(store).items()
            if run_id not in known and spawned.attempt == 2
        ]
    ):
        assert time.monotonic() < give_up, "the subtask was never respawned"
        time.sleep(0.01)  # real-time: the subtask's model calls run on the I/O loop
    records = log_until(store, f"session:{later[0]}", has(SubagentRecoveryDecided))
    [last] = of(SubagentRecoveryDecided, records)
    assert (last.action, last.reason) == ("escalate", "attempts_exhausted")


# DEFECT: the subtasks of a split are spawned with the failed run's `announce`
# (split_spawns -> respawn, stalwart/actors/_supervisor_fold.py:239 and :247; then
# RunLayer.respawn, stalwart/runtime/_runs.py:217), so for rt.spawn(..., announce=False,
# splitter=fn) their results reach nobody: the original handle already resolved
# "timed_out", the runtime exposes no handle or listener for the subtasks, and no
# completion is sent, contradicting docs/resilience.md ("their results are announced").
# Fix: spawn split subtasks with announce=True (or resolve the original lineage's handle
# with their results).
def test_the_subtasks_of_an_unannounced_run_still_have_their_results_announced(
    rt: Runtime, clock: FakeClock, store: EventStore, chat: MemoryChannel
) -> None:
    def splitter(task: str, context: str) -> Sequence[str]:
        return ["reconcile January", "reconcile February"]

    decided = fail_twice(rt, clock, store, splitter=splitter, announce=False)
    assert decided.action == "split"
    give_up = time.monotonic() + GUARD
    while (
        len([s for s in spawns(store).values() if s.task in decided.subtasks]) < 2
        or sum(
            bool(of(SubagentCompleted, list(store.read_stream(f"session:{run_id}"))))
            for run_id, s in spawns(store).items()
            if s.task in decided.subtasks
        )
        < 2
    ):
        assert time.monotonic() < give_up, "the subtasks never completed"
        time.sleep(0.01)  # real-time: the subtasks' model calls run on the I/O loop
    debounce_s = rt.config.subagents.announce_debounce_ms / 1000
    give_up = time.monotonic() + PROMPTLY
    while not any("completed" in message.text for message in chat.messages):
        assert time.monotonic() < give_up, "the subtasks' results were announced to nobody"
        clock.advance(debounce_s)
        time.sleep(0.05)  # real-time: the announcer's send runs on the I/O loop
    [results] = [message for message in chat.messages if "completed" in message.text]
    assert results.text.startswith("2 sub-agent tasks completed:")


# -- a run ending as its watchdog fires, and replay (claims that hold) ----------------------


def test_a_result_returned_as_the_watchdog_fires_is_told_once_and_verifies(
    rt: Runtime, clock: FakeClock, store: EventStore, chat: MemoryChannel
) -> None:
    """The work returns as the FakeClock advance fires the watchdog: whichever the actor
    folds first wins, the run is told to its parent once, and ``replay --verify`` finds
    every decision re-derivable whichever way the race went."""
    release = threading.Event()

    async def work(report: RunReport) -> str:
        report.progress(40, step=2)
        await anyio.to_thread.run_sync(release.wait, GUARD)
        return "just in time"

    handle = rt.spawn("p1", "format the table", task_class="formatting", channel="chat", work=work)
    log_until(store, handle.stream, has(SubagentProgress))  # the watchdog is armed
    limit_s = rt.config.subagents.class_timeouts_ms.formatting / 1000
    release.set()
    clock.advance(limit_s)
    ended = handle.result(GUARD)

    def settled(records: list[Any]) -> bool:
        if ended.outcome == "succeeded":
            return has(SubagentCompleted)(records)
        return has(SubagentRecoveryDecided)(records)

    records = log_until(store, handle.stream, settled)
    # a result that lost the race to the cancel is not recorded; one that won is, once
    assert len(of(SubagentCompleted, records)) <= 1
    assert len(of(SubagentWatchdogTimeout, records)) == (ended.outcome == "timed_out")
    if ended.outcome == "timed_out":
        [decided] = of(SubagentRecoveryDecided, records)
        # decided before or after the late result landed: both are re-derivable
        assert decided.action in ("deliver", "respawn_continue")
    rt.close()
    report = verify_store(store, None)
    assert report.clean, report.findings
