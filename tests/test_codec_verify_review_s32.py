"""Review of ``stalwart replay --verify`` (session 32): a log it crashed on, a cut that
turned a decision made in time into a missed deadline, and records it took at their
word or passed over in silence.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against. Real parts
only: LMDB stores in temporary directories, the CLI through a real subprocess of
``python -m stalwart`` where the exit code and stderr are what is under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.config import MAX_KNOB
from stalwart.errors import EventError
from stalwart.events import (
    ActivationLeased,
    ActivationReady,
    Codec,
    Event,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    RuntimeStarted,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from stalwart.state import VerifyReport
from stalwart.store import open as open_store
from tests.test_cli_read_review import T0, append, damage, position, stalwart

RUN = "session:run-1"


def _verify(store_dir: Path, stream: str | None = None, until: int | None = None) -> VerifyReport:
    with open_store(store_dir, create=False, read_only=True) as store:
        return verify_store(store, stream, until=until)


def _found(report: VerifyReport) -> list[tuple[str, int, str, str]]:
    return [(f.kind, f.position, f.stream, f.tag) for f in report.findings]


def _spawned(timeout_ms: int = 120_000, max_steps: int | None = None) -> SubagentSpawned:
    return SubagentSpawned(
        parent="p",
        task="t",
        task_class="custom",
        timeout_ms=timeout_ms,
        max_steps=max_steps,
        timeout_knob="custom_timeout_ms",
    )


def _watchdog(elapsed_ms: int) -> SubagentWatchdogTimeout:
    return SubagentWatchdogTimeout(
        deadline=T0 + 120, limit_ms=120_000, knob="custom_timeout_ms", elapsed_ms=elapsed_ms
    )


# -- 1. times no calendar holds, numbers no arithmetic takes ----------------------------------


# Was: DEFECT: a run whose limit is the largest knob a config takes: replay --verify internal error.
def test_a_deadline_thousands_of_years_away_is_shown_as_a_number_not_an_internal_error(
    store_dir: Path,
) -> None:
    # a run limited by a knob at its ceiling (MAX_KNOB ms: about 285,000 years) whose
    # watchdog fired after 10 s: the report words its deadline, past any calendar
    append(
        store_dir,
        RUN,
        _spawned(timeout_ms=MAX_KNOB),
        SubagentWatchdogTimeout(
            deadline=T0 + 10, limit_ms=10_000, knob="custom_timeout_ms", elapsed_ms=10_000
        ),
        ts=T0,
    )
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert "internal error" not in err, err
    assert code == 1, (out, err)
    assert f"DOES NOT FOLLOW  position 2  {RUN} v2  subagent:watchdog_timeout" in out
    deadline = T0 + MAX_KNOB / 1000
    assert f"the deadline is {deadline} (started + {MAX_KNOB} ms, custom_timeout_ms)" in out


# Was: DEFECT: an infinite or NaN float in a decision crashes replay --verify (OverflowError).
def test_infinite_and_nan_floats_in_decisions_are_findings_not_crashes(store_dir: Path) -> None:
    # a lease said to expire at -inf (a takeover "due" before time began), and a 429's
    # retry waiting a NaN Retry-After: both decodable, neither what any policy gives
    append(
        store_dir,
        "session:s1",
        ActivationReady(activation_id="a1", kind="message", text="hi"),
        ActivationLeased(activation_id="a1", owner="w1", epoch=1, expires_at=float("-inf")),
        ts=T0,
    )
    append(
        store_dir,
        "session:s2",
        PromptStarted(call_id="c1", provider="main", model="m"),
        PromptFailed(call_id="c1", error_class="rate_limited", status=429, retryable=True),
        PromptRetryScheduled(
            call_id="c1",
            attempt=2,
            delay_ms=0,
            reason="rate_limited",
            agent="default",
            status=429,
            retry_after_s=float("nan"),
        ),
        ts=T0 + 100,
    )
    report = _verify(store_dir)
    assert _found(report) == [
        ("mismatch", 2, "session:s1", "activation:leased"),
        ("mismatch", 5, "session:s2", "prompt:retry_scheduled"),
    ]
    assert report.findings[1].message == (
        "replay could not re-run the decision: a number the log holds is out of range (ValueError)"
    )
    # and the CLI says so in words, exit 1
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert (code, "internal error" in err) == (1, False), err
    assert "NOT CLEAN: 2 decisions that do not follow" in out


# -- 2. --until at a moment several events share ----------------------------------------------


def _late_watchdog_at_the_moment_of_its_proof(store_dir: Path, decision: Event) -> None:
    """A run due at 120 s (+ 5 s grace); at 200 s another stream's event proves it late
    (position 3), and at that same moment (a clock that jumped) ``decision`` comes
    (position 4); a later event at 300 s."""
    append(store_dir, RUN, _spawned(), SubagentProgress(tokens=5, step=1), ts=T0)
    append(store_dir, "session:other", SubagentProgress(tokens=1, step=1), ts=T0 + 200)
    append(store_dir, RUN, decision, ts=T0 + 200)
    append(store_dir, "session:other", SubagentProgress(tokens=2, step=2), ts=T0 + 300)


# Was: DEFECT: --until at the proof of a decision made at that moment reports a missed deadline.
def test_until_the_event_that_a_decision_at_its_moment_follows_is_clean(store_dir: Path) -> None:
    _late_watchdog_at_the_moment_of_its_proof(store_dir, _watchdog(elapsed_ms=200_000))
    assert _verify(store_dir).clean  # the whole log: made at the proof's moment, not missed
    for until in (1, 2, 3, 4, 5):
        assert _found(_verify(store_dir, until=until)) == [], until
        assert _found(_verify(store_dir, RUN, until=until)) == [], until
    result = CliRunner().invoke(
        cli, ["--store", str(store_dir), "replay", "--all", "--verify", "--until", "3"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == (
        "verify all streams: 3 events, up to position 3, 0 decisions re-derived"
    )


# Was: DEFECT: --until at the proof of a run that ended at that moment reports a missed watchdog.
def test_until_the_proof_of_a_run_that_ended_at_that_moment_is_clean_too(
    store_dir: Path,
) -> None:
    _late_watchdog_at_the_moment_of_its_proof(store_dir, SubagentCompleted(result="done"))
    assert _verify(store_dir).clean
    assert _verify(store_dir, until=3).clean


def test_until_the_proof_of_a_watchdog_that_never_came_still_reports_it(
    store_dir: Path,
) -> None:
    _late_watchdog_at_the_moment_of_its_proof(store_dir, SubagentProgress(tokens=9, step=2))
    missed = [("missed", 3, RUN, "subagent:watchdog_timeout")]
    assert _found(_verify(store_dir)) == missed
    for until in (3, 4, 5):  # the cut at the proof, the event at its moment, after both
        assert _found(_verify(store_dir, until=until)) == missed, until
    assert _found(_verify(store_dir, until=2)) == []  # cut before the proof


# -- 3. what the verdict rests on ---------------------------------------------------------------


def _started(per_step: object) -> RuntimeStarted:
    return RuntimeStarted(
        stalwart_version="9", config={"subagents": {"per_step_timeout_ms": per_step}}
    )


def _one_step_run_watched_at(store_dir: Path, per_step: object, fired_ms: int) -> None:
    """A process whose recorded config has ``per_step_timeout_ms = per_step``, then a
    one-step run whose watchdog fires ``fired_ms`` after it started."""
    append(store_dir, "runtime", _started(per_step), ts=T0 - 1)
    append(store_dir, RUN, _spawned(timeout_ms=600_000, max_steps=1), ts=T0)
    append(
        store_dir,
        RUN,
        SubagentWatchdogTimeout(
            deadline=T0 + fired_ms / 1000,
            limit_ms=fired_ms,
            knob="max_steps x per_step_timeout_ms",
            elapsed_ms=fired_ms,
        ),
        ts=T0 + fired_ms / 1000,
    )


# Was: DEFECT: a knob recorded as text ("60000") or true is taken for a number: verifies clean.
def test_a_knob_recorded_as_text_or_a_boolean_is_not_a_number(tmp_path: Path) -> None:
    for name, per_step, shown in (
        ("text", "60000", "'60000'"),
        ("true", True, "True"),
        ("fraction", 60000.5, "60000.5"),
    ):
        store_dir = tmp_path / name
        _one_step_run_watched_at(store_dir, per_step, 60_000)
        [finding] = _verify(store_dir).findings
        assert (finding.kind, finding.tag) == ("mismatch", "subagent:watchdog_timeout")
        assert finding.message == (
            "replay could not re-run the decision: the config in force has "
            f"'subagents.per_step_timeout_ms' = {shown}, not a number"
        ), name
    # what a config records as a number still is one (a whole float too)
    for name, per_step in (("int", 60_000), ("whole float", 60_000.0)):
        store_dir = tmp_path / name.replace(" ", "-")
        _one_step_run_watched_at(store_dir, per_step, 60_000)
        assert _verify(store_dir).clean, name


# Was: DEFECT: verifying one stream passes over a damaged runtime record (its config): clean.
def test_one_streams_verification_reports_a_damaged_runtime_record(store_dir: Path) -> None:
    # the recorded config said 1 s a step: the watchdog at 60 s (the default's) was late;
    # with that record damaged, no verdict on the run can be trusted
    _one_step_run_watched_at(store_dir, 1_000, 60_000)
    damage(store_dir, b"log", position(1))
    everything = _verify(store_dir)
    assert ("undecodable", 1, "", "") in _found(everything)
    assert not everything.clean
    report = _verify(store_dir, RUN)
    assert _found(report) == [("undecodable", 1, "runtime", "")]
    code, out, err = stalwart(store_dir, "replay", RUN, "--verify")
    assert code == 1, (out, err)
    assert "UNDECODABLE  position 1  runtime" in out


# Was: DEFECT: Codec(versions=) naming a tag no class has: a bare KeyError when a record of it was read  # noqa: E501
def test_a_codec_given_a_version_for_a_tag_no_class_has_is_refused_at_once() -> None:
    with pytest.raises(EventError, match="x:y"):
        Codec(versions={"x:y": 2})
