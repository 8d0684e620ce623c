"""Review of the event-log spine: each test here shows a defect in the store, the codec or
the CLI's read commands, with real LMDB directories and real processes (no mocks).

Every test is expected to FAIL on the code it was written against; its docstring says
what is wrong and what a user of an event store would expect instead.
"""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import CorruptRecordError, StalwartError
from stalwart.events import Codec, Event, MessageAppended, RecordedEvent
from stalwart.store import LmdbEventStore, NewEvent
from tests.test_store_lmdb import _overwrite_record

WAIT = 20.0  # seconds any one step may take before the test fails rather than hangs


def _msg(n: int | str, content: str = "x") -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content=content)


def _stalwart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        text=True,
        timeout=WAIT,
        check=False,
    )


def _wait_until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the writer"
        time.sleep(0.01)  # real-time: the writer's queue and lock signal nothing to wait on


@contextlib.contextmanager
def _write_lock_held_by_another_process(store_dir: Path) -> Iterator[None]:
    """A real second process holds LMDB's write transaction for the block's duration."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import lmdb, sys\n"
            f"env = lmdb.open({str(store_dir)!r}, max_dbs=8)\n"
            "txn = env.begin(write=True)\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"
            "txn.abort()\n"
            "env.close()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None
    assert holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        yield
        holder.stdin.write("go\n")
        holder.stdin.flush()
        holder.wait(WAIT)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(WAIT)
        holder.stdin.close()
        holder.stdout.close()


# -- 1. append accepts events it cannot read back --------------------------------------------


@pytest.mark.parametrize(
    "new",
    [
        # an assistant message that was only tool calls: providers give content None
        pytest.param(
            MessageAppended(message_id="m1", role="assistant", content=None),  # type: ignore[arg-type]
            id="payload-field-None",
        ),
        # a host stamping its own time with a datetime instead of unix seconds
        pytest.param(
            NewEvent(
                event=MessageAppended(message_id="m1", role="user", content="hi"),
                ts=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),  # type: ignore[arg-type]
            ),
            id="ts-datetime",
        ),
    ],
)
def test_append_never_writes_a_record_that_cannot_be_read_back(
    store_dir: Path, new: MessageAppended | NewEvent
) -> None:
    """msgspec Structs do not validate on construction and the writer only *encodes*
    (``_Environment.append_in``), so an event with a wrongly typed field or a ``ts`` that
    is not a number is acknowledged and stored, and every later read of the log stops at
    it with CorruptRecordError: ``read_all``, every subscription, ``stalwart tail``, the
    stream's fold. One bad append poisons the global feed for every other stream.

    Expected: the append is refused with a typed error (EventError, as for other events
    that cannot be encoded) and writes nothing, so the log stays fully readable.
    """
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        with contextlib.suppress(StalwartError):  # refusing the event is the fix
            store.append("session:a", [new])
        store.append("session:b", [_msg("m2", "hello")])
        records = list(store.read_all())  # today: CorruptRecordError at position 1
        assert [r.stream for r in records][-1] == "session:b"


# -- 2. a second handle on the same directory silently gets the first handle's codec/clock --


class ReviewNote(Event, frozen=True, tag="spine-review:note"):
    """A plugin's event, known only to a codec built with ``extra_types``."""

    text: str = ""


def test_a_second_handle_uses_the_codec_it_was_opened_with(store_dir: Path) -> None:
    """``LmdbEventStore.__init__`` shares one ``_Environment`` per directory per process
    and the environment holds the codec (and clock) of whoever opened it first; the
    ``codec=`` given to every later open is silently ignored. A plugin that opens the
    store with ``Codec(extra_types=[...])`` while the host (or the CLI in-process, or a
    Runtime) already has it open cannot append its own events (UnknownEventTypeError)
    and reads them back as UnknownEvent.

    Expected: each handle encodes and decodes with the codec it was opened with (or the
    open is refused with a clear StoreError saying the directory is already open with
    another codec) -- never a silent swap.
    """
    host = store_module.open(store_dir)
    try:
        try:
            plugin = store_module.open(store_dir, codec=Codec(extra_types=[ReviewNote]))
        except StalwartError:
            return  # a clear refusal is an acceptable fix
        try:
            plugin.append("notes", [ReviewNote(text="from the plugin")])
            assert [r.event for r in plugin.read_stream("notes")] == [
                ReviewNote(text="from the plugin")
            ]
        finally:
            plugin.close()
    finally:
        host.close()


def test_a_second_handle_stamps_events_with_its_own_clock(store_dir: Path) -> None:
    """Same root cause as the codec case: the ``clock=`` of a second open of one
    directory in a process is ignored, so a test or host that opens the store with a
    FakeClock while another handle is open gets wall-clock timestamps (and every
    deadline fold computed from them is wrong). The documented promise is that
    timestamps come from the injected clock.

    Expected: events appended through a handle are stamped by that handle's clock (or
    the second open is refused with a clear error).
    """
    first = store_module.open(store_dir, clock=FakeClock(start=1_000.0))
    try:
        try:
            second = store_module.open(store_dir, clock=FakeClock(start=5_000.0))
        except StalwartError:
            return  # a clear refusal is an acceptable fix
        try:
            [record] = second.append("s:1", [_msg(1)])
            assert record.ts == 5_000.0  # today: 1000.0, the first handle's clock
        finally:
            second.close()
    finally:
        first.close()


# -- 3. an upcaster that fails escapes as a raw exception ------------------------------------


class NoteV0(Event, frozen=True, tag="spine-review:greeting"):
    """The payload as an early release wrote it (schema 1, before ``text`` existed)."""


class NoteV2(Event, frozen=True, tag="spine-review:greeting"):
    content: str
    schema_version = 2


def _rename_text(payload: dict[str, Any]) -> dict[str, Any]:
    payload["content"] = payload.pop("text")  # assumes every schema-1 record has text
    return payload


def test_a_failing_upcaster_is_a_corrupt_record_not_a_raw_exception(store_dir: Path) -> None:
    """``Codec._upcast`` calls the upcaster chain with no guard: an upcaster that raises
    on an old payload it did not expect (here KeyError: a schema-1 record written before
    the field existed) escapes ``decode_many`` (which only catches CorruptRecordError)
    as a bare KeyError. ``read_stream``/``read_all`` then raise an untyped exception and
    even the good records of the same read chunk before it are never yielded.

    Expected: the record is reported as CorruptRecordError naming its position (like a
    missing upcaster step), after every good record before it.
    """
    with store_module.open(store_dir, codec=Codec(extra_types=[NoteV2])) as store:  # type: ignore[attr-defined]
        store.append("greetings", [NoteV2(content="new")])
    old = Codec(extra_types=[NoteV0])
    # a schema-1 record, appended after the current one (a rolled-back deploy wrote it)
    with LmdbEventStore(store_dir, codec=old) as store:
        store.append("greetings", [NoteV0()])
    new = Codec(extra_types=[NoteV2], upcasters={("spine-review:greeting", 1): _rename_text})
    got: list[RecordedEvent] = []

    def read(store: Any) -> None:
        got.extend(store.read_stream("greetings"))  # keeps what came before a raise

    with (
        store_module.open(store_dir, codec=new) as store,  # type: ignore[attr-defined]
        pytest.raises(CorruptRecordError) as info,
    ):
        read(store)
    assert info.value.position == 2
    assert [r.event for r in got] == [NoteV2(content="new")]


# -- 4. `stalwart tail` crashes with a traceback on a plugin event it does not know ---------


class ReviewGrid(Event, frozen=True, tag="spine-review:grid"):
    """A plugin event with a perfectly valid msgspec field: a dict keyed by tuples."""

    cells: dict[tuple[int, int], str] = {}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_tail_shows_an_unknown_plugin_event_without_a_traceback(
    store_dir: Path, as_json: bool
) -> None:
    """A plugin's event is an UnknownEvent to the CLI, and ``event_data`` turns its raw
    payload into builtins keeping the msgpack map keys as they are. A nested map whose
    keys are not strings or numbers (tuple keys, bool keys, nil keys: valid msgpack, and
    what msgspec writes for ``dict[tuple[int, int], str]``) then makes the JSON encoder
    in ``_render.event_json`` / ``_render._short`` raise TypeError, which the CLI does
    not catch: ``stalwart tail`` dies with a Python traceback at that record.

    Expected (spec: unknown tags are never a crash; CLI errors are one line, never a
    traceback): the event is shown (keys stringified, or the field shown raw/base64) and
    the command exits 0.
    """
    with store_module.open(store_dir, codec=Codec(extra_types=[ReviewGrid])) as store:  # type: ignore[attr-defined]
        store.append("plugin", [ReviewGrid(cells={(0, 1): "x"})])
        store.append("plugin", [_msg("after")])
    result = _stalwart("--store", str(store_dir), "tail", *(["--json"] if as_json else []))
    assert "Traceback" not in result.stderr, result.stderr[-400:]
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2


# -- 5. one request's encode failure fails every append committed beside it -----------------


def test_an_append_that_cannot_be_encoded_fails_alone_not_its_whole_batch(
    store_dir: Path,
) -> None:
    """Group commit stages every request of a batch in one write transaction;
    ``_Environment.append_in`` turns only TypeError/ValueError/OverflowError from the
    encoder into that request's own EventError. Any other exception from encoding (here
    RecursionError: an event holding a self-referencing structure) escapes
    ``_write_batch`` and ``_commit`` fails *every* request of the batch with
    "write ... failed: RecursionError", so an unrelated thread's perfectly good append
    to another stream is refused because of someone else's event.

    The batch is made deterministic with a real second process that holds LMDB's write
    lock: the writer is stuck on a first append while the bad and the good request
    queue up, and both go into the next transaction.

    Expected: the bad request alone fails (EventError, like any event that cannot be
    encoded); the innocent append in the same batch is written.
    """
    store = LmdbEventStore(store_dir)
    threads: list[threading.Thread] = []
    results: dict[str, object] = {}

    def append(name: str, stream: str, event: MessageAppended) -> None:
        try:
            results[name] = store.append(stream, [event])
        except BaseException as exc:  # recorded for the assertions
            results[name] = exc

    def start(name: str, stream: str, event: MessageAppended) -> None:
        thread = threading.Thread(target=append, args=(name, stream, event))
        thread.start()
        threads.append(thread)

    loop: list[Any] = []
    loop.append(loop)
    bad = MessageAppended(message_id="bad", role="user", tool_calls=(loop,))  # type: ignore[arg-type]
    # only read, to know when the writer is stuck and both requests are queued
    inbox, rw = store._env._inbox, store._env.rw
    try:
        store.append("warm", [_msg(0)])
        with _write_lock_held_by_another_process(store_dir):
            start("first", "warm", _msg(1))
            # the writer took the first request and waits for LMDB's lock in its txn
            _wait_until(lambda: rw._shared > 0 and len(inbox) == 0)
            start("bad", "bad", bad)
            start("innocent", "innocent", _msg(2))
            _wait_until(lambda: len(inbox) == 2)  # both queued behind the held lock
        for thread in threads:
            thread.join(WAIT)
        assert isinstance(results["bad"], StalwartError)
        innocent = results["innocent"]
        assert isinstance(innocent, list), f"the innocent append failed: {innocent!r}"
        assert [r.stream for r in store.read_all()][-1] == "innocent"
    finally:
        for thread in threads:
            thread.join(WAIT)
        store.close()


# -- 6. a subscription drops the good records before a corrupt one --------------------------


def _five_good_then_a_corrupt_record(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append("s:1", [_msg(i) for i in range(6)])
    _overwrite_record(store_dir, 6, b"\xc1garbage")


def test_a_subscription_delivers_every_good_record_before_a_corrupt_one(
    store_dir: Path,
) -> None:
    """``Subscription._read`` does ``list(store.read_all(next, end))``: read_all yields
    the good records and then raises at the corrupt one, so ``list`` throws them away
    and ``_next`` never moves. A subscriber (the live feed every follower uses) gets
    the error first and never sees positions 1..5, although ``read_all`` itself
    promises "every good record before it first".

    Expected: iterating the subscription yields positions 1..5, then raises
    CorruptRecordError naming position 6.
    """
    _five_good_then_a_corrupt_record(store_dir)
    seen: list[int] = []

    def follow(subscription: Any) -> None:
        seen.extend(record.position for record in subscription)

    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        subscription = store.subscribe(1)
        with pytest.raises(CorruptRecordError) as info:
            follow(subscription)
        subscription.close()
    assert info.value.position == 6
    assert seen == [1, 2, 3, 4, 5]


def test_tail_follow_prints_the_good_records_before_a_corrupt_one(store_dir: Path) -> None:
    """The same defect through the CLI: ``stalwart tail`` prints the five good records
    and then one error line, but ``stalwart tail --follow`` (which reads through a
    Subscription) prints nothing at all before the error: following the log loses
    events that plain tail shows (docs/events.md: "Reading yields every good record
    before it first, so stalwart tail prints what it can and then one error line").

    Expected: ``tail --follow`` prints the same five lines, then the error, exit 1.
    """
    _five_good_then_a_corrupt_record(store_dir)
    plain = _stalwart("--store", str(store_dir), "tail", "--json")
    follow = _stalwart("--store", str(store_dir), "tail", "--follow", "--json")
    assert len(plain.stdout.splitlines()) == 5
    assert plain.returncode == 1
    assert follow.returncode == 1
    assert "position 6" in follow.stderr
    assert follow.stdout.splitlines() == plain.stdout.splitlines()


# -- 7. a forked child cannot open the store again, as the docs tell it to -----------------


def _child_appends(store_dir: str, conn: Any) -> None:
    """In the forked child: open the store again, as documented, and append."""
    try:
        with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
            [record] = store.append("session:child", [_msg("c")])
        conn.send(("ok", record.position))
    except BaseException as exc:  # reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def test_a_forked_child_can_open_the_store_again(store_dir: Path) -> None:
    """docs/architecture.md: "A forked child starts with a clean registry: it must open
    the store again", and ``_environment._forget_after_fork`` clears ``_ENVS`` for that.
    But py-lmdb (3.x) keeps its own per-process set of open environments, keyed by the
    files, and that set survives ``fork()``: the parent's ``lmdb.Environment`` is still
    registered in the child, so the child's ``store.open`` fails with
    ``StoreError: ... is already open in this process``. Every ``multiprocessing``
    worker forked from a process that has the store open (the default start method on
    Linux before 3.14) can never use the store.

    Expected: the child opens the store again and appends; the parent sees the record.
    """
    import multiprocessing

    store = LmdbEventStore(store_dir)
    child = None
    try:
        store.append("warm", [_msg(0)])
        context = multiprocessing.get_context("fork")
        mine, theirs = context.Pipe()
        child = context.Process(target=_child_appends, args=(str(store_dir), theirs))
        child.start()
        assert mine.poll(WAIT), "the child said nothing"
        assert mine.recv() == ("ok", 2)
        assert [r.stream for r in store.read_all()] == ["warm", "session:child"]
    finally:
        if child is not None:
            if child.is_alive():
                child.kill()
            child.join(WAIT)
        store.close()
