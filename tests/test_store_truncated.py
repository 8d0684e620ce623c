"""A store whose ``data.mdb`` was cut short (a copy interrupted, a disk that filled mid-
copy): LMDB maps the file and a read past its end kills the process with SIGBUS. The
store refuses it at open with a typed error, and the CLI says so in one line, exit 1.
Run in subprocesses: before the fix the process died of the signal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import store as store_module
from tests.store_contract import msg


def _filled(path: Path) -> int:
    with store_module.open(path) as store:  # type: ignore[attr-defined]
        for n in range(2_000):
            store.append(f"session:s{n % 10}", [msg(n)])
    return (path / "data.mdb").stat().st_size


def _cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", str(path), *args],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# Was: DEFECT: reading a store whose data.mdb was cut in half died of SIGBUS (exit 135).
@pytest.mark.parametrize("keep", [0.5, 0.1])
def test_a_data_file_cut_short_is_refused_in_one_line(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "store"
    size = _filled(path)
    os.truncate(path / "data.mdb", int(size * keep) // 4096 * 4096)
    for args in (("tail",), ("replay", "--all", "--verify"), ("db", "check"), ("streams",)):
        done = _cli(path, *args)
        assert done.returncode == 1, (args, done.returncode, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr
        assert "cut short" in done.stderr
    probe = f"from stalwart import store; store.open({str(path)!r})"
    opened = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True
    )
    assert opened.returncode == 1  # a StoreError raised, not a signal
    assert "StoreError" in opened.stderr


def test_a_whole_store_opens(tmp_path: Path) -> None:
    path = tmp_path / "store"
    _filled(path)
    done = _cli(path, "streams")
    assert done.returncode == 0, done.stderr
