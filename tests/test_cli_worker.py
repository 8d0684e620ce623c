"""``stalwart session send`` and ``stalwart worker``: a message given from the command line
is answered by a worker process started from the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    AnnouncementQueued,
    LeaseExpired,
    RecordedEvent,
)
from stalwart.testing import Answer, FakeProvider, Hang

GUARD = 30.0


def _config(tmp_path: Path, base_url: str) -> Path:
    path = tmp_path / "stalwart.toml"
    path.write_text(
        f"""
[store]
location = "{tmp_path / "store"}"

[providers.main]
kind = "openai"
base_url = "{base_url}"

[agents.default]
provider = "main"
model = "m1"

[activations]
poll_ms = 50
"""
    )
    return path


def test_a_message_sent_from_the_cli_is_answered_by_a_worker_process(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "session", "send", "s1", "hi"])
    assert result.exit_code == 0, result.output
    activation = result.stdout.strip()
    with FakeProvider() as fake:
        fake.set_default(Answer(text="hello from the worker"))
        config = _config(tmp_path, fake.base_url)
        worker = subprocess.Popen(
            [sys.executable, "-m", "stalwart", "worker", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            give_up = time.monotonic() + GUARD
            with store_module.open(store_dir) as store:
                while True:
                    records = list(store.read_stream("session:s1"))
                    if any(isinstance(r.event, ActivationAcked) for r in records):
                        break
                    assert time.monotonic() < give_up, [r.type for r in records]
                    store.wait_for(store.head() + 1, 0.5)
        finally:
            worker.send_signal(signal.SIGTERM)
            out, err = worker.communicate(timeout=GUARD)
    assert worker.returncode == 0, err
    assert "hello from the worker" in out  # the console channel of the worker
    assert err.startswith("worker ")
    assert "stopping" in err
    [ready] = [r.event for r in records if isinstance(r.event, ActivationReady)]
    assert ready.activation_id == activation
    [queued] = [r.event for r in records if isinstance(r.event, AnnouncementQueued)]
    assert queued.text == "hello from the worker"


def test_worker_with_a_bad_config_is_one_line_and_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[activations]\nlease_ttl_ms = -1\n")
    result = CliRunner().invoke(cli, ["worker", "--config", str(bad)])
    assert result.exit_code == 1
    assert "lease_ttl_ms" in result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_send_says_when_it_creates_the_store(tmp_path: Path) -> None:
    """A mistyped --store used to make a new empty store no worker reads, silently, with
    exit 0: the message waited there for ever. The first send still works (nothing else
    need run first), and says on stderr that it made a new store; the next one does not."""
    store_dir = tmp_path / "typo"
    first = CliRunner().invoke(cli, ["--store", str(store_dir), "session", "send", "s1", "hi"])
    assert first.exit_code == 0, first.output
    assert first.stderr == f"stalwart: no store was at {store_dir}: created a new one\n"
    again = CliRunner().invoke(cli, ["--store", str(store_dir), "session", "send", "s1", "more"])
    assert (again.exit_code, again.stderr) == (0, "")
    with store_module.open(store_dir, create=False) as store:
        assert store.stream_version("session:s1") == 3


def _worker(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stalwart", "worker", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stream_until(store_dir: Path, done: Callable[[list[RecordedEvent]], bool]) -> list[Any]:
    give_up = time.monotonic() + GUARD
    with store_module.open(store_dir, read_only=True) as store:
        while True:
            records = list(store.read_stream("session:s1"))
            if done(records):
                return records
            assert time.monotonic() < give_up, [r.type for r in records]
            store.wait_for(store.head() + 1, 0.5)


def test_a_worker_stopped_by_sigterm_mid_wake_hands_its_lease_back(tmp_path: Path) -> None:
    """SIGTERM while the model call hangs: the worker stops cleanly and records
    ``activation:released`` for the wake, so a second worker answers it at once (the
    default lease TTL is 30 s; this test's guard would run out long before) and no failed
    attempt is counted (no ``lease:expired``, no requeue)."""
    store_dir = tmp_path / "store"
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "session", "send", "s1", "hi"])
    assert result.exit_code == 0, result.output
    with FakeProvider() as fake:
        fake.add(Hang())
        fake.set_default(Answer(text="answered after the restart"))
        config = _config(tmp_path, fake.base_url)
        first = _worker(config)
        try:
            fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        finally:
            first.send_signal(signal.SIGTERM)
            _, err = first.communicate(timeout=GUARD)
        assert first.returncode == 0, err
        records = _stream_until(
            store_dir, lambda rs: any(isinstance(r.event, ActivationReleased) for r in rs)
        )
        second = _worker(config)
        try:
            records = _stream_until(
                store_dir, lambda rs: any(isinstance(r.event, ActivationAcked) for r in rs)
            )
        finally:
            second.send_signal(signal.SIGTERM)
            out, err = second.communicate(timeout=GUARD)
    assert second.returncode == 0, err
    assert "answered after the restart" in out
    events = [r.event for r in records]
    [released] = [e for e in events if isinstance(e, ActivationReleased)]
    leases = [e for e in events if isinstance(e, ActivationLeased)]
    assert [lease.epoch for lease in leases] == [released.epoch, released.claimed + 1]
    assert not [e for e in events if isinstance(e, LeaseExpired | ActivationRequeued)]
