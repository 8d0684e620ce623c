"""Review: a model-driven sub-agent run's own announcement and its outcome.

A model-driven run's Agent answers on a private MemoryChannel (``subagent:<run id>``) and
records that answer in the run's stream ``session:<run id>``: ``turn:completed`` and
``announcement:queued`` in one append, then the send on the I/O loop, whose outcome comes
back to the Agent as a message. The run's work follows the stream and, as soon as it sees
``turn:completed``, returned the answer and stopped the Agent (``subsession_work``'s
``finally``). The stop was usually in the Agent's mailbox before the send's outcome (about
8 runs in 10), so the outcome was never appended: the run's stream kept an announcement
queued for ever, and an Agent later opened on that stream sent it to the user.

Fixed: the run's follower ends once the turn ended and every announcement of the stream
has its outcome (at most ``SETTLE_S``, 5 s of real time, after the turn), and an Agent
never resends an announcement queued for a channel that is not its own.

Real parts: an LMDB store in ``tmp_path``, the fake provider on loopback, a ``FakeClock``
for every deadline, the command line through click's runner. Tests marked ``# Was:``
failed on the code reviewed; the others pin behaviour that is right and must stay so.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pykka
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import AGENT_VIEW, AgentActor, AgentStatus, SendsPending, left_unsaid
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    RecordedEvent,
)
from stalwart.runtime import Runtime
from stalwart.state import SUBSESSION_CHANNEL_PREFIX
from stalwart.store import EventStore, NewEvent, load_state
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import agent_settings, delivered, until

#: The longest a wait on other threads may take before the test fails (real seconds).
GUARD = 30.0
#: How many runs a test makes: the stop won the race about 8 times in 10, so with six
#: runs the reviewed code left at least one announcement without an outcome all but
#: certainly (the test failed), while correct code never does.
RUNS = 6


def _config(base_url: str) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": agent_settings()},
        }
    )


@pytest.fixture
def log(lmdb_store: EventStore) -> EventStore:
    """The store at ``store_dir``, on the fake clock (conftest's)."""
    return lmdb_store


def _until(check: Callable[[], Any], what: str) -> Any:
    """Poll ``check()`` (state other threads change) until it is true; fail after GUARD."""
    return until(check, GUARD, what=what)


def _agent_on(stream: str) -> bool:
    """Whether a live AgentActor runs ``stream`` (asked, as any caller asks an Agent)."""
    for ref in pykka.ActorRegistry.get_by_class(AgentActor):
        try:
            if ref.ask(AgentStatus(), timeout=5).session.stream == stream:
                return True
        except pykka.ActorDeadError:
            continue
    return False


def _private(records: list[RecordedEvent]) -> list[AnnouncementQueued]:
    """The run's own Agent's announcements (on its private ``subagent:<run>`` channel)."""
    return [
        r.event
        for r in records
        if isinstance(r.event, AnnouncementQueued)
        and r.event.channel.startswith(SUBSESSION_CHANNEL_PREFIX)
    ]


def _without_outcome(store: EventStore, stream: str) -> set[str]:
    """The announcements of ``stream`` queued with neither delivered nor send_failed."""
    records = list(store.read_stream(stream))
    queued = {r.event.announcement_id for r in records if isinstance(r.event, AnnouncementQueued)}
    ended = {
        r.event.announcement_id
        for r in records
        if isinstance(r.event, AnnouncementDelivered | AnnouncementSendFailed)
    }
    return queued - ended


def _batch_recorded(store: EventStore, run: str) -> bool:
    """Whether the run's stream holds the announcer's completion, and its outcome."""
    records = list(store.read_stream(f"session:{run}"))
    private = {queued.announcement_id for queued in _private(records)}
    batch = [
        r.event.announcement_id
        for r in records
        if isinstance(r.event, AnnouncementQueued) and r.event.announcement_id not in private
    ]
    return bool(batch) and not (_without_outcome(store, f"session:{run}") - private)


def _finished_runs(rt: Runtime, count: int, *, announce: bool) -> list[str]:
    """``count`` model-driven runs of parent ``p1``, one after another, each succeeded and
    its sub-session Agent stopped (after which nothing can append its send's outcome)."""
    runs = []
    for n in range(count):
        handle = rt.spawn("p1", f"task {n}", task_class="research", announce=announce)
        result = handle.result(GUARD)
        assert (result.outcome, result.result) == ("succeeded", f"answer {n}")
        runs.append(handle.run_id)
    for run in runs:
        _until(lambda run=run: not _agent_on(f"session:{run}"), f"the Agent of {run} stopped")
    return runs


def _script(fake: FakeProvider, count: int) -> None:
    fake.add(*(Answer(text=f"answer {n}") for n in range(count)))


def _cli(store_dir: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--store", str(store_dir), *args], catch_exceptions=False)
    return result.exit_code, result.stdout


# -- the defect ----------------------------------------------------------------------------


# Was: a run's Agent was stopped before its answer's send outcome was appended: queued for ever
def test_every_announcement_of_a_model_driven_run_gets_its_outcome(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """resilience.md: each message is ``announcement:queued`` first, then
    ``announcement:delivered`` or ``announcement:send_failed``. The run's answer was given
    to its private channel (the send cannot fail: a MemoryChannel), yet once its Agent
    stopped, most runs' streams hold the queued answer with no outcome, and the Agent's
    own fold (the ledger a restarted Agent resends from) counts it as unsent."""
    _script(fake, RUNS)
    with Runtime(_config(fake.base_url), store=log, clock=clock, channels={"chat": chat}) as rt:
        runs = _finished_runs(rt, RUNS, announce=False)
        for run in runs:  # each run's Agent did queue its answer, privately
            [queued] = _private(list(log.read_stream(f"session:{run}")))
            assert queued.kind == "completion"
        stuck = {run: _without_outcome(log, f"session:{run}") for run in runs}
        unsent = {
            run: sorted(load_state(log, f"session:{run}", AGENT_VIEW).ledger.unsent) for run in runs
        }
    without_outcome = {run: ids for run, ids in stuck.items() if ids}
    counted_unsent = {run: ids for run, ids in unsent.items() if ids}
    assert (without_outcome, counted_unsent) == ({}, {})


# Was: an Agent opened on a finished run resent the run's private answer to the user
def test_an_agent_started_on_a_finished_run_does_not_tell_the_user_its_private_answer(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A run is a session of its own, and the runtime opens it like one
    (``rt.session(run id, channel=...)``; ``stalwart status`` lists it among the
    sessions). The new Agent folds the run's stream, finds the answer queued with no
    outcome and, once a send could no longer be under way (35 s), sends it again: on its
    own channel, the user's, although the announcement was the run's private one. With
    the outcome recorded there would be nothing to send."""
    _script(fake, RUNS)
    with Runtime(_config(fake.base_url), store=log, clock=clock, channels={"chat": chat}) as rt:
        runs = _finished_runs(rt, RUNS, announce=False)  # nothing announced to the user
        clock.advance(60.0)  # past any send of the runs' Agents (timeout 30 s + grace 5 s)
        handles = [rt.session(run, channel="chat") for run in runs]
        for handle in handles:  # each Agent's start-up resends, if any, have ended
            _until(lambda h=handle: h.ref.ask(SendsPending(), timeout=5) == 0, "sends ended")
        leaked = [m.text for m in chat.messages]
        resent = [
            run
            for run in runs
            if any(
                isinstance(r.event, AnnouncementResent) for r in log.read_stream(f"session:{run}")
            )
        ]
    assert (leaked, resent) == ([], [])


# Was: an Agent resent a run's private answer (queued for subagent:<run>) on its own channel
def test_an_agent_never_resends_another_runs_private_answer(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Logs written before the run waited for its answer's outcome keep run streams with
    a private answer queued for ever (``subagent:<run>``). The start-up resend (a new
    runtime on the log) and the Agent's own resend must not send it on the Agent's
    channel: it was never the Agent's to say there. (Any other announcement is the
    session's news, whatever name its channel was recorded under:
    ``tests/test_snapshot_start_review.py``.)"""
    with Runtime(_config(fake.base_url), store=log, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").status()  # session:created, on "chat"
    queued = AnnouncementQueued(announcement_id="a1", channel="subagent:r1", text="private")
    log.append("session:s1", [NewEvent(event=queued, ts=clock.now())])
    clock.advance(60.0)  # past any send still under way (timeout 30 s + grace 5 s)
    assert not left_unsaid(log, "session:s1", clock.now())  # no start-up resend for it
    with Runtime(_config(fake.base_url), store=log, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.session("s1", channel="chat")
        handle.status()  # started: its start-up resend, if any, is under way
        _until(lambda: handle.ref.ask(SendsPending(), timeout=5) == 0, "sends ended")
        clock.advance(60.0)  # and any resend it put off is due
        handle.status()
        _until(lambda: handle.ref.ask(SendsPending(), timeout=5) == 0, "sends ended")
    assert [m.text for m in chat.messages] == []
    resent = [r for r in log.read_stream("session:s1") if isinstance(r.event, AnnouncementResent)]
    assert resent == []


# -- what it does not do: pinned ----------------------------------------------------------


def test_the_parent_hears_each_result_exactly_once_even_after_a_restart(
    log: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The run's result reaches the parent's user through the announcer's completion batch
    (on ``chat``), not through the run's private announcement. A stuck private announcement
    must neither hold that back nor bring it again: not from the supervisor's sweeps (its
    completion and notice watches skip the private channel), not from a new Runtime on the
    same log (``left_unsaid`` is false for a run's stream: it starts with
    ``subagent:spawned``), not through the dead-letter queue."""
    _script(fake, RUNS)
    config = _config(fake.base_url)
    channels: dict[str, Any] = {"chat": chat}
    with Runtime(config, store=log, clock=clock, channels=channels) as rt:
        rt.session("p1", channel="chat")
        runs = _finished_runs(rt, RUNS, announce=True)
        clock.advance(0.5)  # the batch's debounce
        [batch] = delivered(rt, chat, 1)
        for run in runs:  # the announcer recorded its send (as it would within seconds)
            _until(lambda run=run: _batch_recorded(log, run), f"the batch's outcome in {run}")
        clock.advance(200.0)  # past the announcer's and the supervisor's resend windows
        rt.runs()  # the supervisor handled its sweeps
    assert batch.conversation == "p1"
    for n in range(RUNS):
        assert batch.text.count(f"answer {n}") == 1
    head = log.head()
    now = clock.now()
    assert not any(left_unsaid(log, f"session:{run}", now) for run in runs)
    with Runtime(config, store=log, clock=clock, channels=channels) as rt:
        _until(
            lambda: not any(t.name == "stalwart-resend" for t in threading.enumerate()),
            "the start-up resend sweep ended",
        )
        for _ in range(4):
            clock.advance(60.0)  # the sweeps of the new supervisor
            rt.runs()
    assert [m.text for m in chat.messages] == [batch.text]
    touched = {r.stream for r in log.read_all(head + 1)}
    assert touched <= {"runtime", "session:p1"}
    assert list(log.read_stream("deadletter")) == []


def test_the_operator_tools_neither_show_nor_flag_the_runs_private_announcement(
    store_dir: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``stalwart status`` shows no dead letter and nothing pending for the run or its
    parent, ``stalwart incidents`` no failure, ``stalwart replay --verify --all`` a clean
    log: the private announcement is the run's internals, never reported as undelivered
    (nor is the defect above visible there: only ``tail`` and ``session events`` show
    the queued answer with no outcome)."""
    _script(fake, RUNS)
    with store_module.open(store_dir, clock=clock) as log:  # type: ignore[attr-defined]
        channels: dict[str, Any] = {"chat": chat}
        with Runtime(_config(fake.base_url), store=log, clock=clock, channels=channels) as rt:
            rt.session("p1", channel="chat")
            runs = _finished_runs(rt, RUNS, announce=True)
            clock.advance(0.5)
            delivered(rt, chat, 1)
    code, out = _cli(store_dir, "status", "--json")
    assert code == 0
    overview = json.loads(out)
    assert overview["dead_letters"]["announcements"] == []
    rows = {row["session"]: row for row in overview["sessions"]}
    for run in runs:
        assert rows[f"session:{run}"]["status"] == "run"
        assert rows[f"session:{run}"]["pending"] is None
    for session in (runs[0], "p1"):
        code, out = _cli(store_dir, "status", session, "--json")
        assert code == 0
        detail = json.loads(out)
        assert detail["pending"] is None
        assert detail["under_way"] == []
        assert detail["dead_letters"]["announcements"] == []
    code, out = _cli(store_dir, "incidents", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert sum(row["calls"] for row in rows) == RUNS  # the runs' model calls, all fine
    assert sum(row["failed"] + row["timeouts"] for row in rows) == 0
    code, out = _cli(store_dir, "replay", "--verify", "--all")
    assert code == 0, out
    assert "clean" in out
