"""The stalwart command line, against real stores: CliRunner, and real processes for signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.events import (
    Codec,
    Event,
    MessageAppended,
    ProviderDegraded,
    RuntimeStopped,
    SessionCreated,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    TurnStarted,
)
from stalwart.store import NewEvent


class Mystery(Event, frozen=True, tag="future:mystery"):
    clue: str


@pytest.fixture
def filled(store_dir: Path) -> Path:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append(
            "session:a",
            [
                NewEvent(event=SessionCreated(title="first chat"), ts=1_790_000_000.0),
                NewEvent(event=TurnStarted(turn_id="t1"), ts=1_790_000_001.0),
                NewEvent(
                    event=MessageAppended(message_id="m1", role="user", content="hello there"),
                    ts=1_790_000_002.0,
                ),
            ],
        )
        store.append(
            "provider:openai",
            [
                NewEvent(
                    event=ProviderDegraded(provider="openai", rule="consecutive", failures=3),
                    ts=1_790_000_003.0,
                )
            ],
        )
    return store_dir


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_tail_prints_human_lines(filled: Path) -> None:
    code, out, err = run("--store", str(filled), "tail")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[0].split() == [
        "1",
        "2026-09-21T14:13:20.000Z",
        "session:a",
        "session:created",
        "agent=default",
        'title="first',
        'chat"',
    ]
    assert "provider:degraded" in lines[3]
    assert "failures=3" in lines[3]


def test_tail_json_has_exactly_the_documented_keys(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "tail", "--json")
    assert code == 0
    objects = [json.loads(line) for line in out.splitlines()]
    assert [set(o) for o in objects] == [
        {"position", "stream", "version", "type", "ts", "data"}
    ] * 4
    assert objects[2] == {
        "position": 3,
        "stream": "session:a",
        "version": 3,
        "type": "message:appended",
        "ts": 1_790_000_002.0,
        "data": {
            "message_id": "m1",
            "role": "user",
            "content": "hello there",
            "tool_calls": [],
            "tool_call_id": None,
            "name": None,
            "turn_id": None,
        },
    }


@pytest.mark.parametrize(
    ("args", "positions"),
    [
        (["--stream", "session:*"], [1, 2, 3]),
        (["--type", "provider:*"], [4]),
        (["--type", "*:started"], [2]),
        (["--since", "2"], [3, 4]),
        (["--since", "2", "--stream", "provider:*"], [4]),
        (["--since", "99"], []),
    ],
)
def test_tail_filters(filled: Path, args: list[str], positions: list[int]) -> None:
    code, out, _ = run("--store", str(filled), "tail", "--json", *args)
    assert code == 0
    assert [json.loads(line)["position"] for line in out.splitlines()] == positions


def test_store_comes_from_the_environment(filled: Path) -> None:
    code, out, _ = run("streams", env={"STALWART_STORE": str(filled)})
    assert code == 0
    assert "session:a" in out


def test_streams_lists_versions(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "streams", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["stream"], r["version"], r["last_position"]) for r in rows] == [
        ("provider:openai", 1, 4),
        ("session:a", 3, 3),
    ]
    code, out, _ = run("--store", str(filled), "streams")
    assert out.splitlines()[0].split() == ["STREAM", "VERSION", "LAST", "POS", "LAST", "EVENT"]


def test_replay_prints_the_folded_state(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "replay", "session:a", "--json")
    assert code == 0
    state = json.loads(out)
    assert (state["status"], state["messages"], state["current_turn"]) == ("running", 1, "t1")
    code, out, _ = run("--store", str(filled), "replay", "session:a")
    assert "status" in out
    assert "running" in out


def test_replay_until_travels_in_time(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "replay", "session:a", "--until", "1", "--json")
    assert code == 0
    assert json.loads(out)["status"] == "idle"


def test_replay_of_a_provider_stream_shows_its_breaker(filled: Path) -> None:
    code, out, _ = run("--store", str(filled), "replay", "provider:openai", "--json")
    assert code == 0
    state = json.loads(out)
    assert (state["provider"], state["status"], state["version"]) == ("openai", "closed", 1)


def test_replay_of_a_sub_agent_run_shows_the_run(store_dir: Path) -> None:
    """A run is a ``session:`` stream; replay used to fold it with the session fold and
    show an empty session (``idle``, 0 turns) for a run that had failed."""
    spawned = SubagentSpawned(
        parent="chat-1", task="sum the orders", task_class="code", timeout_ms=300_000
    )
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append(
            "session:run-a",
            [
                NewEvent(event=spawned, ts=1_790_000_000.0),
                NewEvent(event=SubagentProgress(tokens=120, step=1), ts=1_790_000_005.0),
                NewEvent(event=SubagentCompleted(outcome="failed"), ts=1_790_000_009.0),
            ],
        )
    code, out, _ = run("--store", str(store_dir), "replay", "session:run-a", "--json")
    assert code == 0
    state = json.loads(out)
    assert (state["status"], state["parent"], state["task"]) == (
        "failed",
        "chat-1",
        "sum the orders",
    )
    assert (state["tokens"], state["timeout_ms"], state["ended_at"]) == (
        120,
        300_000,
        1_790_000_009.0,
    )
    code, out, _ = run("--store", str(store_dir), "replay", "session:run-a", "--until", "2")
    assert code == 0
    assert ["status", "running"] in [line.split() for line in out.splitlines()]


def test_replay_of_another_stream_shows_counts(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("runtime", [RuntimeStopped(), RuntimeStopped()])
    code, out, _ = run("--store", str(store_dir), "replay", "runtime", "--json")
    assert code == 0
    assert json.loads(out)["counts"] == {"runtime:stopped": 2}


def test_unknown_events_are_shown_not_dropped(store_dir: Path) -> None:
    with store_module.open(store_dir, codec=Codec(extra_types=[Mystery])) as store:  # type: ignore[attr-defined]
        store.append("session:z", [SessionCreated(), Mystery(clue="butler")])
    code, out, _ = run("--store", str(store_dir), "tail")
    assert code == 0
    assert "future:mystery (unknown type)" in out
    assert "clue=butler" in out
    code, out, _ = run("--store", str(store_dir), "tail", "--json", "--type", "future:*")
    [line] = out.splitlines()
    assert json.loads(line)["data"]["_unknown"] is True


class TurnStartedV2(Event, frozen=True, tag="turn:started"):
    """``turn:started`` as a newer stalwart might write it: a changed field type."""

    turn_id: int
    schema_version = 2


def test_a_known_event_from_a_newer_schema_is_shown_as_unknown(store_dir: Path) -> None:
    newer = Codec(extra_types=[TurnStartedV2])
    with store_module.open(store_dir, codec=newer) as store:  # type: ignore[attr-defined]
        store.append("session:n", [SessionCreated(title="future"), TurnStartedV2(turn_id=7)])
        store.append("session:n", [MessageAppended(message_id="m", role="user", content="hi")])
    code, out, err = run("--store", str(store_dir), "tail")
    assert (code, err) == (0, "")
    assert "turn:started (unknown type)" in out
    code, out, err = run("--store", str(store_dir), "replay", "session:n", "--json")
    assert (code, err) == (0, "")
    state = json.loads(out)
    assert (state["version"], state["messages"]) == (3, 1)
    for command in (["status"], ["incidents"], ["streams"]):
        code, out, err = run("--store", str(store_dir), *command)
        assert (code, err) == (0, ""), command
        assert "session:n" in out or command == ["incidents"]


# -- errors are one line and exit 1 --------------------------------------------------------------


def test_missing_store_is_one_line_and_exit_1(tmp_path: Path) -> None:
    for command in (["tail"], ["streams"], ["replay", "session:a"]):
        code, out, err = run("--store", str(tmp_path / "nope"), *command)
        assert code == 1
        assert out == ""
        assert err.count("\n") == 1
        assert err.startswith("stalwart: error: no stalwart store at")
    assert not (tmp_path / "nope").exists()


def test_missing_stream_is_one_line(filled: Path) -> None:
    code, _, err = run("--store", str(filled), "replay", "session:nope")
    assert code == 1
    assert err == f"stalwart: error: no stream named 'session:nope' in {filled}\n"


def test_corrupt_store_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(b"\x00garbage" * 1000)
    code, _, err = run("--store", str(bad), "tail")
    assert code == 1
    assert err.startswith("stalwart: error: cannot open the store")
    assert err.count("\n") == 1


def test_corrupt_record_is_one_line(filled: Path) -> None:
    env = lmdb.open(str(filled), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put((2).to_bytes(8, "big"), b"\xc1", db=env.open_db(b"log", txn=txn))
    env.close()
    code, out, err = run("--store", str(filled), "tail")
    assert code == 1
    assert out.splitlines()[0].startswith("       1")
    assert out.count("\n") == 1  # the good record before the corrupt one is shown
    assert err.startswith("stalwart: error: record at position 2 is corrupt: not a stalwart record")
    assert err.count("\n") == 1


def _stalwart(*args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stalwart", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )


def test_usage_errors_are_one_line_and_exit_1(tmp_path: Path) -> None:
    proc = _stalwart("tail", "--bogus")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.startswith("stalwart: error: No such option")
    assert err.count("\n") == 1


def test_help_and_version_exit_0() -> None:
    proc = _stalwart("--help")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "tail" in out
    proc = _stalwart("--version")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.startswith("stalwart, version")


def test_follow_prints_new_events_then_stops_cleanly_on_ctrl_c(filled: Path) -> None:
    proc = _stalwart("--store", str(filled), "tail", "--follow", "--json", "--since", "3")
    assert proc.stdout is not None
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
        reader.start()
        with store_module.open(filled) as store:  # type: ignore[attr-defined]
            for i in range(20):
                store.append(f"session:{i % 3}", [MessageAppended(message_id=str(i), role="user")])
            deadline = threading.Event()
            for _ in range(200):
                if len(lines) >= 21:
                    break
                deadline.wait(0.05)
        assert [json.loads(line)["position"] for line in lines] == list(range(4, 25))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        reader.join(timeout=10)
        assert proc.returncode == 0
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_check_runs(tmp_path: Path) -> None:
    code, out, err = run("check", env={"TMPDIR": str(tmp_path)})
    assert code == 0, err
    assert out.splitlines()[-1] == "all checks passed"


def test_no_traceback_when_the_reader_goes_away(filled: Path) -> None:
    with store_module.open(filled) as store:  # type: ignore[attr-defined]
        store.append(
            "s:big", [MessageAppended(message_id=str(i), role="user") for i in range(3000)]
        )
    proc = subprocess.Popen(
        f"{sys.executable} -m stalwart --store {filled} tail | head -n 1",
        shell=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    out, err = proc.communicate(timeout=60)
    assert out.count("\n") == 1
    assert "Traceback" not in err
