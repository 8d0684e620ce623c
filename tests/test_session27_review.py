"""Review of session 27's changes: the resend watch on the runtime's Clock, the operator's
views (``watch`` frames fitted to a terminal, ``status``, ``incidents --since``), ``db
check``'s naming of missing records, the ``OrchestratorFolder``'s kept views.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against (all three
are fixed); each docstring gives the symptom, the cause and what is expected. The others
pin behaviour that holds.

Real parts only: LMDB stores in ``tmp_path`` (damaged with the ``lmdb`` module while no
store of this process has them open), the PostgreSQL fixture, the real CLI in
subprocesses, runtimes on a ``FakeClock`` with the fake provider and MemoryChannels.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli._watch import frame
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationReady,
    AnnouncementDeadLettered,
    Event,
    MessageAppended,
    ProviderCallFailed,
    RecordedEvent,
    SessionCreated,
)
from stalwart.runtime import Runtime
from stalwart.runtime._sessions import RESEND_SWEEP_S
from stalwart.state import OrchestratorFolder, OrchestratorState, apply_orchestrator
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, recorded
from tests._runtime_support import runtime_config, until
from tests.test_cli_read_review import stalwart
from tests.test_postgres_parity_review import _delete_position

Logs = list[MutableMapping[str, Any]]

#: a time ahead of any real clock this suite runs on, so a view's "now" is the log's own
T1 = 2_900_000_000.0
GUARD = 20.0  # real seconds: the longest a wait on other threads may take


def _record(position: int, stream: str, version: int, event: Event) -> RecordedEvent:
    return recorded(event, stream=stream, version=version, ts=T1 + position, position=position)


def _busy_folder(sessions: int, providers: int = 3, dead: int = 2) -> OrchestratorFolder:
    """``sessions`` sessions, ``dead`` undelivered announcements, ``providers`` providers."""
    folder = OrchestratorFolder()
    position = 0
    for k in range(sessions):
        position += 1
        folder.add(_record(position, f"session:s{k:03d}", 1, SessionCreated(title="t")))
    for k in range(dead):
        position += 1
        lettered = AnnouncementDeadLettered(
            entry_id=f"e{k}", announcement_id=f"n{k}", channel="chat", text="x", reason="r"
        )
        folder.add(_record(position, "deadletter", k + 1, lettered))
    for k in range(providers):
        position += 1
        failed = ProviderCallFailed(provider=f"p{k}", model="m", agent="a", error_class="timeout")
        folder.add(_record(position, f"provider:p{k}", 1, failed))
    return folder


def _fill(location: str, count: int, streams: int = 3) -> None:
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        for n in range(count):
            log.append(f"session:s{n % streams}", [MessageAppended(message_id=str(n), role="user")])


def _cli(location: str, *args: str) -> tuple[int, str, str]:
    """The real ``stalwart --store LOCATION ARGS`` (a directory or a URL)."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", location, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _location(request: pytest.FixtureRequest, tmp_path: Path, backend: str) -> str:
    if backend == "pg":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "store")


# -- db check -------------------------------------------------------------------------------


# Was: DEFECT: db check says "consistent" (LMDB) when the log's newest records were deleted.
@pytest.mark.parametrize("backend", ["lmdb", "pg"])
def test_db_check_reports_the_logs_newest_records_missing(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """Symptom: 12 messages over session:s0..s2, then session:only's one record
    (position 13); positions 12 (session:s2's last, version 4) and 13 are deleted by
    hand. On LMDB ``stalwart db check`` prints ``consistent`` and exits 0; on
    PostgreSQL it fails, but its two problems name no position ("its row says version
    4, the log has 3", "streams() has it at version 1, the log does not"). Cause:
    stalwart/store/_check.py:check_store takes ``store.head()`` as the end of the log
    and passes over every row whose ``last_position`` is beyond it as "an append the
    walk raced"; LMDB's head is the log's last key, so deleting the newest records moves
    the head down below those rows and they are never looked at. On PostgreSQL (whose
    head is kept apart) _walk ends with the last record read and never notices that
    positions up to the head are missing after it. Expected (cli.md: "one line per
    problem, naming the position and the stream"): exit 1, and the problems name
    position 12 with session:s2 and position 13 with session:only, on both backends
    (a racing append is told apart by reading the head again after the rows)."""
    location = _location(request, tmp_path, backend)
    _fill(location, 12)
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        log.append("session:only", [MessageAppended(message_id="x", role="user")])
    _delete_position(location, 12)
    _delete_position(location, 13)
    code, out, err = _cli(location, "db", "check", "--json")
    assert code == 1, (out, err)
    problems = json.loads(out)["problems"]
    named = {(p["position"], p["stream"]) for p in problems}
    assert {(12, "session:s2"), (13, "session:only")} <= named, problems


# Was: DEFECT: db check names the stream of only the first of two missing records of a stream.
def test_db_check_names_the_stream_of_each_missing_record_of_a_stream(store_dir: Path) -> None:
    """Symptom: 12 messages round-robin over session:s0..s2 plus one more record; positions
    6 and 9 (session:s2's versions 2 and 3) are deleted. ``db check`` reports ``position
    6 session:s2: ... held version 2`` but ``position 9: cannot be read: it is missing
    from the log`` with no stream (the same on PostgreSQL). Cause:
    stalwart/store/_check.py:_version_gap, at the record that skips versions (version 4
    at position 12, where 2 was due), names the stream only on the first unreadable
    place between (``between[0]``) and leaves the others as they were. Expected (cli.md:
    each problem names "the position and the stream"): position 9 names session:s2 too
    (it held version 3)."""
    _fill(str(store_dir), 12)
    _fill(str(store_dir), 1, streams=1)  # position 13: the head is not a deleted record
    _delete_position(str(store_dir), 6)
    _delete_position(str(store_dir), 9)
    code, out, err = stalwart(store_dir, "db", "check", "--json")
    assert code == 1, err
    problems = json.loads(out)["problems"]
    assert [p["position"] for p in problems] == [6, 9], problems
    assert [p["stream"] for p in problems] == ["session:s2", "session:s2"], problems


@pytest.mark.parametrize("backend", ["lmdb", "pg"])
def test_db_check_names_each_stream_whose_last_record_is_missing(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """Holds: two streams' last records missing side by side (positions 10 and 11,
    session:s0's and session:s1's version 4), the log going on after them: each
    position is one problem naming its own stream, the same on both backends."""
    location = _location(request, tmp_path, backend)
    _fill(location, 12)
    with store_module.open(location) as log:  # type: ignore[attr-defined]
        log.append("session:only", [MessageAppended(message_id="x", role="user")])
    _delete_position(location, 10)
    _delete_position(location, 11)
    code, out, err = _cli(location, "db", "check", "--json")
    assert code == 1, err
    problems = json.loads(out)["problems"]
    assert [(p["position"], p["stream"]) for p in problems] == [
        (10, "session:s0"),
        (11, "session:s1"),
    ], problems


# -- watch frames -----------------------------------------------------------------------------


# Was: DEFECT: watch --rows above the terminal height cuts dead letters, providers, "N more".
def test_a_frame_with_more_rows_than_the_terminal_keeps_the_rest_of_the_overview() -> None:
    """Symptom: ``stalwart watch --rows 100`` on a 21-line terminal (a frame of 20
    lines), 50 sessions, 2 undelivered announcements, 3 providers: the frame is the
    header, the counts and 16 session rows, and nothing else: no ``... and 34 more``,
    no dead letters, no provider health, with nothing saying the frame was cut (the
    same with ``--rows 10`` loses the provider rows). Cause: stalwart/cli/_watch.py:frame
    fits the session rows to the height only when ``rows`` is None; with ``--rows`` it
    keeps every row asked for and then cuts the frame's bottom lines
    (``lines[:height]``). Expected (cli.md: "``--rows N`` shows at most N sessions"):
    on a terminal, at most N and at most what leaves room for the rest of the frame,
    as without ``--rows``: the frame keeps ``... and N more``, the dead-letter line and
    the provider table."""
    folder = _busy_folder(50)
    lines = frame(folder, "here", 100, height=20)
    assert len(lines) <= 20
    assert any(line.startswith("... and ") for line in lines), lines
    assert any(line.startswith("dead letters: 2 undelivered") for line in lines), lines
    assert any(line.startswith("  p2 ") for line in lines), lines


def test_frames_fit_tiny_and_empty_terminals_and_count_every_session() -> None:
    """Holds: a frame on a 1-, 2- or 3-line terminal is that many lines; with no
    sessions it is the header, the counts, dead letters and providers; a fitted frame
    always counts every session in its counts line, and its ``... and N more`` plus the
    rows shown add up to them."""
    empty = OrchestratorFolder()
    for height in (1, 2, 3):
        assert len(frame(empty, "here", None, height=height)) == height
        assert len(frame(_busy_folder(40), "here", None, height=height)) == height
    lines = frame(empty, "here", None, height=30)
    assert lines[2] == "0 sessions"
    assert "providers: none seen in the log" in lines
    for height in (5, 8, 12, 20, 29, 60, 200):
        folder = _busy_folder(40, providers=5)
        lines = frame(folder, "here", None, height=height)
        assert len(lines) <= height, height
        if height >= 8:
            rows = sum(line.startswith("session:s") for line in lines)
            more = [int(line.split()[2]) for line in lines if line.startswith("... and ")]
            assert lines[2].startswith("40 sessions"), lines
            assert rows + sum(more) == 40, (height, lines)


def test_status_json_lists_every_session_though_a_frame_makes_rows_for_a_few(
    store_dir: Path,
) -> None:
    """Holds: ``overview`` makes rows only for a frame's sessions, but ``status --json``
    (and the text) still lists all 60 sessions, and its counts agree."""
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        for k in range(60):
            log.append(f"session:s{k:02d}", [SessionCreated(title="t")])
    code, out, err = stalwart(store_dir, "status", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert len(view["sessions"]) == 60
    assert sum(view["counts"].values()) == 60
    code, out, err = stalwart(store_dir, "status")
    assert code == 0, err
    assert out.startswith("60 sessions")
    assert "... and" not in out
    assert sum(line.startswith("session:s") for line in out.splitlines()) == 60


# -- OrchestratorFolder: kept views ------------------------------------------------------------


def _abandon(position: int, stream: str, version: int, activation: str) -> list[RecordedEvent]:
    ready = ActivationReady(activation_id=activation, kind="message", text="hi")
    gone = ActivationAbandoned(activation_id=activation, attempts=1, error_class="x")
    return [
        _record(position, stream, version, ready),
        _record(position + 1, stream, version + 1, gone),
    ]


def test_a_resumed_folder_keeps_no_stale_view_and_equals_the_pure_fold() -> None:
    """Holds: a folder resumed from a state (``OrchestratorFolder(state)``), asked for its
    state between adds (new sessions, events to a session whose view is kept, dead
    letters and providers that do not touch sessions), equals ``apply_orchestrator``
    record by record; a view handed out earlier is not changed afterwards."""
    records: list[RecordedEvent] = []
    for k in range(4):
        records.append(_record(len(records) + 1, f"session:s{k}", 1, SessionCreated(title="t")))
    records += _abandon(len(records) + 1, "session:s1", 2, "a1")
    failed = ProviderCallFailed(provider="p", model="m", agent="a", error_class="timeout")
    records.append(_record(len(records) + 1, "provider:p", 1, failed))
    records.append(
        _record(len(records) + 1, "session:s0", 2, MessageAppended(message_id="m", role="user"))
    )
    records.append(_record(len(records) + 1, "session:a-new", 1, SessionCreated(title="n")))
    records += _abandon(len(records) + 1, "session:s3", 2, "a3")
    for split in range(len(records)):
        pure = OrchestratorState()
        for record in records[:split]:
            pure = apply_orchestrator(pure, record)
        folder = OrchestratorFolder(pure)
        handed = folder.state()
        frozen = msgspec.msgpack.decode(msgspec.msgpack.encode(handed), type=OrchestratorState)
        expected = pure
        for record in records[split:]:
            folder.add(record)
            expected = apply_orchestrator(expected, record)
            assert folder.state() == expected, (split, record.position)
        assert handed == frozen  # what was handed out before the adds is as it was


# -- the resend watch on the runtime's Clock ---------------------------------------------------


def _passes(logs: Logs) -> int:
    return sum(1 for entry in logs if entry["event"] == "runtime.resend_watch_passed")


def _watches() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "stalwart-resend-watch")


def _armed(count: int) -> bool:
    """``count`` watches run and every start-up pass ended (it arms the watch's timer
    before it ends: a watch thread alone may not have its timer yet)."""
    names = [t.name for t in threading.enumerate()]
    return "stalwart-resend" not in names and names.count("stalwart-resend-watch") == count


def test_two_runtimes_on_one_fake_clock_each_pass_and_one_closed_leaves_the_other(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, logs: Logs
) -> None:
    """Holds: two runtimes on one FakeClock (each with its own store and scheduler): one
    move of the clock past ``RESEND_SWEEP_S`` gives each watch one pass; once one runtime
    closed, its watch thread is gone and a move of the clock gives exactly one pass (the
    other's), again and again (its timer is armed after each pass)."""
    config = runtime_config(fake.base_url)
    stores: list[EventStore] = [
        store_module.open(tmp_path / name, clock=clock)  # type: ignore[attr-defined]
        for name in ("one", "two")
    ]
    first = Runtime(config, store=stores[0], clock=clock, channels={"chat": chat})
    second = Runtime(config, store=stores[1], clock=clock, channels={"chat": chat})
    try:
        first.start()
        second.start()
        until(lambda: _armed(2), GUARD, what="both watches wait for their timers")
        before = _passes(logs)
        clock.advance(RESEND_SWEEP_S)
        until(lambda: _passes(logs) == before + 2, GUARD, what="one pass of each watch")
        first.close()
        assert _watches() == 1
        for _ in range(3):
            passed = _passes(logs)
            clock.advance(RESEND_SWEEP_S)
            until(lambda n=passed: _passes(logs) > n, GUARD, what="the open runtime's pass")
            assert _watches() == 1  # a pass runs in a watch thread: the closed one has none
            assert _passes(logs) == passed + 1
    finally:
        first.close()
        second.close()
        for opened in stores:
            opened.close()
    assert _watches() == 0
    moved = _passes(logs)
    clock.advance(10 * RESEND_SWEEP_S)  # no watch thread is left to run a pass
    assert _passes(logs) == moved
