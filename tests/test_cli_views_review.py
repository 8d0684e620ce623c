"""Review of the operator's views: ``stalwart watch`` (live and ``--once``), ``stalwart
status [SESSION]``, ``stalwart incidents`` and ``stalwart db check``, against
docs/cli.md, docs/sessions.md and the commands' ``--help``.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against (all nine
are fixed); each docstring gives the symptom, the cause and what is expected. The others
pin behaviour that holds (the figures of the overview agree with the folds of each
stream; a ``watch`` frame costs what was appended since the last one, not the whole
log).

Real parts only: LMDB stores in temporary directories (damaged with the ``lmdb`` module
while no store of this process has them open), the PostgreSQL fixture, the real CLI in
subprocesses (exit codes and stderr as a user sees them; a pseudo-terminal for the live
frame) or in-process through click's runner.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.cli._views import Unreadable, fold_all, overview
from stalwart.cli._watch import frame
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementSendFailed,
    BreakerOpened,
    Event,
    LeaseExpired,
    MessageAppended,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    SessionCreated,
    SessionRequiresAction,
)
from stalwart.state import (
    ACTIVATIONS,
    BREAKER,
    DEADLETTER,
    HEALTH,
    OrchestratorFolder,
    retry_posture,
)
from stalwart.store import NewEvent, load_state
from stalwart.testing import PostgresServer, recorded
from tests._relay import CuttingRelay, schema_of
from tests._runtime_support import CollectedProcess
from tests.test_cli_db_check import run
from tests.test_cli_read_review import (
    T0,
    append,
    assert_one_error_line,
    damage,
    failed,
    position,
    stalwart,
)
from tests.test_postgres_parity_review import _delete_position, holed  # noqa: F401

_STALWART = (sys.executable, "-m", "stalwart")


def _backend(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> str:
    """A fresh store location of ``backend`` (``lmdb`` or ``pg``)."""
    if backend == "pg":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "store")


def _append_at(location: str, stream: str, *events: tuple[Event, float]) -> None:
    """Append ``events`` to ``stream`` in one batch, each with its own time."""
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        log.append(stream, [NewEvent(event=event, ts=ts) for event, ts in events])


# -- watch: option values -----------------------------------------------------------------


# Was: DEFECT: watch --interval nan redrew in a busy loop; inf ended in an internal error.
@pytest.mark.parametrize("interval", ["nan", "inf"])
def test_watch_refuses_an_interval_that_is_not_a_finite_number(
    store_dir: Path, interval: str
) -> None:
    """Symptom: ``stalwart watch --interval nan`` is accepted and redraws without ever
    waiting (about 25,000 frames in 3 s on a one-session store, a core at 100 %);
    ``--interval inf`` (or ``1e308``) draws one frame, then ``stalwart: internal error:
    OverflowError``. Cause: stalwart/cli/_watch.py:watch declares the option as
    ``click.FloatRange(min=0.1)``, which lets NaN (every comparison with it is false) and
    infinity through to ``threading.Event.wait(interval)``, which returns at once for
    NaN and overflows for a timeout above ``threading.TIMEOUT_MAX``. Expected: a bad
    option value is one ``stalwart: error:`` line and exit 1 before any frame (cli.md:
    "Every error is one line on stderr ... a usage mistake"), or, for infinity, a view
    that simply never redraws; never a busy loop or an internal error."""
    append(store_dir, "session:s1", SessionCreated(title="t"))
    proc = subprocess.Popen(
        [*_STALWART, "--store", str(store_dir), "watch", "--interval", interval],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=2.5)
    except subprocess.TimeoutExpired:  # still running: it must be waiting, not spinning
        proc.kill()
        out, err = proc.communicate()
        frames = out.count("stalwart watch  ")
        assert frames <= 1, (
            f"--interval {interval}: {frames} frames in 2.5 s, redrawn without waiting"
        )
        return
    assert "internal error" not in err, err
    assert_one_error_line(proc.returncode, err)
    assert "--interval" in err, err
    assert out == "", "a bad option value is refused before any frame is drawn"


# -- watch: the live frame on a terminal ------------------------------------------------------


def _busy_overview(location: str) -> None:
    """40 sessions, 6 abandoned activations, 6 undelivered announcements, 5 providers."""
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        for k in range(40):
            log.append(f"session:s{k:02d}", [NewEvent(event=SessionCreated(title="t"), ts=T0)])
        for k in range(6):
            log.append(
                "session:s00",
                [
                    ActivationReady(activation_id=f"x{k}", kind="message", text="hi"),
                    ActivationAbandoned(
                        activation_id=f"x{k}", attempts=1, error_class="bad_request"
                    ),
                ],
            )
            log.append(
                "deadletter",
                [
                    AnnouncementDeadLettered(
                        entry_id=f"e{k}",
                        announcement_id=f"n{k}",
                        channel="chat",
                        text="sorry",
                        reason="send_failed",
                    )
                ],
            )
        for name in ("openai", "anthropic", "local", "azure", "groq"):
            log.append(
                f"provider:{name}",
                [ProviderCallFailed(provider=name, model="m", agent="a", error_class="timeout")],
            )


# Was: DEFECT: on a terminal, watch's default rows overflowed it with more than two providers.
def test_watch_on_a_terminal_draws_a_frame_that_fits_it(store_dir: Path) -> None:
    """Symptom: on a 30-line terminal, with 40 sessions, a full dead-letter backlog and 5
    providers, ``stalwart watch`` draws 32 lines (each ending in a newline) from the
    top left, so the terminal scrolls on every redraw and the header is pushed off the
    screen. Cause: stalwart/cli/_watch.py:_fit sizes the session rows as ``lines - 14 -
    2 * DEAD_LETTERS_SHOWN``, a fixed allowance that holds the other lines of the frame
    only when there are at most two providers; the provider table (one line per
    provider) is not counted. Expected (cli.md: "``--rows N`` shows at most N sessions
    (default: what fits the terminal)", "redrawn in place"): the default frame fits the
    terminal: at most LINES - 1 lines, so that the cursor after its last newline is
    still on the screen and nothing scrolls."""
    _busy_overview(str(store_dir))
    master, replica = pty.openpty()
    proc = subprocess.Popen(
        [*_STALWART, "--store", str(store_dir), "watch", "--interval", "5"],
        stdout=replica,
        stderr=subprocess.PIPE,
        env={**os.environ, "LINES": "30", "COLUMNS": "250"},
    )
    os.close(replica)
    drawn = b""
    try:
        give_up = time.monotonic() + 10
        while b"\x1b[J" not in drawn and time.monotonic() < give_up:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    drawn += os.read(master, 65536)
                except OSError:  # the terminal's other end closed: watch exited
                    break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)  # and its stderr pipe closed
        os.close(master)
    text = drawn.decode()
    assert "\x1b[J" in text, text[-500:]
    first = text.split("\x1b[H", 1)[1].split("\x1b[J", 1)[0]
    lines = first.count("\n")
    assert "groq" in first  # the frame is the busy overview
    assert "... and" in first
    assert lines <= 29, (
        f"a frame of {lines} lines on a 30-line terminal: it scrolls on every redraw"
    )


# -- status SESSION -----------------------------------------------------------------------


# Was: DEFECT: status SESSION whose records are all unreadable is an internal error, not one line.
def test_status_of_a_session_whose_records_are_all_unreadable_is_one_line(
    store_dir: Path,
) -> None:
    """Symptom: a session whose only record is damaged (disk damage on the record of its
    ``session:created``): ``stalwart status s1`` prints ``stalwart: internal error:
    AssertionError (a bug; ...)``. Cause: stalwart/cli/_status.py:status checks the
    stream exists (its version is 1), then folds it with
    stalwart/cli/_views.py:fold_session, which passes over the unreadable record and so
    finds no session, and ``assert found is not None`` fails. Expected (cli.md: the views
    "read past a record that cannot be read: they show what they could read, then say on
    that one stderr line which record they passed over ... and exit 1"): exit 1 with one
    ``stalwart: error:`` line naming position 2, never an internal error."""
    append(store_dir, "session:s0", SessionCreated(title="sound"))
    append(store_dir, "session:s1", SessionCreated(title="damaged"))
    damage(store_dir, b"log", position(2))
    code, _, err = stalwart(store_dir, "status", "s1")
    assert "internal error" not in err, err
    assert_one_error_line(code, err)
    assert "position 2" in err, err


# Was: DEFECT: status of an intact session exits 1 when the log's newest (other) record is damaged.
def test_status_of_an_intact_session_is_not_failed_by_another_streams_damage(
    store_dir: Path,
) -> None:
    """Symptom: session s2 is whole, and so is ``deadletter``; the log's newest record,
    in session s1's stream, is damaged. ``stalwart status s2`` prints s2 and then
    ``stalwart: error: record at position 3 is corrupt ...; what could be read is shown``
    and exits 1, as if s2 were damaged. Cause: stalwart/cli/_views.py:fold_session reads
    the record at the head of the log only to learn the newest time (for "now"), through
    the same ``Unreadable`` that collects the session's own damage, so the head's
    damage becomes the command's error. Expected (cli.md: "Only that stream and
    ``deadletter`` are read"): the status of an undamaged session exits 0 with nothing
    on stderr; when the head cannot be read, "now" falls back to what was read (the
    session's newest event or the clock)."""
    append(store_dir, "session:s1", SessionCreated(title="one"))
    append(store_dir, "session:s2", SessionCreated(title="two"))
    append(store_dir, "session:s1", MessageAppended(message_id="m1", role="user", content="x"))
    damage(store_dir, b"log", position(3))
    code, out, err = stalwart(store_dir, "status", "s2")
    assert out.startswith("session:s2  idle"), out
    assert (code, err) == (0, ""), (code, err)


# Was: DEFECT: status SESSION counts at most 200 of its abandoned activations in its dead letters.
def test_status_of_a_session_counts_every_abandoned_activation(store_dir: Path) -> None:
    """Symptom: a session with 201 abandoned activations: ``stalwart status s1`` says
    ``counters ... abandoned 201`` and, a few lines below, ``dead letters: 0
    undelivered announcements, 200 abandoned activations`` (``--json``:
    ``activations_total`` 200), while ``stalwart status`` says 201. Cause:
    stalwart/cli/_views.py:_dead_letters gives, for one session, ``activations_total =
    len(abandoned)``, the entries stalwart/state/_orchestrator.py keeps
    (``ABANDONED_KEPT`` = 200, the newest), not the count. Expected: the total is every
    abandoned activation of the session (201), as the overview's ``abandoned_total``
    counts them, with the older ones summarised as ``... and 1 older``."""
    events: list[tuple[Event, float]] = [(SessionCreated(title="t"), T0)]
    for k in range(201):
        events.append((ActivationReady(activation_id=f"x{k}", kind="message", text="hi"), T0 + k))
        events.append(
            (
                ActivationAbandoned(
                    activation_id=f"x{k}", attempts=1, error_class="bad_request", retryable=False
                ),
                T0 + k,
            )
        )
    _append_at(str(store_dir), "session:s1", *events)
    code, out, err = run("--store", str(store_dir), "status", "s1", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert view["counters"]["abandoned"] == 201
    code, out, _ = run("--store", str(store_dir), "status", "--json")
    assert json.loads(out)["dead_letters"]["activations_total"] == 201
    assert view["dead_letters"]["activations_total"] == 201, view["dead_letters"][
        "activations_total"
    ]


# -- incidents --since ------------------------------------------------------------------------


# Was: DEFECT: incidents --since 30m counts the whole log when the log's last record is unreadable.
def test_incidents_since_a_duration_counts_back_from_the_newest_readable_event(
    store_dir: Path,
) -> None:
    """Symptom: a failed call at T0, another two hours later, and a third record after
    it that is damaged. ``stalwart incidents --since 30m`` shows 2 calls (the one of two
    hours earlier too) and its header has no ``since``: the window silently became the
    whole log. (``--since <timestamp>`` on such a log with no call in range says ``no
    provider calls in the log`` instead of ``... match the filters``.) Cause:
    stalwart/cli/_incidents.py:_newest_ts reads only the record at the head; when that
    one cannot be read it returns None, and parse_since takes None as "an empty log"
    and gives no start. Expected (cli.md: "only what happened in that span before the
    newest event in the log", and the views "show what they could read"): the span
    counts back from the newest event that could be read: 1 call, and exit 1 with the
    one line naming position 3."""
    append(store_dir, "provider:openai", failed(), ts=T0)
    append(store_dir, "provider:openai", failed(), ts=T0 + 7200)
    append(store_dir, "provider:openai", failed(), ts=T0 + 7201)
    damage(store_dir, b"log", position(3))
    code, out, err = stalwart(store_dir, "incidents", "--since", "30m", "--json")
    assert_one_error_line(code, err)
    assert "position 3" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["model"], r["calls"]) for r in rows] == [("gpt-4o", 1)], rows


# Was: DEFECT: incidents --since DURATION counts back from the last record's time, not the newest.
def test_incidents_since_a_duration_counts_back_from_the_newest_event_not_the_last(
    store_dir: Path,
) -> None:
    """Symptom: two workers whose clocks differ by an hour (the newer-stamped call at
    position 1, the last record at position 2 stamped an hour earlier): ``incidents
    --since 30m`` counts both calls. Cause: stalwart/cli/_incidents.py:_newest_ts takes
    the time of the record at the head of the log; log order is not time order across
    writers (``status`` and ``watch`` take the newest time, ``OrchestratorState.
    newest_ts``). Expected (cli.md: "only what happened in that span before the newest
    event in the log"): the span ends at the newest time in the log (T0 + 3600), so only
    the call at T0 + 3600 is in it: 1 call."""
    append(store_dir, "provider:openai", failed(), ts=T0 + 3600)
    append(store_dir, "provider:openai", failed(), ts=T0)
    code, out, err = stalwart(store_dir, "incidents", "--since", "30m", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["calls"] for r in rows] == [1], rows


# -- db check ---------------------------------------------------------------------------------


# Was: DEFECT: db check does not name the stream of a missing record that was its stream's last.
@pytest.mark.parametrize("backend", ["lmdb", "pg"])
def test_db_check_names_the_stream_of_a_missing_last_record(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """Symptom: 50 messages round-robin over session:s0..s2; position 48 (session:s2's
    last record, version 16) is deleted by hand. ``stalwart db check`` prints ``problem
    position 48: cannot be read: it is missing from the log`` with no stream, on both
    backends. Cause:
    stalwart/store/_check.py:check_store names a record's stream only from a later
    record of the same stream (_version_gap); for the last one it ignores that the
    stream's row (version 16, last position 48, at or below the head, so not an append
    the walk raced) says the log should have it, because a row ahead of the walk is
    never a problem. Expected (cli.md: "reports each place where they disagree, one line
    per problem, naming the position and the stream"): the problem at position 48 names
    session:s2."""
    location = _backend(request, tmp_path, backend)
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        for n in range(50):
            log.append(f"session:s{n % 3}", [MessageAppended(message_id=str(n), role="user")])
    _delete_position(location, 48)
    code, out, err = run("--store", location, "db", "check", "--json")
    assert code == 1, err
    problems = json.loads(out)["problems"]
    assert [p["position"] for p in problems] == [48], problems
    assert problems[0]["stream"] == "session:s2", problems


# Was: DEFECT: db check on PostgreSQL reports one hole twice, naming a sound record unreadable.
def test_db_check_reports_a_hole_once_on_postgres_as_on_lmdb(holed: tuple[str, str]) -> None:  # noqa: F811
    """Symptom: the same 50 messages on LMDB and PostgreSQL with position 30 (session:s2
    version 10) deleted from both. LMDB's check: 1 problem. PostgreSQL's: 2, the second
    ``position 33 session:s2: cannot be read: version 10 of 'session:s2' is missing
    before it``, though the record at position 33 reads (it is version 11). The same
    root makes ``status s2`` on PostgreSQL say ``record at position 33 is corrupt``.
    Cause: stalwart/store/_check.py:_read_back adds a problem for the stream read's
    error unless one has the same position; PostgreSQL's read_stream
    (stalwart/store/_postgres.py, its ``gap``) names the record after the hole, not the
    hole, so the hole already reported is reported again. Expected: one problem per
    place, the same report on both backends (scaling.md: the same log on either store)."""
    reports = []
    for location in holed:
        code, out, err = run("--store", location, "db", "check", "--json")
        assert code == 1, err
        reports.append(json.loads(out)["problems"])
    on_lmdb, on_pg = reports
    assert [(p["position"], p["stream"]) for p in on_lmdb] == [(30, "session:s2")]
    assert on_pg == on_lmdb, on_pg


# -- figures that hold ------------------------------------------------------------------------

#: a time ahead of any real clock this suite runs on, so "now" is the log's newest event
T1 = 2_900_000_000.0


def _operated_log(location: str) -> None:
    """s1: leased by w1, expired, leased by w2, requeued (streak 2), leased by w3 (live);
    s2: waiting for approval r1; s3: a message abandoned; two dead letters (one
    delivered, one tried once); openai degraded with its breaker open; anthropic well."""
    _append_at(
        location,
        "session:s1",
        (SessionCreated(title="one", agent="a"), T1),
        (ActivationReady(activation_id="a1", kind="message", text="hi"), T1),
        (ActivationLeased(activation_id="a1", owner="w1", epoch=1, expires_at=T1 + 30), T1),
        (
            LeaseExpired(activation_id="a1", owner="w1", epoch=1, expired_at=T1 + 30, streak=1),
            T1 + 40,
        ),
        (ActivationLeased(activation_id="a1", owner="w2", epoch=2, expires_at=T1 + 70), T1 + 40),
        (
            ActivationRequeued(
                activation_id="a1",
                epoch=2,
                delay_ms=4000,
                streak=2,
                run_at=T1 + 45,
                error_class="provider_timeout",
            ),
            T1 + 41,
        ),
        (ActivationLeased(activation_id="a1", owner="w3", epoch=3, expires_at=T1 + 90), T1 + 60),
    )
    _append_at(
        location,
        "session:s2",
        (SessionCreated(title="two", agent="a"), T1),
        (ActivationReady(activation_id="b1", kind="message", text="rm it"), T1 + 1),
        (ActivationLeased(activation_id="b1", owner="w1", epoch=1, expires_at=T1 + 31), T1 + 1),
        (SessionRequiresAction(request_id="r1", kind="approval", tool="rm"), T1 + 2),
        (ActivationBlocked(activation_id="b1", epoch=1, request_id="r1"), T1 + 2),
    )
    _append_at(
        location,
        "session:s3",
        (SessionCreated(title="three", agent="a"), T1),
        (ActivationReady(activation_id="c1", kind="message", text="x"), T1 + 3),
        (ActivationLeased(activation_id="c1", owner="w2", epoch=1, expires_at=T1 + 33), T1 + 3),
        (
            ActivationAbandoned(
                activation_id="c1", attempts=1, error_class="bad_request", retryable=False
            ),
            T1 + 4,
        ),
    )
    dead = [
        AnnouncementDeadLettered(
            entry_id=f"e{k}", announcement_id=f"n{k}", channel="chat", text="t", reason="r"
        )
        for k in (1, 2)
    ]
    _append_at(
        location,
        "deadletter",
        (dead[0], T1 + 5),
        (dead[1], T1 + 5),
        (
            AnnouncementSendFailed(announcement_id="n1", error_class="timeout", entry_id="e1"),
            T1 + 6,
        ),
        (AnnouncementDeadLetterDelivered(entry_id="e2", attempts=1), T1 + 7),
    )
    failure = ProviderCallFailed(provider="openai", model="m", agent="a", error_class="timeout")
    _append_at(
        location,
        "provider:openai",
        *((failure, T1 + 10 + k) for k in range(3)),
        (ProviderDegraded(provider="openai", rule="consecutive", agents=("a",)), T1 + 13),
        (BreakerOpened(provider="openai", failures=3, threshold=3), T1 + 13),
    )
    _append_at(
        location,
        "provider:anthropic",
        (ProviderCallSucceeded(provider="anthropic", model="c", agent="a"), T1 + 14),
    )


@pytest.mark.parametrize("backend", ["lmdb", "pg"])
def test_status_figures_agree_with_the_folds_of_each_stream(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """``status --json`` (and ``watch --once``, the same overview) against what folding
    each stream on its own says: every session's backlog, lease and retry posture, the
    dead-letter backlog and each provider's health and breaker, on both backends."""
    location = _backend(request, tmp_path, backend)
    _operated_log(location)
    code, out, err = run("--store", location, "status", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert view["now"] == T1 + 60  # the log is ahead of the clock: "now" is its newest
    with store_module.open(location, create=False, read_only=True) as log:  # type: ignore[attr-defined]
        for row in view["sessions"]:
            folded = load_state(log, row["session"], ACTIVATIONS, snapshot_every=0)
            posture = retry_posture(folded)
            assert row["queued"] == len(folded.queue)
            assert (row["retry"]["attempt"], row["retry"]["streak"]) == (
                posture.attempt,
                posture.streak,
            )
            lease = folded.lease
            assert (row["lease"] is None) == (lease is None)
            if lease is not None:
                assert (row["lease"]["owner"], row["lease"]["epoch"]) == (lease.owner, lease.epoch)
                assert row["lease"]["expired"] == (view["now"] >= lease.expires_at)
        dead = load_state(log, "deadletter", DEADLETTER, snapshot_every=0)
        assert [e["entry_id"] for e in view["dead_letters"]["announcements"]] == [
            e.entry_id for e in dead.entries
        ]
        for row in view["providers"]:
            stream = f"provider:{row['provider']}"
            health = load_state(log, stream, HEALTH, snapshot_every=0)
            breaker = load_state(log, stream, BREAKER, snapshot_every=0)
            assert (row["health"], row["breaker"]) == (health.status, breaker.status)
    rows = {row["session"]: row for row in view["sessions"]}
    assert rows["session:s1"]["lease"]["owner"] == "w3"
    assert rows["session:s1"]["retry"]["attempt"] == 3
    assert rows["session:s2"]["pending"]["request_id"] == "r1"
    assert view["dead_letters"]["activations_total"] == 1
    assert [(p["provider"], p["health"], p["breaker"]) for p in view["providers"]] == [
        ("anthropic", "healthy", "closed"),
        ("openai", "degraded", "open"),
    ]
    code, out, err = run("--store", location, "watch", "--once")
    assert code == 0, err
    assert "w3#3" in out
    assert "3/2" in out
    assert "dead letters: 1 undelivered announcement, 1 abandoned activation" in out


@pytest.mark.parametrize("backend", ["lmdb", "pg"])
def test_a_watch_frame_costs_what_was_appended_not_the_whole_log(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """cli.md: ``watch`` "folds the log once and then only what was appended since the
    last frame". On 40,100 events over 100 sessions the first fold took ~0.3 s on either
    backend and each later frame (the read of what is new, the fold and the rendering of
    100 rows) ~1-2 ms; on a 200,500-event LMDB store (500 sessions) 1.1 s and ~4 ms. A
    frame must stay a small fraction of the first fold, and see what was appended."""
    location = _backend(request, tmp_path, backend)
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        for k in range(100):
            batch: list[Event] = [SessionCreated(title="t", agent="a")]
            for r in range(100):
                batch += [
                    ActivationReady(activation_id=f"a{r}", kind="message", text="hi"),
                    ActivationLeased(activation_id=f"a{r}", owner="w1", epoch=r + 1, expires_at=T1),
                    MessageAppended(message_id=f"m{r}", role="user", content="hello"),
                    ActivationAcked(activation_id=f"a{r}", epoch=r + 1),
                ]
            log.append(f"session:s{k}", batch)
    with store_module.open(location, create=False, read_only=True) as log:  # type: ignore[attr-defined]
        started = time.perf_counter()
        folder = fold_all(log)
        first = time.perf_counter() - started
        costs = []
        for _ in range(5):
            started = time.perf_counter()
            fold_all(log, folder, Unreadable())
            frame(folder, log.location, None)
            costs.append(time.perf_counter() - started)
        with store_module.open(location) as writer:  # type: ignore[attr-defined]
            writer.append("session:new", [SessionCreated(title="late")])
        fold_all(log, folder, Unreadable())
        shown = frame(folder, log.location, None)
    assert folder.position == 40_101
    assert any(line.startswith("session:new ") for line in shown)
    typical = sorted(costs)[len(costs) // 2]
    assert typical < first / 10, f"a frame took {typical:.4f} s; the first fold {first:.4f} s"


def test_a_frame_makes_rows_only_for_the_sessions_it_shows_and_still_counts_them_all() -> None:
    """Noticed by the review: on 20,000 sessions a frame took ~100 ms with ``--rows 20``
    and ~190 ms to fit a terminal: every frame rebuilt every session's view and row. Now
    the folder keeps the views no event changed and a frame makes rows only for the
    sessions it can show (2.4-2.8 ms there); the counts still cover every session."""
    folder = OrchestratorFolder()
    for k in range(50):
        created = SessionCreated(title="t", agent="a")
        folder.add(
            recorded(created, stream=f"session:s{k:02d}", version=1, ts=T1 + k, position=k + 1)
        )
    fitted = frame(folder, "here", None, height=20)
    assert len(fitted) <= 20
    table = [line for line in fitted if line.startswith("session:s")]
    assert any(line.startswith("50 sessions") for line in fitted), fitted
    assert f"... and {50 - len(table)} more" in fitted, fitted
    assert [line.split()[0] for line in table] == [f"session:s{k:02d}" for k in range(len(table))]
    five = frame(folder, "here", 5)
    assert "... and 45 more" in five
    assert overview(folder.state(), T1, limit=5)["counts"] == overview(folder.state(), T1)["counts"]
    assert len(overview(folder.state(), T1, limit=5)["sessions"]) == 5


# -- watch across a database outage -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watch_on_postgres_waits_out_an_outage_and_goes_on_where_it_was(
    pg_server: PostgresServer, pg_url: str, relay: CuttingRelay
) -> None:
    """Was (noticed by the review, not a test then): a PostgreSQL outage longer than the
    connection timeout ended ``watch`` with "no connection ... within 10 s" and exit 1,
    while ``tail --follow`` waits it out. Now a frame during the outage is the last one
    read, its header says since when the store has not answered, and once it answers the
    view goes on from where it was: what was appended meanwhile is counted once. (A
    read waits for a connection up to the handle's timeout, 10 s, so the first such
    frame comes 10-20 s into the outage.)"""
    with store_module.open(pg_url) as log:  # type: ignore[attr-defined]
        log.append("session:s1", [SessionCreated(title="one")])
        url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
        watch = CollectedProcess(
            [
                *_STALWART,
                "--store",
                f"{url}?schema={schema_of(pg_url)}&connect_timeout=1",
                "watch",
                "--interval",
                "0.2",
            ],
            wait=60.0,
        )
        try:
            watch.wait(lambda: any("position 1" in line for line in watch.out), "a frame")
            relay.cut_now()
            log.append("session:s2", [SessionCreated(title="two")])
            watch.wait(
                lambda: any("STORE UNREACHABLE since" in line for line in watch.out),
                "a frame that says the store does not answer",
            )
            relay.restore()
            watch.wait(
                lambda: any("position 2" in line for line in watch.out[-40:]),
                "a frame after the outage with what was appended during it",
            )
            code = watch.stop()
        finally:
            watch.stop()
    assert code == 0, watch.err
    last = "".join(watch.out).rsplit("stalwart watch  ", 1)[1]
    assert "UNREACHABLE" not in last
    assert "2 sessions" in last, last
