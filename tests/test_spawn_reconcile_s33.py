"""Session 33: a ``spawn_subagent`` call a crash cut short is reconciled from the log.

The tool names its run after the call (``call_run_id`` of the call's idempotency key) and
records the key on ``subagent:spawned`` (``call_key``); its ``reconcile`` check reads
that run and the attempts its recovery started after it, and answers what the call would
have answered, waiting while the lineage is still in play. Real parts: an LMDB directory
and a PostgreSQL schema, the loopback ``FakeProvider``, a ``FakeClock``-driven Runtime,
and worker processes SIGKILLed mid-turn (the crash scenarios' child).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.actors import failure_notice
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import (
    ActivationLeased,
    ActivationReady,
    Event,
    MessageAppended,
    RecordedEvent,
    SessionCreated,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentRecoveryDecided,
    SubagentSpawned,
    ToolCall,
    ToolCompleted,
    ToolStarted,
    TurnStarted,
)
from stalwart.runtime import Runtime, send_message
from stalwart.runtime._tools import call_run_id
from stalwart.store import EventStore, Fence, NewEvent
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import (
    advance_until,
    agent_settings,
    of,
    runtime_config,
    until,
)
from tests.test_crash_scenarios_s33 import (
    WAIT,
    Worker,
    check_invariants,
    count,
    restart,
    workers,  # noqa: F401  (the fixture)
)

KEY = "session:s1/c1"
TASK = "format the report"
SUB_ANSWER = "the formatted report"
RUN_LIMIT_MS = 10_000  # the crashed run's own limit: a ghost is swept 15-20 s after it


@pytest.fixture(params=["lmdb", "postgres"])
def log(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[EventStore]:
    """The store, on LMDB and on PostgreSQL (the check reads through the protocol only)."""
    if request.param == "lmdb":
        location = str(tmp_path / "store")
    else:
        location = request.getfixturevalue("pg_url")
    opened = store_module.open(location, clock=clock)
    try:
        yield opened
    finally:
        opened.close()


def config(base_url: str) -> Config:
    """``default`` spawns sub-agents; a model call has minutes of the fake clock (the
    test moves it while a run's call is in flight); ghosts are swept soon."""
    agent = agent_settings(prompt_timeout_ms=600_000, subagents=True)
    subagents = {"ghost_grace_ms": 5_000, "ghost_sweep_interval_ms": 5_000}
    return runtime_config(base_url, agents={"default": agent}, subagents=subagents)


def _crashed_mid_spawn(store: EventStore, clock: FakeClock) -> None:
    """The parent's log a process leaves when it dies while a ``spawn_subagent`` call of
    its turn waits on the run."""
    arguments = json.dumps({"task": TASK, "task_class": "formatting"})
    call = ToolCall(id="c1", name="spawn_subagent", arguments=arguments)
    events = [
        SessionCreated(agent="default", channel="chat"),
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="format it"),
        ActivationLeased(activation_id="a1", owner="dead", epoch=1, expires_at=clock.now() - 1),
        TurnStarted(turn_id="t1", trigger="message"),
        MessageAppended(message_id="m1", role="user", content="format it", turn_id="t1"),
        MessageAppended(message_id="x", role="assistant", tool_calls=(call,), turn_id="t1"),
        ToolStarted(
            call_id="c1", tool="spawn_subagent", arguments=arguments, idempotency_key=KEY,
            turn_id="t1",
        ),
    ]  # fmt: skip
    store.append("session:s1", events, fence=Fence(1, claim=True))


def _spawned(*, attempt: int = 1, next_run_id: str, call_key: str | None) -> SubagentSpawned:
    return SubagentSpawned(
        parent="s1",
        task=TASK,
        task_class="formatting",
        timeout_ms=RUN_LIMIT_MS,
        attempt=attempt,
        timeout_knob="class_timeouts_ms.formatting",
        channel="chat",
        conversation="s1",
        announce=False,
        host_work=False,
        next_run_id=next_run_id,
        call_key=call_key,
    )


def _run(store: EventStore, run_id: str, *events: Event) -> None:
    store.append(f"session:{run_id}", [NewEvent(event=event) for event in events])


def _runs(store: EventStore) -> dict[str, SubagentSpawned]:
    """Every run in the log: its stream and its spawn."""
    found = {}
    for info in store.streams():
        first = next(iter(store.read_stream(info.stream, 1, 1)))
        if isinstance(first.event, SubagentSpawned):
            found[info.stream] = first.event
    return found


def _tool_result(fake: FakeProvider, call_id: str) -> str:
    """What the parent's model read as the result of call ``call_id`` (the newest request
    that holds it)."""
    for request in reversed(fake.requests):
        for message in reversed(request.body["messages"]):
            if message.get("role") == "tool" and message.get("tool_call_id") == call_id:
                return str(message["content"])
    raise AssertionError(f"no request holds the result of {call_id}")


def _reply(chat: MemoryChannel) -> str:
    """The parent's answer, once delivered (a run's failure notice may come before it)."""
    replies = until(lambda: [m.text for m in chat.messages if m.kind == "reply"])
    return str(replies[0])


def _completed(store: EventStore, call_id: str) -> ToolCompleted:
    [done] = [
        e for e in of(ToolCompleted, list(store.read_stream("session:s1"))) if e.call_id == call_id
    ]
    return done


# -- the check, in one process on a FakeClock ----------------------------------------------------


# Was: DEFECT: a spawn_subagent call cut short after its run succeeded was told `unreconciled`
def test_a_cut_short_spawn_whose_run_succeeded_answers_with_its_result(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    _crashed_mid_spawn(log, clock)
    first = call_run_id(KEY)
    _run(log, first, _spawned(next_run_id="n1", call_key=KEY), SubagentCompleted(result=SUB_ANSWER))
    fake.add(Answer(text="Here is the report."))
    with Runtime(config(fake.base_url), store=log, clock=clock, channels={"chat": chat}):
        reply = _reply(chat)
    assert reply == "Here is the report."
    assert _tool_result(fake, "c1") == SUB_ANSWER
    assert _completed(log, "c1").reconciled
    assert list(_runs(log)) == [f"session:{first}"]  # no second run


@pytest.mark.parametrize("second", ["succeeded", "escalated"])
def test_a_cut_short_spawn_follows_its_runs_lineage_to_its_end(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, second: str
) -> None:
    """The first run was swept and respawned; the answer is the attempt's that ended the
    lineage: its result, or the static notice of the last attempt."""
    _crashed_mid_spawn(log, clock)
    first = call_run_id(KEY)
    respawn = SubagentRecoveryDecided(action="respawn", reason="no_work")
    swept = SubagentGhostSwept(started_at=clock.now(), grace_ms=5_000, elapsed_ms=15_000)
    _run(log, first, _spawned(next_run_id="n1", call_key=KEY), swept, respawn)
    if second == "succeeded":
        ended: list[Event] = [SubagentCompleted(result="the second attempt's report")]
        expected = "the second attempt's report"
    else:
        escalate = SubagentRecoveryDecided(action="escalate", reason="max_attempts", attempt=2)
        ended = [SubagentCompleted(outcome="failed"), escalate]
        expected = failure_notice(TASK, "failed", 0)
    _run(log, "n1", _spawned(attempt=2, next_run_id="n2", call_key=None), *ended)
    fake.add(Answer(text="Done."))
    with Runtime(config(fake.base_url), store=log, clock=clock, channels={"chat": chat}):
        _reply(chat)
    assert _tool_result(fake, "c1") == expected
    assert set(_runs(log)) == {f"session:{first}", "session:n1"}


# Was: DEFECT: a spawn_subagent call cut short while its run ran lost the run's answer
def test_a_cut_short_spawn_waits_for_the_recovery_of_the_run_the_crash_orphaned(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The dead process's run is a ghost: the supervisor sweeps it once the clock passes
    its limit and grace, its recovery respawns it, and the call answers with the
    respawn's result."""
    _crashed_mid_spawn(log, clock)
    first = call_run_id(KEY)
    _run(log, first, _spawned(next_run_id="n1", call_key=KEY))
    fake.add(Answer(text="the respawn's report"), Answer(text="Done."))
    with Runtime(config(fake.base_url), store=log, clock=clock, channels={"chat": chat}):
        advance_until(clock, lambda: log.stream_version("session:n1") > 0, 1.0)
        reply = _reply(chat)
    assert reply == "Done."
    assert _tool_result(fake, "c1") == "the respawn's report"
    assert _completed(log, "c1").reconciled
    runs = _runs(log)
    assert set(runs) == {f"session:{first}", "session:n1"}
    assert runs["session:n1"].attempt == 2  # the recovery's attempt, not a second spawn


# Was: DEFECT: a spawn_subagent call cut short before its spawn was recorded never ran
def test_a_cut_short_spawn_with_no_run_in_the_log_spawns_it_named_after_the_call(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    _crashed_mid_spawn(log, clock)
    fake.add(Answer(text=SUB_ANSWER), Answer(text="Done."))
    with Runtime(config(fake.base_url), store=log, clock=clock, channels={"chat": chat}):
        _reply(chat)
    assert _tool_result(fake, "c1") == SUB_ANSWER
    assert not _completed(log, "c1").reconciled  # the call ran
    [(stream, spawned)] = _runs(log).items()
    assert (stream, spawned.call_key) == (f"session:{call_run_id(KEY)}", KEY)


# -- end to end: a worker SIGKILLed while its turn waits on two runs ------------------------------


def _killed_with_one_run_done(store_dir: Path, worker: Worker, fake: FakeProvider) -> None:
    """SIGKILL ``worker`` once both runs are spawned, each has called its model and one
    has completed (the other's call hangs, so the step's outcomes are not recorded)."""
    both = count("subagent:spawned", 2)
    done = count("subagent:completed")
    give_up = time.monotonic() + WAIT
    with store_module.open(store_dir, read_only=True) as reader:
        while True:
            head = reader.head()
            records = list(reader.read_all()) if head else []
            if both(records) and done(records) and len(fake.requests) >= 3:
                worker.kill()
                return
            assert worker.proc.poll() is None, "the worker died by itself"
            assert time.monotonic() < give_up, f"never reached: {[r.type for r in records]}"
            reader.wait_for(head + 1, 0.05)


def _by_call(records: list[RecordedEvent]) -> dict[str, list[RecordedEvent]]:
    """Each run's records, by the call key its lineage's first run recorded."""
    streams: dict[str, list[RecordedEvent]] = {}
    for record in records:
        streams.setdefault(record.stream, []).append(record)
    return {
        r[0].event.call_key: r
        for r in streams.values()
        if isinstance(r[0].event, SubagentSpawned) and r[0].event.call_key
    }


# Was: DEFECT: spawn_subagent calls a SIGKILL cut short were `unreconciled` after the restart
@pytest.mark.slow  # worker processes started, killed and restarted
def test_a_worker_killed_while_its_turn_waits_on_runs_gives_the_model_their_answers(
    tmp_path: Path,
    workers: list[Worker],  # noqa: F811
) -> None:
    """The parent's model spawns two runs in one step; one has completed and the other's
    model call hangs when the worker is SIGKILLed. After the restart the parent's model
    reads the completed run's answer and, once the orphaned run is swept and respawned,
    the respawn's answer; no call spawned a second run."""
    store_dir = tmp_path / "store"
    calls = tuple(
        FakeToolCall(id=f"c{n}", name="spawn_subagent",
                     arguments={"task": f"format part {n}", "task_class": "formatting"})
        for n in (1, 2)
    )  # fmt: skip
    with FakeProvider() as fake:
        fake.add(Answer(text="", tool_calls=calls), Answer(text="the quick run's report"), Hang())
        worker = Worker(store_dir, fake, tmp_path)
        workers.append(worker)
        with store_module.open(store_dir) as store:
            acknowledged = [send_message(store, "s1", "format both parts", channel="chat")]
        _killed_with_one_run_done(store_dir, worker, fake)
        fake.add(Answer(text="the respawn's report"))
        fake.set_default(Answer(text="both parts are formatted"))
        restart(store_dir, fake, tmp_path)
        results = {call: _tool_result(fake, call) for call in ("c1", "c2")}
    check_invariants(store_dir, tmp_path, acknowledged)
    with store_module.open(store_dir, read_only=True) as store:
        lineages = _by_call(list(store.read_all()))
        runs = _runs(store)
        parent = list(store.read_stream("session:s1"))
    assert set(lineages) == {"session:s1/c1", "session:s1/c2"}
    assert sorted(results.values()) == ["the quick run's report", "the respawn's report"]
    for call, result in results.items():
        first = lineages[f"session:s1/{call}"]
        assert first[0].stream == f"session:{call_run_id(f'session:s1/{call}')}"
        completed = [r.event for r in first if isinstance(r.event, SubagentCompleted)]
        if result == "the quick run's report":
            assert [c.result for c in completed] == [result]  # done before the kill
    assert sorted(spawned.attempt for spawned in runs.values()) == [1, 1, 2]
    reconciled = [e for e in of(ToolCompleted, parent) if e.tool == "spawn_subagent"]
    assert {e.call_id for e in reconciled if e.reconciled} == {"c1", "c2"}
