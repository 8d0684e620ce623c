"""``replay --verify`` and a deadline whose own setting the recorded config holds as no
number (session 34).

A ``runtime:started`` record written by hand or by another program may hold text where a
number belongs (``subagents.ghost_grace_ms = "600000"``). A deadline that setting sets
cannot be watched: verify says so once per deadline and stream, only where something was
pending on it (NOT WATCHED), and verifies the rest. Tests marked ``# Was: DEFECT:``
failed on the code they were written against. Real parts: LMDB stores in temporary
directories, logs written with the store's own ``append``, the CLI's ``verify_store`` and
``render``, and once the real ``stalwart`` command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stalwart import store as store_module
from stalwart.cli._replay import render, verify_store
from stalwart.config import parse_config
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    Event,
    ExecutionAborted,
    ProviderRecovered,
    RuntimeStarted,
    SessionCreated,
    SubagentCompleted,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    TurnCompleted,
    TurnStarted,
)
from stalwart.state import VerifyReport
from stalwart.store import NewEvent
from tests.test_cli_read_review import stalwart
from tests.test_restarts_verify_s34 import _gave_up

T0 = 1_800_000_000.0
HOUR = 3_600.0


def _config(section: str = "", knob: str = "", value: object = None) -> dict[str, Any]:
    """This version's config record (max_restarts 0: a crash gives up at once), with
    ``section.knob = value`` when given (a record written by hand or another program)."""
    record = parse_config({"supervision": {"max_restarts": 0}}).to_record()
    if section:
        record[section][knob] = value
    return record


def _started(config: dict[str, Any]) -> RuntimeStarted:
    return RuntimeStarted(config=config, stalwart_version="test")


def _write(store_dir: Path, *entries: tuple[float, str, Event]) -> None:
    """``entries`` (time, stream, event) appended in order."""
    with store_module.open(store_dir) as store:
        for ts, stream, event in entries:
            store.append(stream, [NewEvent(event=event, ts=ts)])


def _verify(store_dir: Path, *entries: tuple[float, str, Event]) -> VerifyReport:
    """A store whose log is ``entries``, verified whole."""
    _write(store_dir, *entries)
    with store_module.open(store_dir, read_only=True) as store:
        return verify_store(store, None)


def _found(report: VerifyReport) -> list[tuple[str, str, str, int]]:
    return [(f.kind, f.stream, f.tag, f.position) for f in report.findings]


def _spawned(max_steps: int | None = None) -> SubagentSpawned:
    return SubagentSpawned(
        parent="p", task="t", task_class="custom", timeout_ms=60_000, max_steps=max_steps
    )


def _not_a_number(knob: str, shown: str) -> str:
    return f"the config in force has {knob!r} = {shown}, not a number"


# -- 1. a sub-agent run's ghost grace -------------------------------------------------------


# Was: DEFECT: ghost_grace_ms recorded as text left every run's ghost sweep silently unwatched
def test_a_ghost_grace_recorded_as_text_is_reported_once_per_run_that_was_running(
    tmp_path: Path,
) -> None:
    """Run 1 hangs for hours, run 2 ends in time, run 3's watchdog fires 30 s early;
    the chat session has no run. Run 1's ghost sweep is NOT WATCHED once (it cannot be
    judged); runs 2 and 3 ended before their own limit, before any grace could make them
    ghosts (session 35: they were reported too); the chat session has none, and the rest
    is verified: run 3's early watchdog, run 1's missed one."""
    early = SubagentWatchdogTimeout(
        deadline=T0 + 80, limit_ms=60_000, knob="timeout_ms", elapsed_ms=30_000
    )
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("subagents", "ghost_grace_ms", "600000"))),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 2, "session:run-2", _spawned()),
        (T0 + 10, "session:run-2", SubagentCompleted(result="done")),
        (T0 + 20, "session:run-3", _spawned()),
        (T0 + 50, "session:run-3", early),
        (T0 + HOUR, "session:chat", SessionCreated(channel="chat")),
        (T0 + 2 * HOUR, "session:chat", TurnStarted(turn_id="t1")),
        (T0 + 2 * HOUR, "session:chat", TurnCompleted(turn_id="t1")),
    )
    assert _found(report) == [
        ("unwatched", "session:run-1", "subagent:ghost_swept", 2),
        ("mismatch", "session:run-3", "subagent:watchdog_timeout", 6),
        ("missed", "session:run-1", "subagent:watchdog_timeout", 7),  # its own limit's
    ]
    hung = report.findings[0]
    assert hung.message == (
        "the ghost sweep of session:run-1 cannot be watched: "
        + _not_a_number("subagents.ghost_grace_ms", "'600000'")
        + ", so when its subagent:ghost_swept falls due, and whether it came in time, "
        "cannot be said; subagent:spawned at position 2 left it pending"
    )
    assert hung.expected == [{"type": "subagent:ghost_swept", "due": None}]
    lines = render(report, "all streams", as_json=False)
    assert "NOT WATCHED  position 2  session:run-1 v1  subagent:ghost_swept  " in lines[3]
    assert lines[-1] == (
        "NOT CLEAN: 1 decision that does not follow, 1 missed deadline, 1 deadline not watched"
    )
    [shown] = render(report, "all streams", as_json=True)
    assert json.loads(shown)["findings"][0]["expected"] == [
        {"type": "subagent:ghost_swept", "due": None}
    ]


# -- 2. a turn's execution timeout, and the decision's own check ----------------------------


# Was: DEFECT: execution_timeout_ms recorded as text left a hung turn's timeout silently unwatched
def test_an_execution_timeout_recorded_as_text_is_reported_where_a_turn_ran(
    tmp_path: Path,
) -> None:
    """Session a's turn hangs: NOT WATCHED once, although two more of its turns follow.
    Session b's ends after a second, sooner than any timeout could be late (session 35:
    it was reported too). Session c's turn was aborted by its timeout: that decision's
    own check says it cannot be re-run (its deadline is not reported twice). Session d ran
    no turn: nothing."""
    aborted = ExecutionAborted(
        reason="pipeline_timeout", turn_id="t1", limit_ms=600_000, elapsed_ms=600_000
    )
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("supervision", "execution_timeout_ms", "600000"))),
        (T0 + 1, "session:a", TurnStarted(turn_id="t1")),
        (T0 + 2, "session:b", TurnStarted(turn_id="t1")),
        (T0 + 3, "session:b", TurnCompleted(turn_id="t1")),
        (T0 + 4, "session:c", TurnStarted(turn_id="t1")),
        (T0 + 604, "session:c", aborted),
        (T0 + 605, "session:c", TurnCompleted(turn_id="t1", outcome="aborted")),
        (T0 + HOUR, "session:d", SessionCreated(channel="chat")),
        (T0 + HOUR, "session:a", TurnCompleted(turn_id="t1")),
        (T0 + HOUR, "session:a", TurnStarted(turn_id="t2")),
        (T0 + HOUR, "session:a", TurnCompleted(turn_id="t2")),
    )
    assert _found(report) == [
        ("unwatched", "session:a", "execution:aborted", 2),
        ("mismatch", "session:c", "execution:aborted", 6),
    ]
    knob = _not_a_number("supervision.execution_timeout_ms", "'600000'")
    assert report.findings[0].message.startswith(
        f"the execution timeout of session:a cannot be watched: {knob}, so when its "
        "execution:aborted falls due"
    )
    assert report.findings[1].message == f"replay could not re-run the decision: {knob}"


# -- 3. a run's watchdog: the step budget's knob ---------------------------------------------


# Was: DEFECT: per_step_timeout_ms as text hid the missed watchdog of a run it does not bind
def test_a_per_step_knob_recorded_as_text_leaves_runs_with_no_step_budget_watched(
    tmp_path: Path,
) -> None:
    """A run spawned with no ``max_steps`` is bound by its own limit alone: its watchdog
    is still watched, and missed. A run with a step budget cannot be: NOT WATCHED."""
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("subagents", "per_step_timeout_ms", "60000"))),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 2, "session:run-2", _spawned(max_steps=3)),
        (T0 + 100, "session:chat", SessionCreated(channel="chat")),
        (T0 + 101, "session:chat", TurnStarted(turn_id="t1")),
        (T0 + 102, "session:run-1", SubagentCompleted(result="late")),
        (T0 + 103, "session:run-2", SubagentCompleted(result="done")),
    )
    assert _found(report) == [
        ("unwatched", "session:run-2", "subagent:watchdog_timeout", 3),
        ("missed", "session:run-1", "subagent:watchdog_timeout", 4),
    ]
    assert _not_a_number("subagents.per_step_timeout_ms", "'60000'") in (report.findings[0].message)
    assert report.findings[1].message.startswith(
        "the sub-agent watchdog was due at 2027-01-15T08:01:01.000Z"
    )


# -- 4. across processes ------------------------------------------------------------------


# Was: DEFECT: a sweep owed across a process whose config held its grace as text was forgotten
def test_a_ghost_sweep_owed_through_a_process_with_no_number_is_owed_by_the_next(
    tmp_path: Path,
) -> None:
    """Run 1 hangs. The next process records ``ghost_grace_ms`` as text: the sweep it owes
    is NOT WATCHED (said at its start; it lived past the run's limit and a sweep). The
    process after it records a number again: it owes the sweep from its start, and a log
    going on for an hour without it missed it."""
    good = _config()
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(good)),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 10, "runtime", _started(_config("subagents", "ghost_grace_ms", "x"))),
        (T0 + 200, "session:other", SessionCreated(channel="chat")),
        (T0 + 210, "runtime", _started(good)),
        (T0 + HOUR, "session:chat", SessionCreated(channel="chat")),
        (T0 + HOUR + 1, "session:chat", TurnStarted(turn_id="t1")),
    )
    assert _found(report) == [
        ("unwatched", "session:run-1", "subagent:ghost_swept", 3),
        ("missed", "session:run-1", "subagent:ghost_swept", 6),
    ]
    assert report.findings[0].message.endswith(
        "runtime:started at position 3 in runtime left it pending"
    )


# -- 5. a give-up notice's resend ---------------------------------------------------------


# Was: DEFECT: a sweep interval recorded as text left a give-up notice's resend silently unwatched
def test_a_give_up_notice_resend_with_no_number_for_its_sweep_is_not_watched(
    tmp_path: Path,
) -> None:
    """The resend's time reads the sweep's interval too (a notice too old once a sweep
    could come is not owed): recorded as text, the notice whose send never ended is NOT
    WATCHED, naming the knob, where before nothing was said."""
    config = _config("subagents", "heartbeat_interval_ms", "15000")
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(config)),
        *_gave_up(T0 + 1),
        (T0 + 600, "session:chat", SessionCreated(channel="chat")),
        (T0 + 601, "session:chat", TurnStarted(turn_id="t1")),
    )
    assert _found(report) == [("unwatched", "runtime", "announcement:resent", 3)]
    assert _not_a_number("subagents.heartbeat_interval_ms", "'15000'") in (
        report.findings[0].message
    )


# -- 6. a knob only a mismatch's words read -----------------------------------------------


# Was: DEFECT: a drain that did not follow, max_retries as text: verify stopped, "internal error"
def test_a_knob_only_the_explanation_reads_does_not_stop_the_verification(
    tmp_path: Path,
) -> None:
    """A drain retry inside the receiver's Retry-After does not follow; the words that say
    why read ``dead_letters.max_retries``, which the drain itself does not need. Recorded
    as text, the mismatch is still reported (with the knob named), the expiry the entry
    owes is NOT WATCHED, and the command ends with the report, not an error line."""
    queued = AnnouncementDeadLettered(
        entry_id="e1", announcement_id="a1", channel="chat", text="x", reason="r",
        retry_after_ms=600_000,
    )  # fmt: skip
    drain = AnnouncementDeadLetterRetried(entry_id="e1", attempt=1, reason="drain", provider="m")
    store_dir = tmp_path / "store"
    report = _verify(
        store_dir,
        (T0, "runtime", _started(_config("dead_letters", "max_retries", "5"))),
        (T0 + 1, "deadletter", queued),
        (T0 + 2, "provider:m", ProviderRecovered(provider="m", rule="probe")),
        (T0 + 3, "deadletter", drain),
        (T0 + HOUR, "session:chat", SessionCreated(channel="chat")),  # the entry still queued
    )
    found = [f for f in _found(report) if f[1] == "deadletter"]
    assert found == [
        ("unwatched", "deadletter", "announcement:dead_letter_expired", 2),
        ("mismatch", "deadletter", "announcement:dead_letter_retried", 4),
    ]
    [mismatch] = [f for f in report.findings if f.kind == "mismatch" and f.stream == "deadletter"]
    assert mismatch.message == (
        "the state just before it decides nothing at this time: why cannot be worked out: "
        + _not_a_number("dead_letters.max_retries", "'5'")
    )
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert (code, err) == (1, ""), out
    assert "DOES NOT FOLLOW  position 4  deadletter v2  announcement:dead_letter_retried" in out
