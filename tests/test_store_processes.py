"""The LMDB store across real processes: SIGKILL mid-append, several writer processes,
cross-process tailing (library and CLI), readers killed inside their transactions.

Children run ``tests/_store_child.py`` (or ``python -m stalwart``) with ``sys.executable``.
Nothing here sleeps to wait for an outcome: the parent waits on the children's output with
deadlines. The few real-time sleeps are marked and only shape *when* something happens.
"""

from __future__ import annotations

import json
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.events import MessageAppended, RecordedEvent
from stalwart.store import EventStore

CHILD = Path(__file__).with_name("_store_child.py")
BATCH_SIZES = (1, 1, 3, 1, 2)  # the child's cycle of events per append
WAIT = 30.0  # seconds any one step may take before the test fails rather than hangs
ID = re.compile(r"^(?P<writer>.+)b(?P<index>\d+)\.(?P<k>\d+)/(?P<n>\d+)$")

Ack = tuple[str, int, int, str]  # stream, version, position, event id


class Child:
    """A child process whose stdout lines arrive on a queue (None at end of file)."""

    def __init__(self, argv: list[str], *, stdin: bool, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._err: list[str] = []
        self._pumps = [
            threading.Thread(target=self._pump_out, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for pump in self._pumps:
            pump.start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.endswith("\n"):  # a line cut by SIGKILL is not a promise
                self._lines.put(line[:-1])
        self._lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        self._err.extend(self.proc.stderr)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def line(self, deadline: float) -> str | None:
        """The next line, None at end of file; fails the test at the deadline."""
        try:
            return self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"child {self.proc.args!r} said nothing in time; stderr:\n{self.stderr}")

    def expect(self, deadline: float) -> str:
        line = self.line(deadline)
        assert line is not None, f"child ended early (rc={self.proc.poll()}):\n{self.stderr}"
        assert not line.startswith('{"error"'), line
        return line

    def rest(self, deadline: float) -> list[str]:
        """Every line up to end of file."""
        lines = []
        while (line := self.line(deadline)) is not None:
            assert not line.startswith('{"error"'), line
            lines.append(line)
        return lines

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(WAIT) == -signal.SIGKILL, "the child died before the kill"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT)
        for pump in self._pumps:
            pump.join(WAIT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@contextmanager
def spawn(argv: list[str], *, stdin: bool = False, cwd: Path) -> Iterator[Child]:
    child = Child(argv, stdin=stdin, cwd=cwd)
    try:
        yield child
    finally:
        child.close()


def child_argv(*args: object) -> list[str]:
    return [sys.executable, str(CHILD), *map(str, args)]


@contextmanager
def opened(directory: Path) -> Iterator[EventStore]:
    store = store_module.open(directory)
    try:
        yield store
    finally:
        store.close()


def deadline(seconds: float = WAIT) -> float:
    return time.monotonic() + seconds


def event(writer: str, index: int, k: int = 0, n: int = 1) -> MessageAppended:
    return MessageAppended(message_id=f"{writer}b{index}.{k}/{n}", role="user", content="x")


def acks_of(lines: list[str]) -> list[list[Ack]]:
    """The acknowledged appends among a child's lines, one list of events per append."""
    found = []
    for line in lines:
        if line.startswith('{"ack"'):
            found.append([tuple(entry) for entry in json.loads(line)["ack"]])
    return found  # type: ignore[return-value]


def message_id(record: RecordedEvent) -> str:
    return record.event.message_id  # type: ignore[attr-defined, no-any-return]


# -- what every log must satisfy ---------------------------------------------------------------


def check_log(store: EventStore) -> list[RecordedEvent]:
    """Every record decodes; positions and versions have no gaps; indexes agree with the log;
    every append's batch is whole and contiguous; each writer's appends are in its order."""
    records = list(store.read_all())  # a torn record raises CorruptRecordError here
    assert [r.position for r in records] == list(range(1, len(records) + 1))
    assert store.head() == len(records)
    by_stream: dict[str, list[RecordedEvent]] = defaultdict(list)
    for record in records:
        by_stream[record.stream].append(record)
    for stream, recs in by_stream.items():
        assert [r.version for r in recs] == list(range(1, len(recs) + 1)), stream
        assert list(store.read_stream(stream)) == recs
        assert store.stream_version(stream) == len(recs)
    infos = {i.stream: (i.version, i.last_position) for i in store.streams()}
    assert infos == {s: (len(recs), recs[-1].position) for s, recs in by_stream.items()}

    batches: dict[tuple[str, int], list[tuple[RecordedEvent, int, int]]] = defaultdict(list)
    order: dict[str, list[int]] = defaultdict(list)
    for record in records:
        match = ID.match(message_id(record))
        assert match, message_id(record)
        key = (match["writer"], int(match["index"]))
        if key not in batches:
            order[key[0]].append(key[1])
        batches[key].append((record, int(match["k"]), int(match["n"])))
    for key, parts in batches.items():
        size = parts[0][2]
        assert [k for _, k, _ in parts] == list(range(size)), f"batch {key} is not whole"
        first = parts[0][0]
        assert [(r.stream, r.position, r.version) for r, _, _ in parts] == [
            (first.stream, first.position + k, first.version + k) for k in range(size)
        ], f"batch {key} is not contiguous"
    for writer, indices in order.items():
        assert indices == list(range(len(indices))), f"{writer}'s appends are out of order"
    return records


def check_acks(records: list[RecordedEvent], appends: list[list[Ack]]) -> None:
    """Every acknowledged event is in the log where the append said it was."""
    entries = [entry for append in appends for entry in append]
    assert len({position for _, _, position, _ in entries}) == len(entries)
    for stream, version, position, id_ in entries:
        assert position <= len(records), f"acknowledged position {position} is lost"
        record = records[position - 1]
        assert (record.stream, record.version, message_id(record)) == (stream, version, id_)


# -- 1. SIGKILL mid-append --------------------------------------------------------------------


def append_until_killed(directory: Path, round_: int, delay: float, want: int) -> list[list[Ack]]:
    """A child appends from 4 threads; SIGKILL it ``delay`` s after ``want`` acks."""
    with spawn(child_argv("crash", directory, round_), cwd=directory.parent) as child:
        until = deadline()
        lines = []
        while len(lines) < want:
            lines.append(child.expect(until))
        time.sleep(delay)  # real-time: the seeded moment of the kill, while appends run
        child.kill()
        lines += child.rest(until)
    return acks_of(lines)


def check_after_crash(store: EventStore, appends: list[list[Ack]]) -> tuple[int, int]:
    """The crash checks; returns (events in the log, appends committed but never acked)."""
    records = check_log(store)
    check_acks(records, appends)
    acked: dict[str, int] = defaultdict(lambda: -1)
    for append in appends:
        match = ID.match(append[0][3])
        assert match
        acked[match["writer"]] = max(acked[match["writer"]], int(match["index"]))
    present: dict[str, int] = defaultdict(lambda: -1)
    for record in records:
        match = ID.match(message_id(record))
        assert match
        present[match["writer"]] = max(present[match["writer"]], int(match["index"]))
    unacked = 0
    for writer, last in present.items():
        if writer.startswith("r"):
            # one append per thread can be in flight: committed, killed before its ack
            assert acked[writer] <= last <= acked[writer] + 1, writer
            unacked += last - acked[writer]
    return len(records), unacked


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "rounds"), [(1, 2), (2, 1), (3, 1), (4, 2), (5, 1)], ids=str)
def test_sigkill_mid_append_never_loses_an_acknowledged_event(
    tmp_path: Path, seed: int, rounds: int
) -> None:
    rng = random.Random(seed)
    directory = tmp_path / "store"
    appends: list[list[Ack]] = []
    for round_ in range(1, rounds + 1):
        new = append_until_killed(directory, round_, rng.uniform(0.0, 0.04), 200)
        assert len(new) >= 200
        appends += new
        with opened(directory) as store:
            count, unacked = check_after_crash(store, appends)
            print(
                f"seed {seed} round {round_}: {len(new)} appends acknowledged, "
                f"{count} events in the log, {unacked} committed but unacknowledged"
            )
            # the store takes new appends after the crash, at the next position
            [after] = store.append("after:crash", [event("after", round_ - 1)])
            assert (after.position, after.version) == (count + 1, round_)
            assert list(store.read_all(count + 1)) == [after]
            appends.append([(after.stream, after.version, after.position, message_id(after))])
    with opened(directory) as store:
        check_after_crash(store, appends)


# -- 2. several writer processes --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("map_kb", "content"), [(64 << 10, 1), (128, 2000)], ids=["default-map", "map-grows"]
)
def test_several_processes_append_to_one_directory(
    tmp_path: Path, map_kb: int, content: int
) -> None:
    procs, threads, count = 3, 4, 40
    directory = tmp_path / "store"  # created by the children, all at once
    argv = [
        child_argv("concurrent", directory, p, threads, count, map_kb, content)
        for p in range(procs)
    ]
    with (
        spawn(argv[0], stdin=True, cwd=tmp_path) as a,
        spawn(argv[1], stdin=True, cwd=tmp_path) as b,
        spawn(argv[2], stdin=True, cwd=tmp_path) as c,
    ):
        children = [a, b, c]
        until = deadline()
        for child in children:
            assert child.expect(until) == "ready"
        for child in children:
            child.send("go\n")
        lines = [line for child in children for line in child.rest(until)]
        assert [child.proc.wait(WAIT) for child in children] == [0] * procs, [
            ch.stderr for ch in children
        ]
    assert lines.count("done") == procs
    grown = sum(child.stderr.count("store.map_grown") for child in children)
    print(f"{map_kb} KiB map: grown {grown} times")

    appends = acks_of(lines)
    assert len(appends) == procs * threads * count
    with opened(directory) as store:
        records = check_log(store)
    check_acks(records, appends)
    assert all(len(r.event.content) == content for r in records)  # type: ignore[attr-defined]
    per_writer = sum(BATCH_SIZES[i % len(BATCH_SIZES)] for i in range(count))
    assert len(records) == procs * threads * per_writer
    writers = {ID.match(message_id(r))["writer"] for r in records}  # type: ignore[index]
    assert writers == {f"p{p}t{t}" for p in range(procs) for t in range(threads)}
    shared = [r for r in records if r.stream.startswith("shared:")]
    assert {message_id(r)[:2] for r in shared} == {"p0", "p1", "p2"}


@pytest.mark.slow
def test_expected_version_races_between_processes(tmp_path: Path) -> None:
    count = 100
    directory = tmp_path / "store"
    with opened(directory):
        pass
    with (
        spawn(child_argv("race", directory, 0, count), stdin=True, cwd=tmp_path) as a,
        spawn(child_argv("race", directory, 1, count), stdin=True, cwd=tmp_path) as b,
    ):
        until = deadline()
        assert a.expect(until) == b.expect(until) == "ready"
        a.send("go\n")
        b.send("go\n")
        lines = a.rest(until) + b.rest(until)
        assert (a.proc.wait(WAIT), b.proc.wait(WAIT)) == (0, 0)

    appends = acks_of(lines)
    conflicts = [json.loads(line)["conflicts"] for line in lines if '"conflicts"' in line]
    print(f"race: {conflicts} conflicts (process 0, 1) for {2 * count} appends")
    with opened(directory) as store:
        records = check_log(store)
    check_acks(records, appends)
    assert [r.version for r in records] == list(range(1, 2 * count + 1))
    ids = [message_id(r) for r in records]
    assert sorted(ids) == sorted({f"q{p}b{i}.0/1" for p in range(2) for i in range(count)})
    assert len(conflicts) == 2
    assert sum(conflicts) > 0, "the two processes never raced: the test proved nothing"


# -- 3. tailing from another process ----------------------------------------------------------


@pytest.mark.slow
def test_follower_in_another_process_sees_each_append_promptly(tmp_path: Path) -> None:
    rng = random.Random(7)
    directory = tmp_path / "store"
    before, timed = 10, 100
    returned: dict[int, float] = {}
    with opened(directory) as store:
        for i in range(before):
            store.append("tail:before", [event("pre", i)])
        with spawn(child_argv("follow", directory, before + timed), cwd=tmp_path) as child:
            until = deadline()
            assert child.expect(until) == "ready"
            for i in range(timed):
                time.sleep(rng.uniform(0.0, 0.02))  # real-time: space appends out to time each
                [record] = store.append(f"tail:{i % 3}", [event(f"tail{i % 3}", i // 3)])
                returned[record.position] = time.time()
            lines = child.rest(until)
            assert child.proc.wait(WAIT) == 0
        records = list(store.read_all())

    assert lines[-1] == "done"
    seen = [line.split() for line in lines[:-1]]
    assert [int(p) for p, _, _, _ in seen] == list(range(1, before + timed + 1))
    assert [(s, int(v)) for _, s, v, _ in seen] == [(r.stream, r.version) for r in records]
    latency = sorted(float(at) - returned[int(p)] for p, _, _, at in seen[before:])
    p50, p99 = statistics.median(latency), latency[int(len(latency) * 0.99) - 1]
    print(
        f"cross-process tail latency over {timed} appends: min {latency[0] * 1000:.1f} ms, "
        f"median {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max {latency[-1] * 1000:.1f} ms"
    )
    assert p50 < 0.1
    assert latency[-1] < 0.5


@pytest.mark.slow
def test_tail_follow_json_command_in_another_process(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    argv = [sys.executable, "-m", "stalwart", "--store", str(directory)]
    with opened(directory) as store:
        for i in range(5):
            store.append("session:cli", [event("cli", i)])
        with spawn([*argv, "tail", "--follow", "--json"], cwd=tmp_path) as child:
            until = deadline()
            lines = [child.expect(until) for _ in range(5)]  # it is following now
            for i in range(5, 35):
                size = 2 if i % 4 == 0 else 1
                store.append(
                    f"session:cli{i % 2}", [event(f"cli{i % 2}", i, k, size) for k in range(size)]
                )
            head = store.head()
            while json.loads(lines[-1])["position"] < head:
                lines.append(child.expect(until))
            child.proc.send_signal(signal.SIGINT)
            code = child.proc.wait(WAIT)
            lines += child.rest(until)
        records = list(store.read_all())

    print(f"tail --follow: exit code {code} after SIGINT, {len(lines)} events shown")
    assert code in (0, 130), child.stderr
    assert "Traceback" not in child.stderr, child.stderr
    shown = [json.loads(line) for line in lines]
    assert [s["position"] for s in shown] == list(range(1, head + 1))
    assert [(s["stream"], s["version"], s["type"]) for s in shown] == [
        (r.stream, r.version, "message:appended") for r in records
    ]


# -- 4. a reader killed inside its transaction ------------------------------------------------


def reader_table(directory: Path) -> str:
    with spawn(child_argv("readers", directory), cwd=directory.parent) as child:
        return "\n".join(child.rest(deadline()))


@pytest.mark.parametrize("reader", ["read_all", "raw_txn"])
def test_reader_killed_in_its_transaction_blocks_no_writer(tmp_path: Path, reader: str) -> None:
    directory = tmp_path / "store"
    with opened(directory) as store:
        for i in range(6):
            store.append("large", [event("large", i, k, 500) for k in range(500)])
    # a live process keeps the environment open throughout, so no later opener is the
    # first one, which would make LMDB reset the reader table and hide a stale slot
    with spawn(child_argv("open", directory), stdin=True, cwd=tmp_path) as keeper:
        assert keeper.expect(deadline()) == "open 3000"
        pid = kill_a_reader(directory, reader)
        stale = f" {pid} " in reader_table(directory)
        print(f"{reader}: the killed reader's slot was left behind: {stale}")
        if reader == "raw_txn":
            assert stale, "the test meant to leave a stale reader slot"
        with opened(directory) as store:  # opening clears the dead reader's slot
            assert f" {pid} " not in reader_table(directory)
            store.append("after", [event("after", 1)])
            assert len(check_log(store)) == 3003
        assert keeper.proc.stdin is not None
        keeper.proc.stdin.close()
        assert keeper.rest(deadline()) == ["done"]


def kill_a_reader(directory: Path, reader: str) -> int:
    """Kill a child inside a read transaction; the open store appends and reads after."""
    with opened(directory) as store:
        mode = "read" if reader == "read_all" else "hold"
        with spawn(child_argv(mode, directory), cwd=directory.parent) as child:
            until = deadline()
            said = child.expect(until)  # "pass 1 3000" or "holding <pid>"
            assert said.split()[0] in ("pass", "holding"), said
            store.append("during", [event("during", 0)])
            if mode == "read":
                child.expect(until)  # it goes on reading while we append
            child.kill()  # while reading: inside a read transaction most of the time
        [after] = store.append("after", [event("after", 0)])
        assert after.position == 3002
        check_log(store)
        return child.proc.pid


# forks bare LMDB readers (fast: no stalwart import) that SIGKILL themselves inside their
# read transaction, until one finds no reader slot left; prints how many died reading
FILL_READER_TABLE = """
import os, signal, sys, lmdb
dead = 0
while dead < 1200:
    pid = os.fork()
    if pid == 0:
        try:
            env = lmdb.open(sys.argv[1], max_dbs=8, readonly=True)
            txn = env.begin()
        except lmdb.ReadersFullError:
            os._exit(3)
        txn.cursor(db=env.open_db(b"log", txn=txn, create=False)).first()
        os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
        print(dead)
        break
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    dead += 1
"""


def test_more_dead_readers_than_reader_slots_block_no_one(tmp_path: Path) -> None:
    """Readers SIGKILLed in their transactions fill LMDB's reader table (1024 slots) while
    this process keeps the store open, so nobody opens it first and resets the table."""
    directory = tmp_path / "store"
    with opened(directory) as store:
        store.append("s", [event("s", 0)])
        argv = [sys.executable, "-c", FILL_READER_TABLE, str(directory)]
        with spawn(argv, cwd=tmp_path) as filler:
            [dead] = filler.rest(deadline())
            assert filler.proc.wait(WAIT) == 0, filler.stderr
        print(f"{dead} readers died in their transactions before the reader table was full")
        assert int(dead) >= 1000
        # this process reads and appends on, and another one can open the store again
        [after] = store.append("s", [event("s", 1)])
        assert len(check_log(store)) == after.position == 2
        with spawn(child_argv("open", directory), stdin=True, cwd=tmp_path) as other:
            assert other.expect(deadline()) == "open 2"
            assert other.proc.stdin is not None
            other.proc.stdin.close()
            assert other.rest(deadline()) == ["done"]
