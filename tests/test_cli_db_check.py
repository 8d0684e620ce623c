"""``stalwart db check``: the log walked whole and every stream read back, on real stores;
each kind of damage a line naming where it is, and exit 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.store import check_store
from stalwart.store._environment import INDEX_LAG

from .store_contract import msg
from .test_store_index_lag import GARBAGE, damage


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def fill(location: str, count: int, streams: int = 3) -> None:
    with store_module.open(location) as store:  # type: ignore[attr-defined]
        for n in range(count):
            store.append(f"session:s{n % streams}", [msg(n)])


def test_a_sound_store_is_consistent_on_both_sides_of_the_index_mark(store_dir: Path) -> None:
    fill(str(store_dir), INDEX_LAG + 100)
    code, out, err = run("--store", str(store_dir), "db", "check")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith(f"{INDEX_LAG + 100} records in 3 streams, head {INDEX_LAG + 100}")
    assert lines[1] == (
        f"  format stalwart-lmdb-3, index to position {INDEX_LAG} (100 records after it)"
    )
    assert lines[-1] == "consistent"


@pytest.mark.parametrize("indexed", [False, True], ids=["after-the-mark", "indexed"])
@pytest.mark.parametrize("value", [GARBAGE, None], ids=["garbage", "deleted"])
def test_a_damaged_record_is_named_and_the_check_fails(
    store_dir: Path, value: bytes | None, indexed: bool
) -> None:
    count = INDEX_LAG + 60 if indexed else 60
    fill(str(store_dir), count)
    damage(store_dir, 30, value)
    code, out, _ = run("--store", str(store_dir), "db", "check")
    assert code == 1
    problems = [line for line in out.splitlines() if line.startswith("  problem")]
    assert problems[0].startswith("  problem  position 30")
    assert ("missing" if value is None else "cannot be read") in out
    # position 30 is the 30th append (n = 29): session:s2's version 10, named by the gap
    assert problems[0].startswith("  problem  position 30 session:s2: ")
    assert len(problems) == 1  # the gap it leaves is not a second problem
    assert out.splitlines()[-1] == "1 problem"


def test_an_index_stalled_behind_a_damaged_record_is_reported(store_dir: Path) -> None:
    fill(str(store_dir), 10)
    damage(store_dir, 5, GARBAGE)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("session:big", [msg(n) for n in range(INDEX_LAG + 20)])
    code, out, _ = run("--store", str(store_dir), "db", "check")
    assert code == 1
    assert "  problem  position 5: the index stops at 4" in out
    [unreadable] = [line for line in out.splitlines() if "cannot be read" in line]
    assert unreadable.startswith("  problem  position 5 session:s1: cannot be read")
    assert unreadable.endswith("by the stream's versions it held version 2")
    # every other stream reads whole: no problem names them
    assert "session:big" not in out


def test_the_json_report(store_dir: Path) -> None:
    fill(str(store_dir), 20)
    damage(store_dir, 7, GARBAGE)
    code, out, _ = run("--store", str(store_dir), "db", "check", "--json")
    assert code == 1
    report = json.loads(out)
    assert (report["records"], report["head"], report["streams"]) == (19, 20, 3)
    assert report["details"]["format"] == "stalwart-lmdb-3"
    assert report["problems"][0]["position"] == 7


def test_a_missing_store_is_one_line_and_exit_1(tmp_path: Path) -> None:
    code, out, err = run("--store", str(tmp_path / "none"), "db", "check")
    assert code == 1
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("stalwart: error: no stalwart store")


def test_a_postgresql_store_is_checked_through_the_same_reads(pg_url: str) -> None:
    fill(pg_url, 40)
    with store_module.open(pg_url) as store:  # type: ignore[attr-defined]
        report = check_store(store)
        assert report.records == store.head() == 40
    assert report.ok, report.problems
    assert report.details == {}
    code, out, _ = run("--store", pg_url, "db", "check")
    assert code == 0
    assert out.splitlines()[-1] == "consistent"


# Was: DEFECT: `db check --json` wrote a stream id's C1 control (U+009B starts a terminal
# escape sequence) raw: JSON escapes only U+0000-U+001F; the other outputs escape it.
def test_the_json_report_escapes_what_a_terminal_acts_on(store_dir: Path) -> None:
    stream = "session:a\u009b31m"
    with store_module.open(str(store_dir)) as store:  # type: ignore[attr-defined]
        store.append(stream, [msg(1), msg(2)])
        store.append("session:b", [msg(3)])
    damage(store_dir, 1, None)
    code, out, _ = run("--store", str(store_dir), "db", "check", "--json")
    assert code == 1
    assert "\u009b" not in out
    assert "\\u009b" in out
    report = json.loads(out)
    assert any(problem["stream"] == stream for problem in report["problems"])
