"""Durable sessions across real processes: worker processes on one store (an LMDB
directory, or one PostgreSQL database), SIGKILLed at random points over 50 seeded rounds,
a worker frozen with SIGSTOP past its lease, and three workers splitting the sessions.

What must hold, read from the log alone:

- every message whose ``send_message`` returned is in the log (no acknowledged loss);
- every activation is settled exactly once, and its user message joins the conversation
  exactly once, whatever number of wakes it took;
- per session, lease epochs only grow and every settlement carries the epoch of the
  lease in force when it was appended (a stale holder never settles);
- a frozen holder, thawed after a takeover, appends nothing but its ``lease_lost``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

from stalwart import store as store_module
from stalwart.cli._replay import verify_store
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
    ActivationRequeued,
    AnnouncementDelivered,
    MessageAppended,
    PromptCompleted,
    PromptStarted,
)
from stalwart.runtime import send_message
from stalwart.state import ACTIVATIONS, fold
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider

from . import _durable_child

ROUNDS = 50
SESSIONS = 6
LEASES = {"lease_ttl_ms": 600, "renew_every_ms": 150, "poll_ms": 50, "backoff_base_ms": 100}
CALM_LEASES = LEASES | {"lease_ttl_ms": 5_000, "renew_every_ms": 500}
SETTLE_S = 90.0

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["tests._durable_child"])


class Worker:
    """One worker process; ``owner`` is its worker's lease owner name (waiting until the
    process is up: a kill may land while it is still starting, itself a crash point)."""

    def __init__(self, location: str, base_url: str, settings: dict[str, Any]) -> None:
        ready = _CONTEXT.Queue()
        self.process: BaseProcess = _CONTEXT.Process(
            target=_durable_child.run,
            args=(location, base_url, settings, ready),
            daemon=True,
        )
        self.process.start()
        self._ready = ready
        self._owner: str | None = None

    @property
    def owner(self) -> str:
        if self._owner is None:
            self._owner = self._ready.get(timeout=30)
        return self._owner

    def signal(self, signum: int) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
        assert self.process.exitcode == -signal.SIGKILL

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(15)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)


@pytest.fixture(params=["lmdb", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the workers' shared store is: an LMDB directory or a PostgreSQL URL."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("pg_url")
        return url
    return str(tmp_path / "store")


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def _all_settled(store: EventStore) -> bool:
    for info in store.streams():
        if info.stream.startswith("session:"):
            state = fold(ACTIVATIONS, info.stream, store.read_stream(info.stream))
            if state.queue or state.lease is not None:
                return False
    return True


def _wait(store: EventStore, done: Any, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while not done(store):
        assert time.monotonic() < give_up, "the work was not settled in time"
        store.wait_for(store.head() + 1, 0.2)


def check_log(store: EventStore, acknowledged: list[str]) -> Counter[str]:
    """The invariants above; returns how each activation was settled."""
    ready: dict[str, ActivationReady] = {}
    settled: Counter[str] = Counter()
    how: Counter[str] = Counter()
    users: Counter[str] = Counter()
    for info in store.streams():
        if not info.stream.startswith("session:"):
            continue
        lease: ActivationLeased | None = None
        epoch = 0
        for record in store.read_stream(info.stream):
            event = record.event
            if isinstance(event, ActivationReady):
                ready[event.activation_id] = event
            elif isinstance(event, ActivationLeased):
                assert event.epoch > epoch, f"epoch went back at {record.position}"
                epoch, lease = event.epoch, event
            elif isinstance(event, ActivationAcked | ActivationBlocked | ActivationRequeued):
                assert lease is not None, record
                assert event.epoch == epoch == lease.epoch, record
                if not isinstance(event, ActivationRequeued):
                    ids = {event.activation_id, *lease.covers}
                    settled.update(ids)
                    how.update({type(event).__name__: len(ids)})
                lease = None
            elif isinstance(event, ActivationAbandoned):
                settled[event.activation_id] += 1
                how["ActivationAbandoned"] += 1
                epoch = max(epoch, event.epoch)
                lease = None
            elif isinstance(event, ActivationCancelled):
                settled[event.activation_id] += 1
            elif isinstance(event, MessageAppended) and event.role == "user":
                users[event.message_id] += 1
    assert set(acknowledged) <= set(ready), "an acknowledged message is missing"
    assert set(settled) == set(ready), "an activation was never settled"
    assert set(settled.values()) == {1}, settled
    messages = {r.message_id for r in ready.values() if r.kind == "message"}
    answered = {
        r.message_id for r in ready.values() if r.kind == "message" and settled[r.activation_id]
    }
    abandoned = how["ActivationAbandoned"]
    assert all(users[m] <= 1 for m in messages)  # never appended twice
    assert len(answered) - abandoned <= sum(users.values()) <= len(messages)
    report = verify_store(store, None)  # replay --verify: every decision follows
    assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]
    assert report.checked["activation:leased"] > 0
    return how


def test_sigkill_at_random_points_never_loses_or_repeats_work(
    location: str, workers: list[Worker]
) -> None:
    store = store_module.open(location)
    acknowledged: list[str] = []
    with FakeProvider() as fake:
        fake.set_default(Answer(text="ok", first_delay_ms=20))
        workers.extend(Worker(location, fake.base_url, LEASES) for _ in range(2))
        assert all(worker.owner for worker in workers)
        for seed in range(ROUNDS):
            chance = random.Random(seed)
            for _ in range(chance.randint(1, 3)):
                session = f"s{chance.randrange(SESSIONS)}"
                acknowledged.append(send_message(store, session, f"round {seed}", channel="chat"))
            time.sleep(chance.uniform(0.0, 0.25))  # real-time: the SIGKILL lands at a seeded moment
            victim = chance.randrange(len(workers))
            workers[victim].kill()
            workers[victim] = Worker(location, fake.base_url, LEASES)
        _wait(store, _all_settled, SETTLE_S)
    how = check_log(store, acknowledged)
    expired = sum(r.type == "lease:expired" for r in store.read_all())
    print(f"settled: {dict(how)}; takeovers of a dead holder's lease: {expired}")
    assert how["ActivationAcked"] > 0
    assert expired > 0  # kills did land mid-wake: the takeover path ran
    store.close()


def test_a_frozen_holder_is_fenced_out_after_the_takeover(
    location: str, workers: list[Worker]
) -> None:
    store = store_module.open(location)
    settings = {"lease_ttl_ms": 800, "renew_every_ms": 200, "poll_ms": 50}
    with FakeProvider() as fake:
        fake.add(Answer(text="from the frozen one", first_delay_ms=1_500))
        fake.set_default(Answer(text="from the new holder"))
        frozen = Worker(location, fake.base_url, settings)
        workers.append(frozen)
        assert frozen.owner
        acknowledged = [send_message(store, "s1", "hello", channel="chat")]
        fake.wait_for(lambda requests: len(requests) == 1, 30)
        frozen.signal(signal.SIGSTOP)
        workers.append(Worker(location, fake.base_url, settings))
        # settled, and the new holder's answer delivered: it appends nothing more
        _wait(store, lambda s: _all_settled(s) and _has(s, AnnouncementDelivered), 30)
        takeover = store.head()
        frozen.signal(signal.SIGCONT)
        _wait(store, lambda s: _has(s, ActivationLeaseLost), 30)
        fake.wait_finished(0, 30)  # the thawed holder's call ended (or was cancelled)
        frozen.stop()  # a clean stop: whatever it still had in flight has run its course
    records = list(store.read_stream("session:s1"))
    after = [r for r in records if r.position > takeover]
    assert [r.type for r in after] == ["activation:lease_lost"]
    [lost] = [r.event for r in after]
    assert isinstance(lost, ActivationLeaseLost)
    assert (lost.owner, lost.epoch, lost.current_epoch) == (frozen.owner, 1, 2)
    [acked] = [r.event for r in records if isinstance(r.event, ActivationAcked)]
    assert acked.epoch == 2
    assert sum(isinstance(r.event, PromptStarted) for r in records) == 2
    assert sum(isinstance(r.event, PromptCompleted) for r in records) == 1
    check_log(store, acknowledged)
    store.close()


def _has(store: EventStore, kind: type) -> bool:
    return any(isinstance(r.event, kind) for r in store.read_stream("session:s1"))


def test_three_workers_split_the_sessions_with_no_overlapping_lease(
    location: str, workers: list[Worker]
) -> None:
    store = store_module.open(location)
    acknowledged: list[str] = []
    with FakeProvider() as fake:
        fake.set_default(Answer(text="ok", first_delay_ms=30))
        # leases far longer than a loaded machine's stalls: no live lease may expire here
        workers.extend(Worker(location, fake.base_url, CALM_LEASES) for _ in range(3))
        assert all(worker.owner for worker in workers)
        for i in range(36):
            acknowledged.append(send_message(store, f"s{i % 12}", f"message {i}", channel="chat"))
            time.sleep(0.02)  # real-time: messages arrive over time, at every worker's polls
        _wait(store, _all_settled, SETTLE_S)
    how = check_log(store, acknowledged)  # epochs grow, each settlement under its lease
    assert how == {"ActivationAcked": 36}
    records = list(store.read_all())
    assert not [r for r in records if r.type in ("lease:expired", "activation:lease_lost")]
    owners = Counter(r.event.owner for r in records if isinstance(r.event, ActivationLeased))
    print(f"leases per worker: {sorted(owners.values())}")
    assert set(owners) == {worker.owner for worker in workers}  # each worker leased some
    store.close()
