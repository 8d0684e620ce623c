"""The PostgreSQL store shared by processes: tailing across them, and no reader ever
seeing a gap while several processes append at once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stalwart.events import RecordedEvent
from stalwart.store import PostgresEventStore

CHILD = str(Path(__file__).with_name("_pg_child.py"))
ROOT = str(Path(__file__).resolve().parent.parent)


def _child(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, CHILD, *args], cwd=ROOT)


@pytest.mark.slow
def test_a_subscriber_sees_another_process_append_within_100_ms(pg_url: str) -> None:
    count = 30
    with PostgresEventStore(pg_url) as store:
        store.append("s:warm", [])  # the schema exists before the child opens it
        seen: list[tuple[RecordedEvent, float]] = []
        with store.subscribe(1) as subscription:
            assert subscription.poll(0.1) == []  # the listener is up
            child = _child("paced", pg_url, str(count), "0.01")
            try:
                deadline = time.time() + 30
                while len(seen) < count and time.time() < deadline:
                    for record in subscription.poll(1):
                        seen.append((record, time.time()))
            finally:
                child.wait(30)
    assert child.returncode == 0
    assert [r.position for r, _ in seen] == list(range(1, count + 1))
    # ts is stamped just before the child's commit: the lag bounds commit -> here
    lags = sorted(arrived - record.ts for record, arrived in seen)
    assert lags[len(lags) // 2] < 0.05, lags
    assert lags[int(len(lags) * 0.9)] < 0.1, lags


def _follow(store: PostgresEventStore, total: int, out: list[int], errors: list[str]) -> None:
    """Check every event arrives exactly once, in position order, with stream versions
    in order: a skipped position would show as a jump here."""
    versions: dict[str, int] = {}
    expected = 1
    with store.subscribe(1) as subscription:
        while expected <= total:
            records = subscription.poll(10)
            if not records:
                errors.append(f"stalled at position {expected}")
                return
            for record in records:
                if record.position != expected:
                    errors.append(f"expected position {expected}, got {record.position}")
                    return
                if record.version != versions.get(record.stream, 0) + 1:
                    errors.append(f"{record.stream} jumped to version {record.version}")
                    return
                versions[record.stream] = record.version
                expected += 1
    out.append(expected - 1)


@pytest.mark.slow
def test_no_reader_sees_a_gap_while_processes_append(pg_url: str) -> None:
    procs, each = 4, 150
    total = procs * sum(1 + i % 3 for i in range(each))
    with PostgresEventStore(pg_url) as store:
        store.append("s:warm", [])
        done: list[int] = []
        errors: list[str] = []
        followers = [
            threading.Thread(target=_follow, args=(store, total, done, errors)) for _ in range(3)
        ]
        for follower in followers:
            follower.start()
        children = [_child("hammer", pg_url, f"p{n}", str(each)) for n in range(procs)]
        for child in children:
            assert child.wait(60) == 0
        for follower in followers:
            follower.join(60)
        assert errors == []
        assert done == [total] * 3
        records = list(store.read_all())
        assert [r.position for r in records] == list(range(1, total + 1))
        assert store.head() == total


@pytest.mark.slow
def test_version_and_fence_races_across_processes_have_one_winner(pg_url: str) -> None:
    procs, rounds = 3, 30
    with PostgresEventStore(pg_url) as store:
        store.append("s:warm", [])
        children = [
            subprocess.Popen(
                [sys.executable, CHILD, "race", pg_url, f"p{n}", str(rounds)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
            )
            for n in range(procs)
        ]
        outputs = [child.communicate(timeout=60)[0] for child in children]
        assert [child.returncode for child in children] == [0] * procs
        wins = [json.loads(out) for out in outputs]
        # each round's stream was created exactly once, by one of 12 racing threads
        assert sum(w["created"] for w in wins) == rounds
        assert all(store.stream_version(f"s:new-{r}") == 1 for r in range(rounds))
        # every claim written raised the epoch: strictly increasing, none twice
        claims = [int(r.event.message_id.split("/")[0]) for r in store.read_stream("s:claim")]  # type: ignore[attr-defined]
        assert claims == sorted(set(claims))
        assert len(claims) == sum(w["claimed"] for w in wins)
        assert store.lease_epoch("s:claim") == claims[-1]
        assert store.head() == rounds + len(claims)
