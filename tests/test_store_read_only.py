"""Stores opened read-only, as the CLI's read commands open them: nothing is written, not
even a format upgrade, every write is a typed error, and a read-only mount can be read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.errors import StoreError, StoreNotFoundError, StoreReadOnlyError
from stalwart.store import LmdbEventStore, Snapshot
from stalwart.store._postgres_schema import SCHEMA_VERSION
from tests._postgres import install_old_schema, installed_schema
from tests.store_contract import msg
from tests.test_store_index_lag import (
    STREAMS,
    check_reads,
    interleave,
    make_format_1,
    meta,
)

WAIT = 60.0  # seconds a child process may take before the test fails rather than hangs


def _writes(store: store_module.EventStore) -> list[tuple[str, object]]:
    """Every kind of write a store takes, as thunks."""
    snapshot = Snapshot(stream="session:a", name="session", version=1, position=1, data=b"x")
    return [
        ("append", lambda: store.append("session:a", [msg("no")])),
        ("put_snapshot", lambda: store.put_snapshot(snapshot)),
        ("claim_due", lambda: store.claim_due("w", 0.0, 10, 5.0)),  # type: ignore[attr-defined]
        ("set_due", lambda: store.set_due("session:a", 1, None, "w")),  # type: ignore[attr-defined]
    ]


def test_a_read_only_handle_reads_and_refuses_every_write(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:
        store.append("session:a", [msg("one"), msg("two")])
    with store_module.open(store_dir, create=False, read_only=True) as reader:
        assert [r.event for r in reader.read_stream("session:a")] == [msg("one"), msg("two")]
        assert reader.head() == 2
        for name, write in _writes(reader):
            with pytest.raises(StoreReadOnlyError, match="opened read-only"):
                write()  # type: ignore[operator]
            assert reader.head() == 2, name


def test_read_only_never_creates_a_store(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(StoreNotFoundError):
        store_module.open(missing, read_only=True)  # create=True is overruled
    assert not missing.exists()


def test_an_lmdb_file_that_is_not_a_store_is_a_clear_error(tmp_path: Path) -> None:
    import lmdb

    other = tmp_path / "other"
    env = lmdb.open(str(other), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"key", b"value")
    env.close()
    with pytest.raises(StoreError, match="no stalwart store"):
        store_module.open(other, create=False, read_only=True)


def test_a_format_1_store_is_read_as_it_is_and_left_at_format_1(store_dir: Path) -> None:
    """A read command from a newer stalwart must not upgrade the store under the older
    stalwart still writing it; it reads it with the older format's rule (every record
    indexed)."""
    with store_module.open(store_dir) as store:
        interleave(store, 700)
        records = list(store.read_all())
    make_format_1(store_dir, records)
    with store_module.open(store_dir, create=False, read_only=True) as reader:
        assert list(reader.read_all()) == records
        check_reads(reader, STREAMS, len(records))
        assert reader.describe()["indexed"] == len(records)  # type: ignore[attr-defined]
    assert meta(store_dir, b"format") == b"stalwart-lmdb-1"
    assert meta(store_dir, b"indexed") is None
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "tail", "--json"])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == len(records)
    assert meta(store_dir, b"format") == b"stalwart-lmdb-1"


def test_a_writer_joining_a_read_only_handle_shares_its_environment(store_dir: Path) -> None:
    """LMDB allows one environment per file per process: a writing handle opened while a
    read-only one is open reopens the shared environment for writing; the reader goes on
    reading (and sees the new appends), and still refuses to write itself."""
    with store_module.open(store_dir) as store:
        store.append("session:a", [msg("one")])
    reader = store_module.open(store_dir, create=False, read_only=True)
    try:
        subscription = reader.subscribe(1)
        assert [r.event for r in subscription.poll(timeout=0)] == [msg("one")]
        with store_module.open(store_dir) as writer:
            writer.append("session:a", [msg("two")])
            assert [r.event for r in subscription.poll(timeout=WAIT)] == [msg("two")]
            assert [r.event for r in reader.read_stream("session:a")] == [msg("one"), msg("two")]
            with pytest.raises(StoreReadOnlyError):
                reader.append("session:a", [msg("no")])
        assert reader.head() == 2
        subscription.close()
    finally:
        reader.close()


def test_a_reader_opened_beside_a_writer_shares_it_and_refuses_writes(store_dir: Path) -> None:
    with store_module.open(store_dir) as writer:
        writer.append("session:a", [msg("one")])
        with store_module.open(store_dir, read_only=True) as reader:
            with pytest.raises(StoreReadOnlyError):
                reader.append("session:a", [msg("no")])
            writer.append("session:a", [msg("two")])
            assert reader.head() == 2
        writer.append("session:a", [msg("three")])  # the writer lives on after the reader
        assert writer.head() == 3


def test_a_read_only_reader_sees_another_processes_appends(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:
        store.append("session:a", [msg("one")])
    reader = LmdbEventStore(store_dir, create=False, read_only=True)
    try:
        code = (
            "import sys\n"
            "from stalwart import store\n"
            "from tests.store_contract import msg\n"
            "with store.open(sys.argv[1]) as s:\n"
            "    s.append('session:a', [msg('two')])\n"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(store_dir)],
            check=True,
            timeout=WAIT,
            cwd=Path(__file__).parent.parent,
        )
        assert reader.wait_for(2, timeout=WAIT) == 2
        assert [r.event for r in reader.read_stream("session:a")] == [msg("one"), msg("two")]
    finally:
        reader.close()


def _read_only_mount(directory: Path) -> list[str] | None:
    """The command prefix that runs what follows with ``directory`` bind-mounted
    read-only in a private mount namespace, or None when this machine does not allow it."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return None
    shell = (
        'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && '
        'if touch "$0/probe" 2>/dev/null; then exit 97; fi && exec "$@"'
    )
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell, str(directory), "true"],
        capture_output=True,
        timeout=WAIT,
        check=False,
    )
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", shell, str(directory)]


def test_the_cli_reads_a_store_on_a_read_only_mount(tmp_path: Path) -> None:
    """An operator reads a store from a read-only mount (a backup, a snapshot volume):
    ``tail``, ``streams`` and ``replay`` work; before, each failed to open it for writing."""
    directory = tmp_path / "mounted"
    directory.mkdir()
    store_dir = directory / "store"
    with store_module.open(store_dir) as store:
        store.append("session:a", [msg("one"), msg("two")])
    prefix = _read_only_mount(directory)
    if prefix is None:
        pytest.skip("cannot bind-mount read-only here (needs unshare and mount privileges)")
    env = {**os.environ, "STALWART_STORE": str(store_dir)}
    cli = [sys.executable, "-m", "stalwart"]
    out = {}
    for command in (["tail", "--json"], ["streams", "--json"], ["replay", "session:a", "--json"]):
        done = subprocess.run(
            [*prefix, *cli, *command],
            capture_output=True,
            text=True,
            timeout=WAIT,
            env=env,
            check=False,
        )
        assert done.returncode == 0, (command, done.stderr)
        out[command[0]] = done.stdout
    assert [json.loads(line)["version"] for line in out["tail"].splitlines()] == [1, 2]
    assert "session:a" in out["streams"]


def test_a_read_only_postgres_handle_refuses_writes(pg_url: str) -> None:
    with store_module.open(pg_url) as store:
        store.append("session:a", [msg("one")])
    with store_module.open(pg_url, create=False, read_only=True) as reader:
        assert [r.event for r in reader.read_stream("session:a")] == [msg("one")]
        for _, write in _writes(reader):
            with pytest.raises(StoreReadOnlyError):
                write()  # type: ignore[operator]
        assert reader.head() == 1


def test_a_read_only_postgres_open_leaves_an_older_schema_alone(pg_url: str) -> None:
    """A read command must not migrate a production database to this stalwart's schema
    behind the back of the workers still running the older one: it says how to migrate."""
    install_old_schema(pg_url, 1, ("session:old",))
    with pytest.raises(StoreError, match="stalwart db init") as caught:
        store_module.open(pg_url, create=False, read_only=True)
    assert not isinstance(caught.value, StoreNotFoundError)
    assert installed_schema(pg_url) == 1
    with store_module.open(pg_url, create=False) as store:  # a writing open migrates
        assert store.stream_version("session:old") == 1
    assert installed_schema(pg_url) == SCHEMA_VERSION
