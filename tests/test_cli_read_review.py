"""Defects a review of the read commands (``status``, ``watch``, ``incidents``,
``replay``, ``streams``, ``tail``, ``db check``) against docs/cli.md and the CLI's
quality bar found: a command that shows nothing (or an internal error) where it could
show what it can read and say what it could not, and human lines that event content
can split into forged lines. Each test fails on the current code for the defect its
docstring states.

Real parts only: real LMDB stores in temporary directories, damaged with the ``lmdb``
module while no store of this process has them open, and real subprocesses of
``python -m stalwart`` (so the exit codes and stderr are the ones a user sees).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from stalwart import store as store_module
from stalwart.cli._views import fmt_rel
from stalwart.errors import EventError
from stalwart.events import (
    Event,
    MessageAppended,
    ProviderCallFailed,
    ProviderCallSucceeded,
    SessionCreated,
    SessionRequiresAction,
)
from stalwart.store import NewEvent

T0 = 1_790_000_000.0
GARBAGE = b"\xc1garbage"  # 0xc1 is never valid msgpack


def stalwart(store_dir: Path, *args: str) -> tuple[int, str, str]:
    """Run the real ``stalwart --store STORE_DIR ARGS``: exit code, stdout, stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", str(store_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def append(store_dir: Path, stream: str, *events: Event, ts: float = T0) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append(stream, [NewEvent(event=e, ts=ts + i) for i, e in enumerate(events)])


def damage(store_dir: Path, db: bytes, key: bytes, value: bytes = GARBAGE) -> None:
    """Overwrite one value of one of the store's LMDB sub-databases (disk damage)."""
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn))
    finally:
        env.close()


def position(n: int) -> bytes:
    return n.to_bytes(8, "big")


def assert_one_error_line(code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    assert code == 1, (code, err)
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err


def failed(model: str = "gpt-4o") -> ProviderCallFailed:
    return ProviderCallFailed(provider="openai", model=model, agent="a", error_class="timeout")


def succeeded(model: str = "gpt-4o") -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="openai", model=model, agent="a", latency_ms=10)


# -- a corrupt record in the middle of the log ------------------------------------------------


def _calls_with_a_corrupt_one_first(store_dir: Path) -> None:
    """Positions 1..4 in ``provider:openai``: a failed call (then damaged), a success, a
    failure, a success. Readable after the damage: 3 calls, 1 failed."""
    append(store_dir, "provider:openai", failed(), succeeded(), failed(), succeeded())
    damage(store_dir, b"log", position(1))


def test_incidents_reads_past_a_corrupt_record(store_dir: Path) -> None:
    """Known issue. ``stalwart incidents`` folds ``store.read_all()`` straight through
    (stalwart/cli/_incidents.py:incidents -> stalwart.state.incidents): the first corrupt
    record raises out of the fold, so one damaged record at the start of the log hides
    every provider call recorded after it. The operator asking "is one model failing?"
    gets only an error line and no table at all, although 3 of the 4 calls read fine
    (``replay --all --verify`` and ``db check`` already read past such a record).

    Expected: the rows for what can be read (gpt-4o: 3 calls, 1 failed) and one line on
    stderr naming position 1 as unreadable, exit 1."""
    _calls_with_a_corrupt_one_first(store_dir)
    code, out, err = stalwart(store_dir, "incidents", "--json")
    assert_one_error_line(code, err)
    assert "position 1" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["model"], r["calls"], r["failed"]) for r in rows] == [("gpt-4o", 3, 1)]


def _sessions_and_a_corrupt_provider_record(store_dir: Path) -> None:
    append(store_dir, "session:s1", SessionCreated(title="one"))
    append(store_dir, "provider:openai", failed(), ts=T0 + 10)
    append(store_dir, "session:s2", SessionCreated(title="two"), ts=T0 + 20)
    damage(store_dir, b"log", position(2))  # the provider's record, between the sessions


def test_status_overview_shows_the_sessions_it_can_read_past_a_corrupt_record(
    store_dir: Path,
) -> None:
    """``stalwart status`` (and ``watch``, which folds the same way) builds its overview
    with ``fold_all`` (stalwart/cli/_views.py:fold_all), a bare loop over
    ``store.read_all()``: one damaged record anywhere in the log, here in a provider
    stream that has nothing to do with any session, raises out of the fold and the whole
    overview is replaced by one error line. The operator cannot see any session,
    including the ones whose streams are intact, exactly when something is wrong.

    Expected: the overview of what can be read (session:s1 and session:s2) on stdout and
    one line on stderr naming the unreadable position 2, exit 1."""
    _sessions_and_a_corrupt_provider_record(store_dir)
    code, out, err = stalwart(store_dir, "status")
    assert_one_error_line(code, err)
    assert "position 2" in err
    assert "session:s1" in out
    assert "session:s2" in out


def test_status_of_a_session_is_not_hidden_by_a_corrupt_dead_letter_record(
    store_dir: Path,
) -> None:
    """``stalwart status SESSION`` reads that session's stream and the ``deadletter``
    stream into one list (stalwart/cli/_views.py:fold_session): a damaged record in
    ``deadletter`` (a stream shared by every session) raises before anything is shown,
    so the detail of a session whose own stream is intact is replaced by an error.

    Expected: the session's detail (its status and pending request, which read fine) on
    stdout and one line on stderr naming the unreadable dead-letter position, exit 1."""
    append(
        store_dir,
        "session:s1",
        SessionCreated(title="one"),
        SessionRequiresAction(request_id="r1", kind="approval", tool="rm", arguments="{}"),
    )
    append(store_dir, "deadletter", MessageAppended(message_id="x", role="user", content="x"))
    damage(store_dir, b"log", position(3))
    code, out, err = stalwart(store_dir, "status", "s1")
    assert_one_error_line(code, err)
    assert "position 3" in err
    assert "requires_action" in out
    assert "request r1" in out


def test_db_check_reports_a_damaged_streams_row_instead_of_an_internal_error(
    store_dir: Path,
) -> None:
    """``stalwart db check`` exists to report damage, but a damaged row in the LMDB
    ``streams`` table makes it fail with ``stalwart: internal error: DecodeError (a
    bug ...)`` and no report at all: ``LmdbEventStore.streams`` (stalwart/store/_lmdb.py,
    used by stalwart/store/_check.py:check_store) decodes every row with a bare
    ``msgspec.msgpack.decode``, whose DecodeError escapes raw (STYLE.md: dependency
    errors never escape raw). ``stalwart streams`` fails the same way.

    Expected: the report, with a problem naming the stream whose row cannot be read
    (session:b), and exit 1; the log itself (3 records) is still walked."""
    append(store_dir, "session:a", SessionCreated(title="a"))
    append(store_dir, "session:b", SessionCreated(title="b"), ts=T0 + 1)
    append(store_dir, "session:c", SessionCreated(title="c"), ts=T0 + 2)
    damage(store_dir, b"streams", b"session:b")
    code, out, err = stalwart(store_dir, "db", "check", "--json")
    assert "internal error" not in err, err
    assert code == 1, (code, err)
    report = json.loads(out)
    assert report["records"] == 3
    assert any(p["stream"] == "session:b" for p in report["problems"]), report


# -- control characters in event content ------------------------------------------------------


def test_replay_escapes_control_characters_in_the_state(store_dir: Path) -> None:
    """``stalwart replay STREAM`` prints the folded state with
    stalwart/cli/_render.py:state_lines, which writes string values with ``str(value)``
    and never escapes them (``tail`` does, through ``escaped``). A session title with a
    newline in it (a title is whatever the host or the user typed) prints as two lines,
    the second a forged ``status  closed`` row under a session that is idle; a ``\\r``
    would overwrite the start of the line on a terminal. docs/cli.md: human-readable
    lines show control characters escaped, so each value stays on its line.

    Expected: one line per field, the title shown as ``t\\nstatus  closed``."""
    append(store_dir, "session:a", SessionCreated(title="t\nstatus              closed"))
    code, out, err = stalwart(store_dir, "replay", "session:a")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if line.startswith("status")] == ["status"]
    assert not any(line.startswith("status              closed") for line in lines), out
    [title] = [line for line in lines if line.startswith("title")]
    assert "\\n" in title


def test_status_of_a_session_keeps_a_multi_line_tool_input_on_its_line(
    store_dir: Path,
) -> None:
    """``stalwart status SESSION`` prints the pending request's stored input raw
    (stalwart/cli/_status.py:detail_lines, ``input {pending['input']}``). Tool arguments
    are written by the model, and pretty-printed JSON is common: its newlines split the
    ``pending`` row over several lines, so the operator deciding ``session confirm
    --allow`` reads lines that look like rows of the view (here a forged ``retry`` row
    saying nothing is queued). docs/cli.md: control characters in values are escaped.

    Expected: the whole input on the ``pending`` line, its newlines shown as ``\\n``."""
    arguments = '{\n  "path": "/"\n}\nretry         nothing queued'
    append(
        store_dir,
        "session:s1",
        SessionCreated(title="one"),
        SessionRequiresAction(request_id="r1", kind="approval", tool="rm", arguments=arguments),
    )
    code, out, err = stalwart(store_dir, "status", "s1")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    [pending] = [line for line in lines if line.startswith("pending")]
    assert '"path"' in pending, out
    assert len([line for line in lines if line.startswith("retry")]) == 1, out


def test_incidents_escapes_control_characters_in_provider_and_model_names(
    store_dir: Path,
) -> None:
    """``stalwart incidents`` prints the provider and model of each row as they were
    recorded (stalwart/cli/_incidents.py:table): a model name with a newline (the model
    id comes from the config or from a provider's own response) splits its row in two,
    the second half forging a row of its own with made-up counts under the header.

    Expected: one table line per model, the newline shown escaped."""
    forged = "gpt\nanthropic  claude  999  0  0.0%"
    append(store_dir, "provider:openai", failed(forged), succeeded("gpt-4o"))
    code, out, err = stalwart(store_dir, "incidents")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert len(lines) == 4, out  # the header, the column names, one line per model
    assert not any(line.startswith("anthropic") for line in lines), out


# -- a record that decodes but carries a non-finite time -------------------------------------


def test_a_non_finite_time_is_refused_by_the_store_and_shown_as_a_number_by_status(
    store_dir: Path,
) -> None:
    """The store accepted an event stamped ``inf`` (``tail --json`` then printed ``inf``,
    which is not JSON), and ``stalwart status SESSION`` died with ``stalwart: internal
    error: ValueError``: ``now_for`` took the log's newest time as "now" (inf) and
    stalwart/cli/_views.py:fmt_rel did ``round(abs(at - now))`` on NaN. Now an append
    with a time that is not finite is refused (``EventError``, nothing written), and a
    relative time that cannot be computed is shown as the number."""
    append(store_dir, "session:s1", SessionCreated(title="one"))
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        for ts in (float("inf"), float("-inf"), float("nan")):
            late = MessageAppended(message_id="n", role="user", content="x")
            with pytest.raises(EventError, match="finite"):
                store.append("session:s1", [NewEvent(event=late, ts=ts)])
        assert store.head() == 1
    assert fmt_rel(float("inf"), T0) == "inf"
    assert fmt_rel(T0, float("inf")) == str(T0)
    code, out, err = stalwart(store_dir, "status", "s1")
    assert (code, err) == (0, "")
    assert out.startswith("session:s1  idle"), out


# -- malformed options ------------------------------------------------------------------------


def test_a_damaged_streams_row_is_one_line_naming_its_stream(store_dir: Path) -> None:
    """``stalwart streams`` decoded every row with a bare ``msgspec.msgpack.decode``: a
    damaged row was ``stalwart: internal error: DecodeError``. It is a StoreError
    naming the stream now."""
    append(store_dir, "session:a", SessionCreated(title="a"))
    append(store_dir, "session:b", SessionCreated(title="b"), ts=T0 + 1)
    damage(store_dir, b"streams", b"session:b")
    code, _, err = stalwart(store_dir, "streams")
    assert_one_error_line(code, err)
    assert "'session:b'" in err


def test_tail_follow_with_a_position_past_64_bits_is_not_an_internal_error(
    store_dir: Path,
) -> None:
    """``stalwart tail --since N`` takes any N >= 0 (click's IntRange has no upper
    bound). Without ``--follow`` a huge N prints nothing, as it should; with
    ``--follow`` the subscription turns N + 1 into an 8-byte LMDB key and the command
    dies with ``stalwart: internal error: OverflowError (a bug ...)``
    (stalwart/cli/_app.py:tail, ``store.subscribe(since + 1)``).

    Expected: a usage error naming ``--since`` (one line, exit 1), or the same as
    without ``--follow``; never an internal error."""
    append(store_dir, "session:a", SessionCreated(title="a"))
    code, _, err = stalwart(store_dir, "tail", "--follow", "--since", str(2**64))
    assert_one_error_line(code, err)
    assert "--since" in err
