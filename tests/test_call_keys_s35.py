"""Session 35: a tool call's idempotency key, and ``spawn_subagent``'s reconcile check.

A model that numbers its calls per response (``call_0`` on every turn) gives two calls
of one session the same id; the Agent gives the later one a fresh id, so each call's key
(``session:<id>/<call id>``) names one call only, and a run named after it is that
call's. A ``spawn_subagent`` call a crash cut short, resumed in a runtime whose
supervisor was given up on, answers with its run's notice instead of waiting for a
sweep no supervisor will make. Real parts: an LMDB directory, the loopback
``FakeProvider``, a ``FakeClock``-driven Runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.actors import SupervisorActor, failure_notice
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import SubagentSpawned, ToolCompleted, ToolStarted
from stalwart.runtime import SPAWN_TOOL, Runtime
from stalwart.runtime._tools import call_run_id
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import GUARD, advance_until, give_up_on, of, until
from tests.test_spawn_reconcile_s33 import (
    KEY,
    TASK,
    _completed,
    _crashed_mid_spawn,
    _reply,
    _run,
    _runs,
    _spawned,
    _tool_result,
    config,
)


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[EventStore]:
    opened = store_module.open(str(tmp_path / "store"), clock=clock)
    try:
        yield opened
    finally:
        opened.close()


def _spawn_call(task: str) -> FakeToolCall:
    """A ``spawn_subagent`` call under the id a per-response numbering gives every turn."""
    arguments = {"task": task, "task_class": "formatting"}
    return FakeToolCall(id="call_0", name=SPAWN_TOOL, arguments=arguments)


def _replies_now(chat: MemoryChannel) -> list[str]:
    return [m.text for m in chat.messages if m.kind == "reply"]


def _replies(chat: MemoryChannel, count: int) -> list[str]:
    return until(lambda: _replies_now(chat)[count - 1 :])


def test_a_call_id_reused_on_a_later_turn_gets_a_key_and_a_run_of_its_own(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Confirms the Agent's guard (not a defect): the second ``call_0`` is renamed, so
    its key, its run and its answer are its own, and the first call's run is not taken
    for it."""
    fake.add(Answer(text="", tool_calls=(_spawn_call("part one"),)), Answer(text="one done"))
    fake.add(Answer(text="first reply"))
    fake.add(Answer(text="", tool_calls=(_spawn_call("part two"),)), Answer(text="two done"))
    fake.add(Answer(text="second reply"))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("format part one")
        _replies(chat, 1)
        session.send("format part two")
        _replies(chat, 2)
    records = list(store.read_stream("session:s1"))
    started = of(ToolStarted, records)
    first, second = (event.call_id for event in started)
    assert first == "call_0"
    assert second != "call_0"  # renamed: the session used it before
    keys = [event.idempotency_key for event in started]
    assert keys == [f"session:s1/{first}", f"session:s1/{second}"]
    results = {event.call_id: event.output for event in of(ToolCompleted, records)}
    assert results == {first: "one done", second: "two done"}
    for key in keys:  # each call's run is named after its own key and records it
        [spawned] = of(SubagentSpawned, list(store.read_stream(f"session:{call_run_id(key)}")))
        assert spawned.call_key == key


def test_a_reused_call_id_cut_short_is_reconciled_from_its_own_run_not_the_earlier_ones(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Confirms the guard across a restart (not a defect): the runtime stops while the
    second ``call_0``'s run waits on its model; the next runtime's check finds that
    call's run (a ghost, swept and respawned), never the first call's finished one, and
    answers with the respawn's answer."""
    fake.add(Answer(text="", tool_calls=(_spawn_call("part one"),)), Answer(text="one done"))
    fake.add(Answer(text="first reply"))
    fake.add(Answer(text="", tool_calls=(_spawn_call("part two"),)), Hang())
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("format part one")
        _replies(chat, 1)
        session.send("format part two")
        fake.wait_for(lambda requests: len(requests) == 5, GUARD)  # the run's call hangs
    [_, second] = (e.call_id for e in of(ToolStarted, list(store.read_stream("session:s1"))))
    fake.add(Answer(text="two done on the retry"))
    fake.set_default(Answer(text="second reply"))
    clock.advance(31.0)  # past the stopped runtime's lease
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}):
        advance_until(clock, lambda: len(_replies_now(chat)) >= 2, 1.0)
    results = {e.call_id: e for e in of(ToolCompleted, list(store.read_stream("session:s1")))}
    assert results["call_0"].output == "one done"
    assert results[second].output == "two done on the retry"
    assert results[second].reconciled
    assert len(_runs(store)) == 3  # part one, part two, part two's respawn: no extra run


# Was: DEFECT: a spawn_subagent call a crash cut short waited out the turn for a ghost sweep no supervisor would make  # noqa: E501
def test_a_cut_short_spawn_answers_its_runs_notice_once_the_supervisor_is_given_up_on(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The dead process's run is a ghost only this runtime's supervisor would sweep; once
    supervision gave up on it, nothing here moves the run on: the call answers with the
    run's notice (as a live call does), not the turn's timeout text ten minutes later."""
    _crashed_mid_spawn(store, clock)
    _run(store, call_run_id(KEY), _spawned(next_run_id="n1", call_key=KEY))
    fake.set_default(Answer(text="Done."))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        until(lambda: rt.session("s1", channel="chat").status().waiting_for == "tools")
        give_up_on(rt, store, clock, SupervisorActor)
        reply = _reply(chat)
    assert reply == "Done."
    assert _tool_result(fake, "c1") == failure_notice(TASK, "failed", 0)
    assert _completed(store, "c1").reconciled
    assert store.stream_version("session:n1") == 0  # no second run
