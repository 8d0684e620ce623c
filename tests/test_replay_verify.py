"""``stalwart replay --verify`` on the golden logs, loaded into a real LMDB store."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import lmdb
import msgspec
import pytest
from click.testing import CliRunner

from stalwart.cli import cli, main
from stalwart.cli._replay import REGISTRY, default_knobs
from stalwart.errors import CorruptRecordError
from stalwart.events import DEFAULT_CODEC, RecordedEvent
from stalwart.state import Verification, verify
from tests.golden.make_verify_golden import load

GOLDEN = Path(__file__).parent / "golden"


def _records(name: str) -> list[bytes]:
    raw: list[bytes] = msgspec.msgpack.decode((GOLDEN / name).read_bytes())
    return raw


@pytest.fixture
def clean(tmp_path: Path) -> Path:
    load("verify-clean.log", tmp_path / "clean").close()
    return tmp_path / "clean"


@pytest.fixture
def doctored(tmp_path: Path) -> Path:
    load("verify-doctored.log", tmp_path / "doctored").close()
    return tmp_path / "doctored"


def run(store: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["--store", str(store), "replay", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def test_the_clean_golden_log_verifies_clean(clean: Path) -> None:
    code, out = run(clean, "--all", "--verify")
    assert code == 0, out
    assert out.splitlines()[0] == (
        "verify all streams: 30 events, up to position 30, 5 decisions re-derived"
    )
    assert "subagent:watchdog_timeout x1" in out
    assert out.rstrip().endswith("clean: every decision follows from the state just before it")
    for stream in ("session:run-a", "session:run-b", "session:chat-1", "provider:main"):
        assert run(clean, stream, "--verify")[0] == 0


def test_the_doctored_golden_log_fails_with_each_finding_in_words(doctored: Path) -> None:
    code, out = run(doctored, "--all", "--verify")
    assert code == 1
    assert "DOES NOT FOLLOW  position 13  session:run-a v4  subagent:watchdog_timeout" in out
    assert "it fired 50000 ms before it" in out
    assert '"elapsed_ms":70000' in out  # found
    assert out.count("MISSED DEADLINE") == 2
    assert "the sub-agent watchdog was due at 2026-09-21T14:17:31.000Z" in out
    assert "the ghost sweep was due at 2026-09-21T14:19:31.000Z" in out
    assert out.rstrip().endswith("NOT CLEAN: 1 decision that does not follow, 2 missed deadlines")


def test_a_wider_grace_forgives_the_misses_but_not_the_early_watchdog(doctored: Path) -> None:
    code, out = run(doctored, "--all", "--verify", "--grace-ms", "250000")
    assert code == 1
    assert "MISSED" not in out  # the log ends 249 s after run B's watchdog was due
    code, out = run(doctored, "--all", "--verify", "--grace-ms", "150000")
    assert out.count("MISSED") == 1  # at 159 s past it, the watchdog's miss shows again
    assert "DOES NOT FOLLOW" in out


def test_json_report(doctored: Path) -> None:
    code, out = run(doctored, "--all", "--verify", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["clean"] is False
    assert report["target"] == "all streams"
    assert [(f["kind"], f["stream"], f["tag"]) for f in report["findings"]] == [
        ("mismatch", "session:run-a", "subagent:watchdog_timeout"),
        ("missed", "session:run-b", "subagent:watchdog_timeout"),
        ("missed", "session:run-b", "subagent:ghost_swept"),
    ]
    assert report["findings"][0]["expected"] == []
    assert report["checked"]["provider:degraded"] == 1


def test_one_stream_is_verified_with_the_runtime_streams_config_and_time(doctored: Path) -> None:
    code, out = run(doctored, "session:run-a", "--verify")
    assert code == 1
    assert "DOES NOT FOLLOW" in out
    assert "MISSED" not in out  # run B's deadline is not this stream's
    code, out = run(doctored, "session:run-b", "--verify")
    assert code == 1
    # its own late completion proves the watchdog missed; runtime:stopped confirms it
    assert "subagent:completed at position" in out
    assert run(doctored, "session:chat-1", "--verify")[0] == 0


def test_until_verifies_up_to_a_position_and_time_travel_still_prints_state(
    doctored: Path,
) -> None:
    assert run(doctored, "--all", "--verify", "--until", "12")[0] == 0
    code, out = run(doctored, "--all", "--verify", "--until", "13")
    assert code == 1
    assert "up to position 13" in out
    code, out = run(doctored, "session:run-a", "--until", "12")
    assert code == 0
    assert "session:run-a" in out
    code, out = run(doctored, "session:run-a", "--until", "12", "--json")
    assert json.loads(out)["version"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--all"], "--all goes with --verify"),
        (["session:run-a", "--grace-ms", "10"], "--grace-ms goes with --verify"),
        (["session:run-a", "--verify", "--no-snapshots"], "--no-snapshots does not go with"),
        (["--verify"], "give a STREAM or --all"),
        (["session:run-a", "--all", "--verify"], "STREAM or --all, not both"),
        (["session:nope", "--verify"], "no stream named 'session:nope'"),
    ],
)
def test_errors_are_one_line_and_exit_1(
    doctored: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--store", str(doctored), "replay", *args])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("stalwart: error: ")
    assert message in err


def _overwrite(store: Path, position: int, value: bytes) -> None:
    env = lmdb.open(str(store), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), value, db=env.open_db(b"log", txn=txn))
    finally:
        env.close()


def test_corrupt_and_unknown_records_are_reported_and_the_walk_goes_on(doctored: Path) -> None:
    _overwrite(doctored, 5, b"\xc1garbage")  # a record of session:chat-1
    payload = {"type": "session:sentiment_scored", "score": 0.8}
    unknown = [7, "session:chat-1", 6, 1_790_000_005.0, "f" * 32, None, None, 3, payload]
    _overwrite(doctored, 7, msgspec.msgpack.encode(unknown))
    code, out = run(doctored, "--all", "--verify")
    assert code == 1
    assert "UNDECODABLE  position 5" in out
    assert "UNDECODABLE  position 7  session:chat-1 v6  session:sentiment_scored" in out
    assert "DOES NOT FOLLOW  position 13" in out  # read past them
    code, out = run(doctored, "session:chat-1", "--verify", "--json")
    kinds = [(f["kind"], f["position"]) for f in json.loads(out)["findings"]]
    assert kinds == [("undecodable", 5), ("undecodable", 7)]


def test_the_older_golden_logs_unknown_and_broken_records() -> None:
    future = [DEFAULT_CODEC.decode(data) for data in _records("session-future.log")]
    report = verify(future, REGISTRY, defaults=default_knobs())
    # session-v1's decisions were written by hand, seconds apart: they do not follow either
    assert [(f.kind, f.position, f.tag) for f in report.findings] == [
        ("mismatch", 5, "execution:prompt_timeout"),
        ("mismatch", 15, "execution:aborted"),
        ("undecodable", 16, "session:sentiment_scored"),
    ]
    verification = Verification(REGISTRY, defaults=default_knobs())
    for data in _records("session-broken.log"):
        try:
            record: RecordedEvent = DEFAULT_CODEC.decode(data)
        except CorruptRecordError as exc:
            verification.undecodable(exc.position, exc.reason)
            continue
        verification.add(record)
    findings = verification.report().findings
    assert [(f.kind, f.position) for f in findings if f.kind == "undecodable"] == [
        ("undecodable", 3)
    ]


def _transcript() -> list[tuple[list[str], str]]:
    """Every ``$ stalwart ...`` command of docs/replay.md with the output it shows."""
    text = (Path(__file__).parent.parent / "docs" / "replay.md").read_text()
    blocks = text.split("```")[1::2]
    found: list[tuple[list[str], str]] = []
    for block in blocks:
        command: list[str] | None = None
        lines: list[str] = []
        for line in [*block.splitlines()[1:], "$ end"]:
            if line.startswith("$ "):
                if command is not None:
                    found.append((command, "\n".join(lines)))
                argv = shlex.split(line[2:])
                command = argv[1:] if argv[0] == "stalwart" else None
                lines = []
            else:
                lines.append(line)
    return found


def test_the_transcript_in_replay_md_is_what_the_commands_print(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load("verify-clean.log", tmp_path / "clean").close()
    load("verify-doctored.log", tmp_path / "doctored").close()
    monkeypatch.chdir(tmp_path)
    commands = _transcript()
    assert len(commands) >= 7
    for argv, shown in commands:
        result = CliRunner().invoke(cli, argv)
        printed = result.output.rstrip("\n").splitlines()
        expected = shown.splitlines()
        if "..." in expected:  # an excerpt: the lines before the ellipsis, then the rest in order
            cut = expected.index("...")
            assert printed[:cut] == expected[:cut], argv
            rest = iter(printed[cut:])
            assert all(line in rest for line in expected[cut + 1 :]), argv
        else:
            assert printed == expected, argv
