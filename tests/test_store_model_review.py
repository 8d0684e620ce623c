"""Adversarial review: the EventStore against a plain-Python model, on both backends.

A hypothesis state machine drives a real store (an LMDB directory that starts with a tiny
map, or a fresh PostgreSQL schema) and a model side by side: appends with every kind of
expectation and fence, explicit timestamps, big payloads, snapshots, closing and reopening,
a second handle on the same location, a live subscription. After every step the two must
agree on everything the protocol lets a caller see. The direct tests after it probe edge
inputs and compare what the two backends do with the same call. Tests marked ``# Was:``
failed on ``1ae0d67`` (the checks now live in ``checked_events`` and ``check_snapshot``,
shared by both backends).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import (
    ConcurrencyError,
    FencedError,
)
from stalwart.events import MessageAppended, RecordedEvent
from stalwart.store import NO_STREAM, EventStore, Fence, NewEvent, Snapshot
from stalwart.store._lmdb import LmdbEventStore
from stalwart.store._protocol import MAX_STREAM_BYTES
from stalwart.store._subscription import Subscription
from stalwart.testing import PostgresServer

from ._runtime_support import reap

START = 1_800_000_000.0
#: the streams the machine writes: a session (the work-queue path), a prefix pair, odd
#: unicode (astral, right-to-left override, combining mark, control characters) and an id
#: of exactly the longest length in multi-byte characters
STREAMS = (
    "session:a",
    "s:a",
    "s:a\x01",
    "s:\U0001f600\u202e\u0301",
    "s:\x7f\n\t",
    "é" * (MAX_STREAM_BYTES // 2),
)
FOLDS = ("f@v1", "g@v2")
SNAPSHOTS_KEPT = 3
_schemas = itertools.count(1)

#: another process with its own handles: appends what the parent asks, on its clock time
CHILD = r"""
import json, sys
from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import ConcurrencyError
from stalwart.events import MessageAppended
from stalwart.store import LmdbEventStore

stores, clocks = {}, {}
for line in sys.stdin:
    job = json.loads(line)
    where = job["at"]
    if job["op"] == "close":
        stores.pop(where).close()
        print(json.dumps({"ok": []}), flush=True)
        continue
    if where not in stores:
        clocks[where] = FakeClock(job["now"])
        if "://" in where:
            stores[where] = store_module.open(where, clock=clocks[where])
        else:
            stores[where] = LmdbEventStore(where, map_size=256 * 1024, clock=clocks[where])
    clocks[where].set(job["now"])
    news = [
        MessageAppended(message_id=f"{job['tag']}.{k}", role="user", content="p" * job["size"])
        for k in range(job["n"])
    ]
    try:
        done = stores[where].append(job["stream"], news, expected_version=job["expected"])
    except ConcurrencyError as exc:
        print(json.dumps({"conflict": [exc.stream, exc.expected, exc.actual]}), flush=True)
        continue
    print(json.dumps({"ok": [[r.position, r.version, r.id, r.ts] for r in done]}), flush=True)
"""


class _Child:
    """One long-lived child process for a whole test: a handle per location in it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the child process died (exit {self.proc.poll()})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            reap(self.proc)


def _msg(n: int | str, content: str = "x") -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content=content)


class _Model:
    """What the store must hold: every acknowledged record, and what follows from them."""

    def __init__(self) -> None:
        self.log: list[RecordedEvent] = []
        self.epochs: dict[str, int] = {}
        self.snapshots: dict[tuple[str, str], dict[int, Snapshot]] = {}

    def version(self, stream: str) -> int:
        return sum(1 for r in self.log if r.stream == stream)

    def stream(self, stream: str) -> list[RecordedEvent]:
        return [r for r in self.log if r.stream == stream]

    def infos(self) -> list[tuple[str, int, int, float, int]]:
        last: dict[str, RecordedEvent] = {}
        for record in self.log:
            last[record.stream] = record
        return [
            (s, r.version, r.position, r.ts, self.epochs.get(s, 0)) for s, r in sorted(last.items())
        ]

    def put(self, snapshot: Snapshot) -> None:
        kept = self.snapshots.setdefault((snapshot.stream, snapshot.name), {})
        kept[snapshot.version] = snapshot
        for version in sorted(kept)[:-SNAPSHOTS_KEPT]:
            del kept[version]

    def newest_first(self, stream: str, name: str) -> list[Snapshot]:
        kept = self.snapshots.get((stream, name), {})
        return [kept[v] for v in sorted(kept, reverse=True)]


class StoreMachine(RuleBasedStateMachine):
    """Two handles at most (``a`` always open, ``b`` sometimes) on one location."""

    #: set by the test before the machine runs: opens a handle on the example's location
    open_at: Callable[[str, FakeClock], EventStore]
    #: a fresh location for each example
    new_location: Callable[[], str]
    #: another process appending to the same location
    child: _Child

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(start=START)
        self.location = type(self).new_location()
        self.model = _Model()
        self.a: EventStore = self._open()
        self.b: EventStore | None = None
        self.sub: Subscription = self.a.subscribe(1)
        self.sub_on: EventStore = self.a  # the handle the live feed reads through
        self.seen: list[RecordedEvent] = []
        self.child_open = False

    def _open(self) -> EventStore:
        return type(self).open_at(self.location, self.clock)

    def _handle(self, second: bool) -> EventStore:
        return self.b if second and self.b is not None else self.a

    # -- appends -------------------------------------------------------------------------------

    def _acknowledged(self, stream: str, recorded: list[RecordedEvent], news: list[Any]) -> None:
        before = len(self.model.log)
        version = self.model.version(stream)
        assert [(r.position, r.stream, r.version) for r in recorded] == [
            (before + 1 + i, stream, version + 1 + i) for i in range(len(news))
        ], "an acknowledged append must take the next positions and versions, without gaps"
        for record, new in zip(recorded, news, strict=True):
            event = new.event if isinstance(new, NewEvent) else new
            assert record.event == event
            if isinstance(new, NewEvent):
                assert record.ts == (self.clock.now() if new.ts is None else float(new.ts))
                assert (record.causation_id, record.correlation_id) == (
                    new.causation_id,
                    new.correlation_id,
                )
                if new.id:
                    assert record.id == new.id
            else:
                assert record.ts == self.clock.now()
        self.model.log.extend(recorded)

    @rule(
        stream=st.sampled_from(STREAMS),
        count=st.integers(min_value=0, max_value=4),
        expect=st.sampled_from(["any", "right", "wrong", "no_stream"]),
        stamps=st.lists(st.none() | st.floats(-1e12, 1e12, allow_nan=False), max_size=4),
        second=st.booleans(),
    )
    def append(
        self,
        stream: str,
        count: int,
        expect: str,
        stamps: list[float | None],
        second: bool,
    ) -> None:
        store = self._handle(second)
        version = self.model.version(stream)
        expected = {
            "any": None,
            "right": version,
            "wrong": version + 1 if version % 2 else max(version - 1, 7),
            "no_stream": NO_STREAM,
        }[expect]
        n = len(self.model.log)
        news: list[Any] = []
        for i in range(count):
            ts = stamps[i] if i < len(stamps) else None
            if ts is None and i % 2:
                news.append(_msg(f"{n}.{i}"))
            else:
                news.append(NewEvent(event=_msg(f"{n}.{i}"), ts=ts, causation_id=f"c{n}"))
        head = store.head()
        if expected is not None and expected != version:
            with pytest.raises(ConcurrencyError) as caught:
                store.append(stream, news, expected_version=expected)
            err = caught.value
            assert (err.stream, err.expected, err.actual) == (stream, expected, version)
            assert store.head() == head, "a refused append must write nothing"
            return
        recorded = store.append(stream, news, expected_version=expected)
        if not news:
            assert recorded == []
            return
        self._acknowledged(stream, recorded, news)

    @rule(
        stream=st.sampled_from(STREAMS),
        step=st.integers(min_value=-1, max_value=2),
        claim=st.booleans(),
        second=st.booleans(),
    )
    def append_fenced(self, stream: str, step: int, claim: bool, second: bool) -> None:
        store = self._handle(second)
        current = self.model.epochs.get(stream, 0)
        epoch = max(current + step, 0)
        holds = epoch > current if claim else epoch == current
        news = [_msg(f"fenced{len(self.model.log)}")]
        if not holds:
            with pytest.raises(FencedError) as caught:
                store.append(stream, news, fence=Fence(epoch, claim=claim))
            err = caught.value
            assert (err.stream, err.held, err.current, err.claim) == (
                stream,
                epoch,
                current,
                claim,
            )
            return
        recorded = store.append(stream, news, fence=Fence(epoch, claim=claim))
        self._acknowledged(stream, recorded, news)
        self.model.epochs[stream] = epoch

    @rule(stream=st.sampled_from(STREAMS), kib=st.integers(min_value=64, max_value=600))
    def append_big(self, stream: str, kib: int) -> None:
        """Payloads that outgrow the tiny initial LMDB map several times over."""
        news = [_msg(len(self.model.log), content="y" * (kib * 1024))]
        self._acknowledged(stream, self.a.append(stream, news), news)

    @rule(stream=st.sampled_from(STREAMS), count=st.integers(min_value=100, max_value=400))
    def append_bulk(self, stream: str, count: int) -> None:
        """One append of many events: a few of them carry the log past the LMDB index lag
        (512 records), so reads mix the index and the log after its mark."""
        n = len(self.model.log)
        news = [_msg(f"{n}.{i}") for i in range(count)]
        self._acknowledged(stream, self.a.append(stream, news), news)

    @rule(
        plan=st.lists(
            st.tuples(st.sampled_from(STREAMS[:3]), st.integers(1, 3), st.booleans()),
            min_size=2,
            max_size=6,
        ),
        guarded=st.booleans(),
    )
    def concurrent_appends(self, plan: list[tuple[str, int, bool]], guarded: bool) -> None:
        """Threads on both handles append at once; with ``guarded`` each expects the
        version the stream had before, so exactly one per stream may win."""
        start = {stream: self.model.version(stream) for stream, _, _ in plan}
        barrier = threading.Barrier(len(plan))
        results: list[tuple[str, int, list[RecordedEvent] | BaseException]] = []
        lock = threading.Lock()

        def work(i: int, stream: str, count: int, second: bool) -> None:
            store = self._handle(second)
            news = [_msg(f"t{len(self.model.log)}.{i}.{k}") for k in range(count)]
            expected = start[stream] if guarded else None
            barrier.wait(timeout=30)
            try:
                outcome: list[RecordedEvent] | BaseException = store.append(
                    stream, news, expected_version=expected
                )
            except BaseException as exc:
                outcome = exc
            with lock:
                results.append((stream, count, outcome))

        threads = [threading.Thread(target=work, args=(i, *step)) for i, step in enumerate(plan)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == len(plan), "an append never returned"
        written: list[RecordedEvent] = []
        for stream, count, outcome in results:
            if isinstance(outcome, ConcurrencyError):
                assert guarded
                assert outcome.expected == start[stream]
                continue
            assert isinstance(outcome, list), f"an append failed: {outcome!r}"
            assert len(outcome) == count
            positions = [r.position for r in outcome]
            assert positions == list(range(positions[0], positions[0] + count)), (
                "one append's events must be contiguous in the log"
            )
            written.extend(outcome)
        if guarded:
            winners = [s for s, _, o in results if isinstance(o, list)]
            assert sorted(winners) == sorted(start), "exactly one guarded append per stream wins"
        written.sort(key=lambda r: r.position)
        n = len(self.model.log)
        assert [r.position for r in written] == list(range(n + 1, n + 1 + len(written)))
        for stream, before in start.items():
            versions = [r.version for r in written if r.stream == stream]
            assert versions == list(range(before + 1, before + 1 + len(versions)))
        assert all(r.ts == self.clock.now() for r in written)
        self.model.log.extend(written)

    @rule(
        stream=st.sampled_from(STREAMS),
        count=st.integers(min_value=1, max_value=3),
        expect=st.sampled_from(["any", "right", "wrong"]),
        kib=st.sampled_from([0, 0, 0, 300]),
    )
    def append_from_another_process(self, stream: str, count: int, expect: str, kib: int) -> None:
        """A second process appends; this process's handles must see it as their own."""
        version = self.model.version(stream)
        expected = {"any": None, "right": version, "wrong": version + 5}[expect]
        tag = f"child{len(self.model.log)}"
        answer = type(self).child.ask(
            op="append",
            at=self.location,
            stream=stream,
            n=count,
            expected=expected,
            now=self.clock.now(),
            tag=tag,
            size=kib * 1024,
        )
        self.child_open = True
        if expect == "wrong":
            assert answer == {"conflict": [stream, version + 5, version]}
            return
        n = len(self.model.log)
        assert [row[:2] for row in answer["ok"]] == [
            [n + 1 + k, version + 1 + k] for k in range(count)
        ]
        got = list(self.a.read_all(n + 1))
        assert [(r.position, r.version, r.id, r.ts) for r in got] == [
            tuple(row) for row in answer["ok"]
        ]
        assert [r.event.message_id for r in got] == [f"{tag}.{k}" for k in range(count)]  # type: ignore[attr-defined]
        self.model.log.extend(got)

    @rule(seconds=st.floats(0.001, 3600.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # -- snapshots -----------------------------------------------------------------------------

    @rule(
        stream=st.sampled_from(STREAMS),
        name=st.sampled_from(FOLDS),
        version=st.integers(min_value=0, max_value=12),
        data=st.binary(max_size=64),
    )
    def put_snapshot(self, stream: str, name: str, version: int, data: bytes) -> None:
        snapshot = Snapshot(stream=stream, name=name, version=version, position=version, data=data)
        self.a.put_snapshot(snapshot)
        self.model.put(snapshot)

    # -- handles -------------------------------------------------------------------------------

    @rule()
    def reopen(self) -> None:
        """Close the main handle and open it again: everything acknowledged is still there."""
        if self.sub_on is self.a:
            self.sub.close()
        self.a.close()
        self.a = self._open()
        if self.sub.closed:
            self.sub, self.sub_on = self.a.subscribe(len(self.seen) + 1), self.a

    @precondition(lambda self: self.b is None)
    @rule()
    def open_second(self) -> None:
        self.b = self._open()

    @precondition(lambda self: self.b is not None)
    @rule()
    def close_second(self) -> None:
        assert self.b is not None
        if self.sub_on is self.b:
            self.sub.close()
            self.sub, self.sub_on = self.a.subscribe(len(self.seen) + 1), self.a
        self.b.close()
        self.b = None

    @precondition(lambda self: self.b is not None)
    @rule()
    def subscribe_on_second(self) -> None:
        """Move the live feed to the second handle, from where it had got to."""
        assert self.b is not None
        self.sub.close()
        self.sub, self.sub_on = self.b.subscribe(len(self.seen) + 1), self.b

    # -- ranged reads --------------------------------------------------------------------------

    @rule(
        stream=st.sampled_from(STREAMS),
        first=st.integers(min_value=-3, max_value=15),
        span=st.none() | st.integers(min_value=-2, max_value=15),
        second=st.booleans(),
    )
    def read_stream_range(self, stream: str, first: int, span: int | None, second: bool) -> None:
        last = None if span is None else first + span
        want = [
            r
            for r in self.model.stream(stream)
            if r.version >= first and (last is None or r.version <= last)
        ]
        got = list(self._handle(second).read_stream(stream, first, last))
        assert got == want, f"read_stream({stream!r}, {first}, {last})"

    @rule(
        first=st.integers(min_value=-3, max_value=40),
        span=st.none() | st.integers(min_value=-2, max_value=40),
        second=st.booleans(),
    )
    def read_all_range(self, first: int, span: int | None, second: bool) -> None:
        last = None if span is None else first + span
        want = [
            r
            for r in self.model.log
            if r.position >= first and (last is None or r.position <= last)
        ]
        assert list(self._handle(second).read_all(first, last)) == want

    # -- after every step ----------------------------------------------------------------------

    @invariant()
    def agrees_with_the_model(self) -> None:
        for store in (self.a, self.b):
            if store is None:
                continue
            model = self.model
            assert store.head() == len(model.log)
            assert store.wait_for(len(model.log), 0) == len(model.log)
            assert list(store.read_all()) == model.log
            infos = [
                (i.stream, i.version, i.last_position, i.last_ts, i.lease_epoch)
                for i in store.streams()
            ]
            assert infos == model.infos()
            for stream in STREAMS:
                assert store.stream_version(stream) == model.version(stream)
                assert store.lease_epoch(stream) == model.epochs.get(stream, 0)
                assert list(store.read_stream(stream)) == model.stream(stream)
                for name in FOLDS:
                    assert list(store.snapshots(stream, name)) == model.newest_first(stream, name)

    @invariant()
    def the_feed_has_every_event_once(self) -> None:
        while batch := self.sub.poll(0):
            self.seen.extend(batch)
        assert [r.position for r in self.seen] == list(range(1, len(self.seen) + 1))
        assert self.seen == self.model.log

    def teardown(self) -> None:
        if self.child_open:
            type(self).child.ask(op="close", at=self.location)
        self.sub.close()
        if self.b is not None:
            self.b.close()
        self.a.close()


_SETTINGS = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@pytest.fixture(scope="module")
def child() -> Iterator[_Child]:
    process = _Child()
    try:
        yield process
    finally:
        process.stop()


def test_lmdb_store_agrees_with_the_model(tmp_path: Path, child: _Child) -> None:
    counter = itertools.count()
    other = child

    class Lmdb(StoreMachine):
        child = other

        @staticmethod
        def new_location() -> str:
            return str(tmp_path / f"store{next(counter)}")

        @staticmethod
        def open_at(location: str, clock: FakeClock) -> EventStore:
            # a map far too small for the big payloads: it grows mid-run, and every reopen
            # asks for the tiny size once more
            return LmdbEventStore(location, map_size=256 * 1024, clock=clock)

    run_state_machine_as_test(
        Lmdb, settings=settings(max_examples=40, stateful_step_count=30, **_SETTINGS)
    )


def test_postgres_store_agrees_with_the_model(pg_server: PostgresServer, child: _Child) -> None:
    base = pg_server.url("stalwart_test")
    other = child

    class Postgres(StoreMachine):
        child = other

        @staticmethod
        def new_location() -> str:
            return f"{base}?schema=model{next(_schemas)}"  # a fresh schema per example

        @staticmethod
        def open_at(location: str, clock: FakeClock) -> EventStore:
            return store_module.open(location, clock=clock)

    run_state_machine_as_test(
        Postgres, settings=settings(max_examples=10, stateful_step_count=20, **_SETTINGS)
    )


# -- the same call on both backends ----------------------------------------------------------


@pytest.fixture
def both(tmp_path: Path, pg_url: str, clock: FakeClock) -> Iterator[dict[str, EventStore]]:
    """An empty LMDB store and an empty PostgreSQL store on one fake clock."""
    stores = {
        "lmdb": store_module.open(tmp_path / "store", clock=clock),
        "postgres": store_module.open(pg_url, clock=clock),
    }
    try:
        yield stores
    finally:
        for opened in stores.values():
            opened.close()


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did: ("ok", its result as a list when it is an iterator) or ("raised",
    the exception's class name)."""
    try:
        result = call()
        if isinstance(result, Iterator):
            result = list(result)
        return "ok", result
    except Exception as exc:
        return "raised", type(exc).__name__


def _on_both(both: dict[str, EventStore], call: Callable[[EventStore], Any]) -> dict[str, Any]:
    return {name: _outcome(lambda s=opened: call(s)) for name, opened in both.items()}


def _shape(outcome: tuple[str, Any]) -> tuple[str, Any]:
    """An outcome without what differs by design (positions and ids of records)."""
    kind, value = outcome
    if kind == "ok" and isinstance(value, list):
        return kind, [
            (r.stream, r.version, r.ts, r.causation_id, r.correlation_id, r.event)
            if isinstance(r, RecordedEvent)
            else r
            for r in value
        ]
    return kind, value


@pytest.mark.parametrize(
    "field",
    [
        # Was: PostgreSQL refuses an empty causation id that LMDB stores (bool(b"") is False).
        {"causation_id": ""},
        # Was: PostgreSQL refuses an empty correlation id that LMDB stores.
        {"correlation_id": ""},
    ],
    ids=["empty-causation-id", "empty-correlation-id"],
)
def test_an_empty_causation_or_correlation_id_is_taken_alike_on_both_backends(
    both: dict[str, EventStore], field: dict[str, str]
) -> None:
    # Was: _check_texts (stalwart/store/_postgres.py) treats "" as unstorable text, so
    # PostgreSQL raises EventError for an append that LMDB stores.
    new = NewEvent(event=_msg(1), **field)
    done = {k: _shape(v) for k, v in _on_both(both, lambda s: s.append("s:a", [new])).items()}
    assert done["lmdb"] == done["postgres"], (
        f"the same append with {field} must do the same on both backends (the protocol is "
        f"one): LMDB {'stored it' if done['lmdb'][0] == 'ok' else done['lmdb']}, "
        f"PostgreSQL {'stored it' if done['postgres'][0] == 'ok' else done['postgres']}"
    )


def test_an_event_id_with_a_nul_is_refused_alike_on_both_backends(
    both: dict[str, EventStore],
) -> None:
    # Was: LMDB stores an event id (or causation/correlation id) with a NUL that
    # PostgreSQL refuses with EventError, so a log valid on one backend is not on the other.
    new = NewEvent(event=_msg(1), id="evt\x00one")
    done = {k: _shape(v) for k, v in _on_both(both, lambda s: s.append("s:a", [new])).items()}
    assert done["postgres"] == ("raised", "EventError")
    assert done["lmdb"] == done["postgres"], (
        "an event id PostgreSQL cannot store must be refused on LMDB too, with the same "
        f"EventError; LMDB stored it: {done['lmdb']}"
    )


@pytest.mark.parametrize("expected", [2**63, 2**64 + 5], ids=["2**63", "2**64+5"])
def test_an_expected_version_beyond_int64_is_a_concurrency_error_on_both_backends(
    both: dict[str, EventStore], expected: int
) -> None:
    # Was: PostgreSQL sends the number to the server, which fails the whole statement
    # with NumericValueOutOfRange: a generic StoreError instead of the ConcurrencyError
    # LMDB raises (a stream can never be at that version).
    for opened in both.values():
        opened.append("s:a", [_msg(1)])
    done = _on_both(both, lambda s: s.append("s:a", [_msg(2)], expected_version=expected))
    assert done == {
        "lmdb": ("raised", "ConcurrencyError"),
        "postgres": ("raised", "ConcurrencyError"),
    }, f"expected_version={expected} must be a ConcurrencyError on both backends; got {done}"


@pytest.mark.parametrize(
    ("version", "position"),
    [(-1, 1), (1, 2**64)],
    ids=["negative-version", "position-past-uint64"],
)
def test_a_snapshot_with_out_of_range_numbers_is_refused_alike_with_a_typed_error(
    both: dict[str, EventStore], version: int, position: int
) -> None:
    # Was: LMDB fails a negative snapshot version in its writer (StoreError "write ...
    # failed: OverflowError") while PostgreSQL saves it, and lets msgpack's raw
    # OverflowError escape for a position past 2**64 where PostgreSQL raises StoreError.
    snapshot = Snapshot(stream="s:a", name="f@v1", version=version, position=position, data=b"")
    saved = _on_both(both, lambda s: s.put_snapshot(snapshot))
    kept = _on_both(both, lambda s: s.snapshots("s:a", "f@v1"))
    assert (saved["lmdb"], kept["lmdb"]) == (saved["postgres"], kept["postgres"]), (
        f"a snapshot at version {version}, position {position} must be saved (or refused) "
        f"alike on both backends; put_snapshot: {saved}, snapshots: {kept}"
    )
    for kind, value in saved.values():
        assert kind == "ok" or value not in ("OverflowError", "ValueError", "TypeError"), (
            f"a refusal must be a typed stalwart error, not a raw {value}"
        )


def test_stream_id_limits_and_odd_unicode_are_treated_alike(
    both: dict[str, EventStore],
) -> None:
    """The longest id in two-byte characters is a stream; one byte more, a lone surrogate,
    a NUL or an empty id is InvalidStreamError on every call that names a stream."""
    longest = "é" * (MAX_STREAM_BYTES // 2)
    odd = "s:\U0001f600\u202e\u0301\x7f"
    for stream in (longest, odd):
        done = {
            k: _shape(v)
            for k, v in _on_both(both, lambda s, id_=stream: s.append(id_, [_msg(1)])).items()
        }
        assert done["lmdb"] == done["postgres"]
        assert done["lmdb"][0] == "ok"
    for bad in (longest + "a", "s:\ud800", "a\x00b", ""):
        calls: list[Callable[[EventStore], Any]] = [
            lambda s, id_=bad: s.append(id_, [_msg(1)]),
            lambda s, id_=bad: s.append(id_, []),
            lambda s, id_=bad: s.read_stream(id_),
            lambda s, id_=bad: s.stream_version(id_),
            lambda s, id_=bad: s.lease_epoch(id_),
            lambda s, id_=bad: s.snapshots(id_, "f@v1"),
        ]
        for call in calls:
            assert _on_both(both, call) == {
                "lmdb": ("raised", "InvalidStreamError"),
                "postgres": ("raised", "InvalidStreamError"),
            }
    for opened in both.values():
        assert [i.stream for i in opened.streams()] == sorted([longest, odd])
        assert opened.head() == 2


def test_range_bounds_at_and_past_the_edges_read_alike(both: dict[str, EventStore]) -> None:
    """Zero, negative and huge bounds are clamped, never an error, on both backends."""
    for opened in both.values():
        opened.append("s:a", [_msg(i) for i in range(5)])
        opened.append("s:b", [_msg(i) for i in range(3)])
    cases: list[Callable[[EventStore], Any]] = [
        lambda s: [r.position for r in s.read_all(0)],
        lambda s: [r.position for r in s.read_all(-5, 3)],
        lambda s: [r.position for r in s.read_all(3, 2)],
        lambda s: [r.position for r in s.read_all(0, 0)],
        lambda s: [r.position for r in s.read_all(7, 2**64)],
        lambda s: [r.position for r in s.read_all(2**63)],
        lambda s: [r.version for r in s.read_stream("s:a", -1)],
        lambda s: [r.version for r in s.read_stream("s:a", 0, 0)],
        lambda s: [r.version for r in s.read_stream("s:a", 4, 2**64)],
        lambda s: [r.version for r in s.read_stream("s:a", 6)],
        lambda s: [r.version for r in s.read_stream("s:a", 2**63)],
        lambda s: [r.version for r in s.read_stream("s:none", -3, 2**70)],
    ]
    want = [
        [1, 2, 3, 4, 5, 6, 7, 8],
        [1, 2, 3],
        [],
        [],
        [7, 8],
        [],
        [1, 2, 3, 4, 5],
        [],
        [4, 5],
        [],
        [],
        [],
    ]
    for call, expected in zip(cases, want, strict=True):
        assert _on_both(both, call) == {"lmdb": ("ok", expected), "postgres": ("ok", expected)}


def test_explicit_timestamps_round_trip_bit_exact_on_both(both: dict[str, EventStore]) -> None:
    """An event's own ``ts`` is kept exactly (ints become floats, -0.0 keeps its sign, the
    smallest subnormal and the largest finite double survive) and the stream's last_ts is
    the last event's."""
    stamps = [5, -0.0, 5e-324, 1.7976931348623157e308, -1e12, 1_800_000_000.123456789]
    news = [NewEvent(event=_msg(i), ts=ts) for i, ts in enumerate(stamps)]
    for opened in both.values():
        recorded = opened.append("s:t", news)
        read = list(opened.read_all())
        assert read == recorded
        assert [r.ts.hex() for r in read] == [float(ts).hex() for ts in stamps]
        assert all(type(r.ts) is float for r in read)
        [info] = opened.streams()
        assert info.last_ts == stamps[-1]


def test_a_payload_of_several_megabytes_grows_a_tiny_map_and_reads_back(
    tmp_path: Path, pg_url: str, clock: FakeClock
) -> None:
    """An 8 MiB event into a 256 KiB LMDB map, and into PostgreSQL, reads back whole; the
    store goes on taking appends, and after a reopen too."""
    big = _msg("big", content="\u2603" * (8 << 20 // 3))
    locations: list[tuple[Callable[[], EventStore], str]] = [
        (lambda: LmdbEventStore(tmp_path / "tiny", map_size=256 * 1024, clock=clock), "lmdb"),
        (lambda: store_module.open(pg_url, clock=clock), "postgres"),
    ]
    for opener, _name in locations:
        opened = opener()
        try:
            opened.append("s:small", [_msg(1)])
            [record] = opened.append("s:big", [big])
            opened.append("s:small", [_msg(2)], expected_version=1)
        finally:
            opened.close()
        again = opener()
        try:
            assert [r.position for r in again.read_all()] == [1, 2, 3]
            [read] = again.read_stream("s:big")
            assert read == record
            assert again.append("s:small", [_msg(3)])[0].position == 4
        finally:
            again.close()


def test_every_call_on_a_closed_handle_is_store_closed_on_both(
    both: dict[str, EventStore],
) -> None:
    for opened in both.values():
        opened.append("s:a", [_msg(1)])
        opened.close()
    calls: list[Callable[[EventStore], Any]] = [
        lambda s: s.append("s:a", [_msg(2)]),
        lambda s: s.append("s:a", []),
        lambda s: s.read_all(),
        lambda s: s.read_stream("s:a"),
        lambda s: s.head(),
        lambda s: s.wait_for(5, 0),
        lambda s: s.subscribe(1),
        lambda s: s.stream_version("s:a"),
        lambda s: s.lease_epoch("s:a"),
        lambda s: s.streams(),
        lambda s: s.snapshots("s:a", "f@v1"),
        lambda s: s.put_snapshot(
            Snapshot(stream="s:a", name="f@v1", version=1, position=1, data=b"")
        ),
    ]
    for call in calls:
        assert _on_both(both, call) == {
            "lmdb": ("raised", "StoreClosedError"),
            "postgres": ("raised", "StoreClosedError"),
        }


# -- LMDB: one bad request in a group commit -------------------------------------------------

#: holds LMDB's writer lock (another process mid-commit) until a line arrives on stdin
_HOLD_WRITER = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], max_dbs=8, max_readers=1024, subdir=True)
txn = env.begin(write=True)
print("holding", flush=True)
sys.stdin.readline()
txn.abort()
env.close()
"""


def test_a_bad_snapshot_fails_alone_not_the_appends_committed_with_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Was: _PutSnapshot.run (stalwart/store/_environment.py) raises OverflowError inside
    # the group-commit transaction for a negative version, which aborts the whole batch: every
    # innocent append that was queued with it fails with "write ... failed: OverflowError".
    location = tmp_path / "store"
    opened = LmdbEventStore(location, clock=clock)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_WRITER, str(location)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    outcomes: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any]) -> threading.Thread:
        def work() -> None:
            outcomes[name] = _outcome(call)

        thread = threading.Thread(target=work)
        thread.start()
        return thread

    try:
        assert holder.stdout is not None
        assert holder.stdin is not None
        assert holder.stdout.readline().strip() == "holding"
        # the writer takes this one and waits for the other process's commit
        threads = [run("first", lambda: opened.append("s:first", [_msg(0)]))]
        time.sleep(0.3)  # real-time: let the writer block on LMDB's lock with its batch
        bad = Snapshot(stream="s:x", name="f@v1", version=-1, position=1, data=b"")
        threads.append(run("snapshot", lambda: opened.put_snapshot(bad)))
        for n in range(3):
            threads.append(run(f"append{n}", lambda n=n: opened.append(f"s:{n}", [_msg(n)])))
        time.sleep(0.3)  # real-time: let every request reach the writer's inbox
        holder.stdin.write("go\n")
        holder.stdin.flush()
        for thread in threads:
            thread.join(timeout=30)
        appends = {k: v for k, v in outcomes.items() if k.startswith("append")}
        failed = {k: v for k, v in appends.items() if v[0] != "ok"}
        assert not failed, (
            "an append queued beside a bad put_snapshot must be written (a request fails "
            f"alone, the rest of its batch is written); these failed: {failed}, the snapshot: "
            f"{outcomes['snapshot']}"
        )
        assert opened.head() == 4
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        reap(holder)
        opened.close()
