"""Session 34: a live ``spawn_subagent`` call answers with its run's lineage's outcome.

The call's first run may fail (its watchdog, a ghost sweep, the supervisor giving up on
its actor) and the supervisor's recovery respawn it (the next attempt is named by the
run's ``subagent:spawned`` ``next_run_id``). The runs are ``announce=False``: their answer
goes back through the parent's model, so the call answers with the attempt that
succeeded, or the last one's notice once the lineage ended (``escalate``, ``split``).
Real parts: an LMDB directory, the loopback ``FakeProvider``, a ``FakeClock``-driven
Runtime; ``replay --verify`` runs on every log the tests write.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pykka
import pytest

from stalwart.actors import FAILED_SENTENCE, TIMED_OUT_SENTENCE, failure_notice
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import (
    SubagentWatchdogTimeout,
    SupervisorGaveUp,
    SupervisorRestarted,
    ToolCompleted,
    TurnCompleted,
)
from stalwart.runtime import SPAWN_TOOL, Runtime
from stalwart.state import RUN, RunState
from stalwart.store import EventStore, load_state
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import (
    GUARD,
    advance_until,
    agent_settings,
    has,
    log_until,
    of,
    runtime_config,
    until,
)
from tests.test_spawn_reconcile_s33 import _reply, _runs, _tool_result

TASK = "format the report"
LIMIT_S = 120  # the formatting class's run limit


def config(base_url: str, **subagents: object) -> Config:
    """``default`` spawns sub-agents; a model call has minutes of the fake clock (the test
    moves it past a run's limit while that run's call hangs)."""
    agent = agent_settings(prompt_timeout_ms=3_600_000, subagents=True)
    return runtime_config(base_url, agents={"default": agent}, subagents=dict(subagents))


def _spawn_call() -> FakeToolCall:
    arguments = {"task": TASK, "task_class": "formatting"}
    return FakeToolCall(id="c1", name=SPAWN_TOOL, arguments=arguments)


def _attempt(store: EventStore, attempt: int) -> Callable[[], str | None]:
    """A check: the stream of the run of ``attempt`` once the log holds it."""

    def found() -> str | None:
        return next((s for s, e in _runs(store).items() if e.attempt == attempt), None)

    return found


def _verified(store: EventStore) -> None:
    report = verify_store(store, None)  # replay --verify: every decision follows
    assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]


def _timed_out(store: EventStore, stream: str) -> bool:
    return bool(of(SubagentWatchdogTimeout, list(store.read_stream(stream))))


def _first_attempt_timed_out(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """The parent is asked to format; the first attempt's model call hangs until its
    watchdog fires (the fake clock moved a second at a time)."""
    rt.session("s1", channel="chat").send("format it")
    first = until(_attempt(store, 1))
    fake.wait_for(lambda requests: len(requests) >= 2, GUARD)  # its model call hangs
    advance_until(clock, lambda: _timed_out(store, first), 1.0)


# Was: DEFECT: a spawn_subagent call whose first run timed out answered the notice; the retry's answer reached no one  # noqa: E501
def test_a_first_attempt_that_times_out_and_a_retry_that_succeeds_gives_the_retrys_answer(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.add(
        Answer(text="", tool_calls=(_spawn_call(),)),  # the parent spawns
        Hang(),  # the first attempt's model call never answers
        Answer(text="the retry's report"),  # the second attempt's
    )
    fake.set_default(Answer(text="Here is the report."))  # the parent, with the result
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        _first_attempt_timed_out(rt, store, clock, fake)
        reply = _reply(chat)
    assert _tool_result(fake, "c1") == "the retry's report"
    assert reply == "Here is the report."
    runs = _runs(store)
    assert sorted(spawned.attempt for spawned in runs.values()) == [1, 2]
    [done] = of(ToolCompleted, list(store.read_stream("session:s1")))
    assert done.output == "the retry's report"
    _verified(store)


# Was: DEFECT: a spawn_subagent call whose every attempt failed answered the first attempt's notice at once  # noqa: E501
def test_every_attempt_failing_gives_the_last_attempts_notice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The first attempt times out, the second fails (its model call refused): attempts
    are exhausted (2), the recovery escalates, and the call answers with the second
    attempt's notice, not the first's, once the lineage has ended."""
    fake.add(
        Answer(text="", tool_calls=(_spawn_call(),)),
        Hang(),  # the first attempt
        Fail(status=400),  # the second: its turn fails, and so does the run
    )
    fake.set_default(Answer(text="The sub-agent could not do it."))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        _first_attempt_timed_out(rt, store, clock, fake)
        reply = _reply(chat)
        second = until(_attempt(store, 2))
    result = _tool_result(fake, "c1")
    last = load_state(store, second, RUN, use_snapshots=False)
    assert last.status == "failed"
    assert last.recovery is not None
    assert last.recovery.action == "escalate"
    assert result == _notice_of(last)
    assert FAILED_SENTENCE in result
    assert TIMED_OUT_SENTENCE not in result
    assert reply == "The sub-agent could not do it."
    _verified(store)


def _notice_of(state: RunState) -> str:
    assert state.started_at is not None
    assert state.ended_at is not None
    return failure_notice(
        state.task, state.status, round((state.ended_at - state.started_at) * 1000)
    )


def _actor_of(rt: Runtime, run: str, not_this: object = None) -> pykka.ActorRef[Any] | None:
    """The run's actor now, unless it is ``not_this`` (the one that crashed)."""
    handle = rt.run(run)
    ref = handle.ref if handle is not None else None
    return ref if ref is not not_this else None


def _crash_until_given_up(rt: Runtime, store: EventStore, clock: FakeClock, run: str) -> None:
    """Crash the run's actor (a message it does not understand) at each of its restarts,
    until supervision gives up on it (the 4th crash in 5 s)."""
    for crash, backoff_ms in enumerate([100, 200, 400], 1):
        dying = until(partial(_actor_of, rt, run))
        dying.tell(object())
        log_until(store, "runtime", has(SupervisorRestarted, crash))
        rt.runs()  # the supervisor has armed the restart
        clock.advance(backoff_ms / 1000 + 0.001)
        until(partial(_actor_of, rt, run, dying))
    until(partial(_actor_of, rt, run)).tell(object())
    log_until(store, "runtime", has(SupervisorGaveUp))


# Was: DEFECT: a spawn_subagent call whose run's actor was given up on answered its notice; the retry's answer was lost  # noqa: E501
@pytest.mark.parametrize("attempts", [1, 2])
def test_a_run_given_up_on_ends_the_call_with_its_lineages_outcome(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, attempts: int
) -> None:
    """Supervision gives up on the first attempt's actor (it keeps crashing): the run is
    ``failed``. With one attempt allowed the recovery escalates and the call answers
    with its notice at once; with two, the retry's answer is the call's. Either way the
    parent's turn ends."""
    fake.add(Answer(text="", tool_calls=(_spawn_call(),)), Hang())
    if attempts == 2:
        fake.add(Answer(text="the retry's report"))
    fake.set_default(Answer(text="Done."))
    settings = config(fake.base_url, recovery_max_attempts=attempts)
    with Runtime(settings, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("format it")
        first = until(_attempt(store, 1))
        fake.wait_for(lambda requests: len(requests) >= 2, GUARD)  # its model call hangs
        _crash_until_given_up(rt, store, clock, first.removeprefix("session:"))
        reply = _reply(chat)
    given_up = load_state(store, first, RUN, use_snapshots=False)
    assert given_up.status == "failed"
    result = _tool_result(fake, "c1")
    if attempts == 1:
        assert given_up.recovery is not None
        assert given_up.recovery.action == "escalate"
        assert result == _notice_of(given_up)
    else:
        assert result == "the retry's report"
    assert reply == "Done."
    assert of(TurnCompleted, list(store.read_stream("session:s1")))
    _verified(store)
