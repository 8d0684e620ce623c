"""Review of ``stalwart replay --verify`` and the operator's read commands (session 31):
an option or a recorded config that ended in an internal error where one line (or a
finding) is due, and a verification report that wrote a log's text to the terminal
unescaped.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against. Real parts
only: LMDB stores in temporary directories and real subprocesses of ``python -m stalwart``
(the exit codes and stderr a user gets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stalwart.events import (
    ActivationLeased,
    ActivationReady,
    RuntimeStarted,
    SubagentSpawned,
    SubagentWatchdogTimeout,
)
from tests.test_cli_read_review import (
    T0,
    append,
    assert_one_error_line,
    damage,
    position,
    stalwart,
)

#: characters that drive or reorder a terminal line and that JSON leaves as they are: a
#: right-to-left override (U+202E, "Trojan Source") and the 8-bit CSI (U+009B)
_UNESCAPED_BY_JSON = "\u202e\x9b"


def _owner_mismatch(store_dir: Path, owner: str) -> None:
    """A lease at epoch 5 where the policy gives epoch 1: a decision that does not follow,
    by a worker whose name (host config, any text) holds ``owner``."""
    append(
        store_dir,
        "session:s1",
        ActivationReady(activation_id="a1", kind="message", text="hi"),
        ActivationLeased(activation_id="a1", owner=owner, epoch=5, expires_at=T0 + 31),
    )


# Was: DEFECT: replay --verify writes expected/found raw: U+202E and C1 controls reach the terminal.
def test_verify_report_escapes_the_expected_and_found_decisions(store_dir: Path) -> None:
    _owner_mismatch(store_dir, f"w{_UNESCAPED_BY_JSON}[31m")
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert code == 1, err
    assert "DOES NOT FOLLOW" in out
    lines = [line for line in out.splitlines() if line.lstrip().startswith(("expected", "found"))]
    assert len(lines) == 2, out
    for line in lines:
        assert not set(line) & set(_UNESCAPED_BY_JSON), repr(line)
        assert "w\\u202e\\u009b[31m" in line, line
    # --json stays the data as recorded (a JSON reader is no terminal)
    code, out, _ = stalwart(store_dir, "replay", "--all", "--verify", "--json")
    [finding] = json.loads(out)["findings"]
    assert finding["found"]["owner"] == f"w{_UNESCAPED_BY_JSON}[31m"


# Was: DEFECT: replay --verify --grace-ms with a number too big for a float is an internal error.
def test_a_grace_too_big_for_a_float_is_one_error_line(store_dir: Path) -> None:
    _owner_mismatch(store_dir, "w1")
    code, _, err = stalwart(store_dir, "replay", "--all", "--verify", "--grace-ms", "1" + "0" * 400)
    assert_one_error_line(code, err)
    assert "--grace-ms" in err
    # a grace of centuries is still a grace (every miss forgiven, the mismatch still found)
    code, out, err = stalwart(
        store_dir, "replay", "--all", "--verify", "--grace-ms", "10" + "0" * 14
    )
    assert code == 1, err
    assert "DOES NOT FOLLOW" in out


def _run_under_a_recorded_config(store_dir: Path, per_step: object) -> None:
    """A process whose recorded config says ``per_step_timeout_ms = per_step`` (a record
    written by hand or by another program), a one-step run (the knob binds it: one with
    no step budget is re-derived whatever the knob holds), and its watchdog 1 s later."""
    append(
        store_dir,
        "runtime",
        RuntimeStarted(
            stalwart_version="9", config={"subagents": {"per_step_timeout_ms": per_step}}
        ),
        ts=T0 - 1,
    )
    append(
        store_dir,
        "session:r1",
        SubagentSpawned(parent="p", task="t", task_class="custom", timeout_ms=1_000, max_steps=1),
        SubagentWatchdogTimeout(
            deadline=T0 + 1, limit_ms=1_000, knob="timeout_ms", elapsed_ms=1_000
        ),
    )


# Was: DEFECT: a recorded knob that is not a number (text, null): replay --verify internal error.
def test_a_recorded_knob_that_is_not_a_number_is_a_finding_not_an_internal_error(
    store_dir: Path,
) -> None:
    _run_under_a_recorded_config(store_dir, "fast")
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert "internal error" not in err, err
    assert code == 1, (out, err)
    assert "DOES NOT FOLLOW  position 3  session:r1 v2  subagent:watchdog_timeout" in out
    assert (
        "replay could not re-run the decision: the config in force has "
        "'subagents.per_step_timeout_ms' = 'fast', not a number"
    ) in out
    # the same from one stream's verification, and for a knob recorded as null
    code, out, err = stalwart(store_dir, "replay", "session:r1", "--verify")
    assert (code, "internal error" in err) == (1, False), err
    assert "not a number" in out


def test_a_recorded_null_knob_is_a_finding_too(store_dir: Path) -> None:
    _run_under_a_recorded_config(store_dir, None)
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert (code, "internal error" in err) == (1, False), err
    assert "'subagents.per_step_timeout_ms' = None, not a number" in out


def _with_reader_gone(store_dir: Path, *args: str) -> tuple[int, str]:
    """``stalwart ARGS | head -c 0``: stdout is a pipe whose reader is gone before the
    command writes. Its exit code and stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "stalwart", "--store", str(store_dir), *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    return proc.returncode, proc.stderr


# Was: DEFECT: `stalwart replay --all --verify | head` exits 0 on a log that is not clean.
def test_a_failed_verification_still_exits_1_when_the_reader_goes_away(store_dir: Path) -> None:
    _owner_mismatch(store_dir, "w1")
    assert _with_reader_gone(store_dir, "replay", "--all", "--verify") == (1, "")
    assert _with_reader_gone(store_dir, "replay", "--all", "--verify", "--json") == (1, "")
    # a clean one is still 0, and a read that has no verdict (tail) too
    append(store_dir, "session:s2", ActivationReady(activation_id="b1", kind="message"))
    assert _with_reader_gone(store_dir, "replay", "session:s2", "--verify") == (0, "")
    assert _with_reader_gone(store_dir, "tail") == (0, "")


# Was: DEFECT: `stalwart db check | head` and `stalwart status | head` exit 0 on a damaged store.
def test_damage_found_still_exits_1_when_the_reader_goes_away(store_dir: Path) -> None:
    append(
        store_dir,
        "session:s1",
        ActivationReady(activation_id="a1", kind="message"),
        ActivationReady(activation_id="a2", kind="message"),
    )
    damage(store_dir, b"log", position(1))
    assert stalwart(store_dir, "db", "check")[0] == 1
    assert _with_reader_gone(store_dir, "db", "check") == (1, "")
    assert _with_reader_gone(store_dir, "status") == (1, "")


def test_a_recorded_sweep_interval_that_is_not_a_number_leaves_the_rest_verified(
    store_dir: Path,
) -> None:
    """A deadline's slack (the lease sweep's ``poll_ms``) cannot be read: no miss of that
    deadline can be judged, so it is not watched, and the rest of the log is verified
    (was: an internal error, as above; then, until session 33, one error line that
    stopped the whole verification and lost every other finding)."""
    append(
        store_dir,
        "runtime",
        RuntimeStarted(stalwart_version="9", config={"activations": {"poll_ms": "x"}}),
        ts=T0 - 1,
    )
    _owner_mismatch(store_dir, "w1")
    code, out, err = stalwart(store_dir, "replay", "--all", "--verify")
    assert (code, err) == (1, ""), out
    assert "DOES NOT FOLLOW" in out  # the doctored lease is still found
    assert out.rstrip().endswith("NOT CLEAN: 1 decision that does not follow")
