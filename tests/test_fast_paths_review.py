"""Review: read fast paths that ordinary use turns off without anyone noticing.

On 2026-11-24 replay lost 13 % for a day and a half because ``Codec.decode_batch`` took its
one-pass path only while every type was at schema 1. These tests look for the same shape
elsewhere: an optimisation guarded by a condition that legitimate use makes false. None of
them times anything; each checks which path a read took, on a real LMDB store:

- how many records a codec decoded one by one (``decode_many``), by subclassing ``Codec``;
- how many log records' heads a stream read decoded to find the records after the index
  mark (the head decoder of ``stalwart.store._lmdb_tail``, counted);
- what an upcast record is converted into (``msgspec.convert``'s target, recorded).

Tests marked ``# Was:`` failed on the code reviewed (2026-11-24); all are fixed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stalwart import store as store_module
from stalwart.errors import CorruptRecordError
from stalwart.events import (
    Codec,
    ContextCompacted,
    Event,
    MessageAppended,
    RecordedEvent,
    SessionCreated,
    TurnCompleted,
    TurnStarted,
    UnknownEvent,
)
from stalwart.store import _lmdb_tail
from tests._old_events import CompactedV1

SESSIONS = 64


class ReviewPluginNote(Event, frozen=True, tag="fastpath-review:note"):
    """A plugin's event: known only to a codec built with ``extra_types``."""

    text: str


class CountingCodec(Codec):
    """A codec that counts the records it decoded one by one (``decode_many``)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.one_by_one = 0

    def decode_many(
        self, values: Iterable[bytes | memoryview], out: list[RecordedEvent], limit: int
    ) -> CorruptRecordError | None:
        before = len(out)
        try:
            return super().decode_many(values, out, limit)
        finally:
            self.one_by_one += len(out) - before


def _turns(count: int) -> list[Event]:
    events: list[Event] = []
    for n in range(count):
        turn = f"t{n}"
        events += [
            TurnStarted(turn_id=turn),
            MessageAppended(message_id=f"m{n}", role="user", content="hello", turn_id=turn),
            TurnCompleted(turn_id=turn),
        ]
    return events


# Was: a codec with extra_types has no one-pass decode: every record goes one by one
def test_a_plugin_codec_reads_a_batch_in_one_pass(store_dir: Path) -> None:
    """docs/events.md: a plugin's event classes are added with ``Codec(extra_types=...)``
    and the store opened with it. Its reads of records at their current schema, built-in
    or the plugin's, must decode a batch in one pass as the default codec does."""
    written = [SessionCreated(), *_turns(100), ReviewPluginNote(text="n"), *_turns(100)]
    with store_module.open(store_dir, codec=Codec(extra_types=[ReviewPluginNote])) as store:  # type: ignore[attr-defined]
        store.append("session:plugin", written)
    codec = CountingCodec(extra_types=[ReviewPluginNote])
    with store_module.open(store_dir, codec=codec) as store:  # type: ignore[attr-defined]
        read = [record.event for record in store.read_stream("session:plugin")]
    assert read == written
    assert codec.one_by_one == 0, (
        f"{codec.one_by_one} of {len(read)} records were decoded one by one: a codec with "
        "extra_types has no fast decoder (Codec._fast is None), so decode_batch always falls "
        "back to decode_many and every record takes three msgspec calls"
    )


def _old_compaction() -> CompactedV1:
    return CompactedV1(
        summary_id="s", turn=1, covers=("m0",), through_seq=1, tokens=1, budget=2, threshold=0.5
    )


# Was: one old-schema or unknown-tag record sends its whole batch record by record
@pytest.mark.parametrize("odd", ["older_schema", "unknown_tag"])
def test_one_odd_record_does_not_slow_its_whole_batch(store_dir: Path, odd: str) -> None:
    """An older log holds ``context:compacted`` records at schema 1 (it moved to 2 on
    2026-11-23), and a process without a plugin reads the plugin's events as
    ``UnknownEvent`` (docs/events.md). The odd record needs its slow decode; the other
    1,000 records of its batch are at their current schema and need none."""
    older = Codec(extra_types=[CompactedV1, ReviewPluginNote], versions={"context:compacted": 1})
    odd_event: Event = _old_compaction() if odd == "older_schema" else ReviewPluginNote(text="n")
    with store_module.open(store_dir, codec=older) as store:  # type: ignore[attr-defined]
        store.append("session:old", [SessionCreated(), *_turns(170), odd_event, *_turns(170)])
    codec = CountingCodec()
    with store_module.open(store_dir, codec=codec) as store:  # type: ignore[attr-defined]
        records = list(store.read_stream("session:old"))
    assert len(records) == 1 + 3 * 340 + 1
    event = records[1 + 3 * 170].event
    if odd == "older_schema":
        assert isinstance(event, ContextCompacted)
        assert event.added == ("m0",)  # upcast, as decode does
    else:
        assert isinstance(event, UnknownEvent)
        assert event.tag == "fastpath-review:note"
    assert codec.one_by_one < 16, (
        f"{codec.one_by_one} of {len(records)} records were decoded one by one for a single "
        f"{odd} record: decode_batch drops the whole fast pass when one record of the batch "
        "is not at its current schema (or the C pass raised on it)"
    )


# Was: each upcast record is converted into the whole event union (~95 us; 0.5 us to its class)
def test_an_upcast_record_is_converted_to_its_own_class(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older log's records go through their upcasters on every read for ever (the log is
    never rewritten). ``msgspec.convert`` to a Union builds its converter again on every
    call: a schema-1 ``context:compacted`` costs about 95 us to read, 60 times a record's
    whole decode; converting to ``ContextCompacted`` itself gives the same event."""
    older = Codec(extra_types=[CompactedV1], versions={"context:compacted": 1})
    with store_module.open(store_dir, codec=older) as store:  # type: ignore[attr-defined]
        store.append("context:old", [_old_compaction()] * 3)
    targets: list[Any] = []
    convert = msgspec.convert

    def recording(obj: Any, target: Any, **options: Any) -> Any:
        targets.append(target)
        return convert(obj, target, **options)

    monkeypatch.setattr(msgspec, "convert", recording)
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        events = [record.event for record in store.read_stream("context:old")]
    assert [e.added for e in events] == [("m0",)] * 3  # type: ignore[attr-defined]
    wide = [t for t in targets if not (isinstance(t, type) and issubclass(t, Event))]
    assert not wide, (
        f"{len(wide)} of {len(events)} upcast records were converted into {wide[0]!r:.60}...: "
        "Codec._upcast converts to the whole union, not to the tag's class"
    )


def _fill(store: Any, rounds: int) -> None:
    for n in range(rounds):
        for i in range(SESSIONS):
            store.append(f"session:s{i:02d}", [TurnStarted(turn_id=f"t{n}")])


def _heads_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the stored records whose head (position, stream, version) is decoded."""
    calls = [0]
    head = _lmdb_tail.HEAD

    def counted(value: bytes) -> Any:
        calls[0] += 1
        return head(value)

    monkeypatch.setattr(_lmdb_tail, "HEAD", counted)
    return calls


def _read_newest(store: Any) -> list[RecordedEvent]:
    """The newest record of every session: what a fold from a snapshot, or from the version
    a worker last folded, reads."""
    newest = []
    for info in store.streams():
        newest += list(store.read_stream(info.stream, info.version))
    return newest


def test_the_writers_own_process_reads_the_tail_from_its_log_tail(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the two tests below: where the fast path holds (the process whose
    writer made the last commit), reading the newest record of every session decodes no
    record's head at all. It holds today."""
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        _fill(store, 7)
        heads = _heads_decoded(monkeypatch)
        newest = _read_newest(store)
    assert [r.version for r in newest] == [7] * SESSIONS
    assert heads[0] == 0


# Was: a read-only handle rescans every record after the index mark in each read_stream
def test_a_read_only_handle_does_not_rescan_the_log_tail_per_read(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        _fill(store, 7)  # 448 records after the index mark (it moves every 512)
        described = store.describe()
    after_mark = described["head"] - described["indexed"]
    assert after_mark == 7 * SESSIONS
    heads = _heads_decoded(monkeypatch)
    with store_module.open(store_dir, read_only=True) as reader:  # type: ignore[attr-defined]
        newest = _read_newest(reader)
    assert [r.version for r in newest] == [7] * SESSIONS
    assert heads[0] <= 2 * after_mark, (
        f"{SESSIONS} reads of one record each decoded {heads[0]} record heads "
        f"({after_mark} records after the mark): the LogTail is published only by this "
        "process's writer, so every read of a read-only handle scans the tail of the log"
    )


_CHILD = textwrap.dedent(
    """
    import sys
    from stalwart import store as store_module
    from stalwart.events import TurnStarted
    with store_module.open(sys.argv[1]) as store:
        for n in range(6):
            for i in range({sessions}):
                store.append(f"session:s{{i:02d}}", [TurnStarted(turn_id=f"c{{n}}")])
    """
).format(sessions=SESSIONS)


# Was: after another process appends, each read_stream rescans the log after the mark
def test_reads_after_another_process_appended_do_not_rescan_per_read(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes on one LMDB directory are supported (docs/architecture.md, group
    commit; docs/scaling.md, worker processes on one machine)."""
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        _fill(store, 1)  # this process's writer has published its tail
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(store_dir)], check=True, timeout=60
        )  # another process appends 6 records to every session
        described = store.describe()
        after_mark = described["head"] - described["indexed"]
        assert after_mark == 7 * SESSIONS
        heads = _heads_decoded(monkeypatch)
        newest = _read_newest(store)
    assert [r.version for r in newest] == [7] * SESSIONS
    assert heads[0] <= 2 * after_mark, (
        f"{SESSIONS} reads of one record each decoded {heads[0]} record heads "
        f"({after_mark} records after the mark): the writer's LogTail stops at its own last "
        "commit, and every read of a stream another process wrote since scans the log's tail"
    )
