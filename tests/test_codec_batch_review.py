"""Review of 4b00eca: ``Codec.decode_batch`` / ``decode_many`` take the one-pass path
whenever every record has its type's current schema (no longer only while every type is
at schema 1).

The promise under test: whatever the stored values, a batch reads exactly what
``[codec.decode(v) for v in values]`` reads, up to the first corrupt record, and returns
that record's error with its index (``len(out)`` minus what ``out`` held before). Checked
on generated batches for several codecs, then through real LMDB and PostgreSQL stores
holding records written by older and newer "versions" (codecs that know other classes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lmdb
import msgspec
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart import store as store_module
from stalwart.errors import CorruptRecordError
from stalwart.events import (
    DEFAULT_CODEC,
    EVENT_TYPES,
    Codec,
    ContextCompacted,
    Event,
    MessageAppended,
    RecordedEvent,
    RuntimeStarted,
    SessionClosed,
    UnknownEvent,
)
from stalwart.store import EventStore
from stalwart.testing import PostgresServer
from tests._old_events import CompactedV1
from tests._relay import schema_of

# -- what other versions (and plugins) wrote -----------------------------------------------


class CompactedV1Decoy(Event, frozen=True, tag="context:compacted"):
    """Schema 1 as a build wrote it that also carried an ``added`` field: the current
    class takes it as it is (the fast decoder reads it), the upcaster must decide."""

    summary_id: str
    turn: int
    covers: tuple[str, ...]
    added: tuple[str, ...]
    through_seq: int
    tokens: int
    budget: int
    threshold: float


class ClosedV3(Event, frozen=True, tag="session:closed"):
    """``session:closed`` at a newer schema that only added a field: it still fits."""

    reason: str
    note: str = ""
    schema_version = 3


class ClosedV4(Event, frozen=True, tag="session:closed"):
    """``session:closed`` at a newer schema whose field changed type: it no longer fits."""

    reason: int
    schema_version = 4


class Mystery(Event, frozen=True, tag="future:mystery"):
    """A tag this version does not know."""

    clue: str


class Ping(Event, frozen=True, tag="plugin:ping"):
    """A plugin's event."""

    n: int = 0


class PingV2(Event, frozen=True, tag="plugin:ping"):
    """The plugin's event at schema 2 (``n`` renamed ``count``)."""

    count: int = 0
    schema_version = 2


class ClosedPlus(SessionClosed, frozen=True, tag="session:closed_plus"):
    """A subclass of a registered event type, under its own tag (a plugin's)."""

    extra: int = 0


OLD = Codec(extra_types=[CompactedV1])
DECOY = Codec(extra_types=[CompactedV1Decoy])
NEWER = Codec(extra_types=[ClosedV3, Mystery])
FUTURE = Codec(extra_types=[ClosedV4])


def _exclaim(payload: dict[str, Any]) -> dict[str, Any]:
    payload["reason"] = f"{payload['reason']}!"
    return payload


def _count(payload: dict[str, Any]) -> dict[str, Any]:
    payload["count"] = payload.pop("n", 0)
    return payload


#: the codecs a batch is read with: the default, ones that keep a fast decoder
#: (``versions``/``upcasters`` only) and ones that have none (``extra_types``)
CODECS = {
    "default": DEFAULT_CODEC,
    "closed_at_2": Codec(
        versions={"session:closed": 2}, upcasters={("session:closed", 1): _exclaim}
    ),
    "compacted_at_3": Codec(
        versions={"context:compacted": 3}, upcasters={("context:compacted", 2): lambda p: p}
    ),
    "compacted_back_at_1": Codec(versions={"context:compacted": 1}),
    "plugin": Codec(extra_types=[Ping, ClosedPlus]),
    "plugin_at_2": Codec(extra_types=[PingV2], upcasters={("plugin:ping", 1): _count}),
}


# -- generated stored values --------------------------------------------------------------

st.register_type_strategy(int, st.integers(min_value=-(2**63), max_value=2**63 - 1))
_TEXT = st.text(max_size=6)


def _strategy(cls: type[Event]) -> st.SearchStrategy[Event]:
    if cls is RuntimeStarted:
        value = st.integers(min_value=-(2**63), max_value=2**63 - 1) | _TEXT
        config = st.dictionaries(_TEXT, value, max_size=3)
        return st.builds(RuntimeStarted, config=config, stalwart_version=_TEXT)
    if cls is SessionClosed:
        return st.builds(SessionClosed, reason=_TEXT)
    return st.from_type(cls)


BUILT_IN = st.one_of(
    [_strategy(cls) for _, cls in sorted(EVENT_TYPES.items()) if cls is not UnknownEvent]
)

HEAD = st.tuples(
    st.integers(min_value=0, max_value=2**40),  # position
    _TEXT,  # stream
    st.integers(min_value=0, max_value=2**40),  # version
    st.floats(allow_nan=True) | st.integers(min_value=0, max_value=2**40),  # ts
    _TEXT,  # id
    st.none() | _TEXT,
    st.none() | _TEXT,
)


def _value(head: tuple[Any, ...], schema: Any, event: Any) -> bytes:
    return msgspec.msgpack.encode([*head, schema, event])


def _payload(event: Event) -> dict[str, Any]:
    payload: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
    return payload


@st.composite
def current(draw: st.DrawFn) -> bytes:
    event = draw(BUILT_IN)
    return _value(draw(HEAD), type(event).schema_version, event)


@st.composite
def current_compaction(draw: st.DrawFn) -> bytes:
    """The type now at schema 2, at its current schema (rare among ~90 types otherwise)."""
    return _value(draw(HEAD), 2, draw(st.from_type(ContextCompacted)))


@st.composite
def compacted_v1(draw: st.DrawFn) -> bytes:
    payload: dict[str, Any] = {
        "type": "context:compacted",
        "summary_id": draw(_TEXT),
        "turn": draw(st.integers(0, 99)),
        "through_seq": draw(st.integers(0, 99)),
        "tokens": 5,
        "budget": 9,
        "threshold": 0.5,
    }
    if draw(st.integers(0, 5)):  # now and then it lacks covers: the upcaster fails
        payload["covers"] = draw(st.lists(_TEXT, max_size=3))
    if draw(st.booleans()):  # a decoy the current class would take
        payload["added"] = draw(st.lists(_TEXT, max_size=3))
    if draw(st.booleans()):
        payload["body"] = draw(_TEXT)
    return _value(draw(HEAD), 1, payload)


@st.composite
def other_schema(draw: st.DrawFn) -> bytes:
    """A built-in event at any schema around its current one, with an extra field or a
    field whose type changed: newer ones that fit, newer ones that no longer fit (unknown),
    older ones without an upcaster (corrupt), current ones that do not fit (corrupt)."""
    event = draw(BUILT_IN)
    payload = _payload(event)
    if draw(st.booleans()):
        payload["zz_added_later"] = draw(st.integers(0, 9) | _TEXT)
    fields = sorted(k for k in payload if k != "type")
    if fields and draw(st.booleans()):
        payload[draw(st.sampled_from(fields))] = {"changed": [1, "x"]}
    schema = type(event).schema_version + draw(st.sampled_from([-2, -1, 0, 1, 2, 7]))
    return _value(draw(HEAD), schema, payload)


@st.composite
def unknown_tag(draw: st.DrawFn) -> bytes:
    tag = draw(st.sampled_from(["future:mystery", "x:new", "plugin:ping", "session:closed_plus"]))
    payload: dict[str, Any] = {"type": tag}
    if draw(st.booleans()):
        payload["n"] = draw(st.integers(0, 9) | _TEXT)
    if draw(st.booleans()):
        payload["reason"] = draw(_TEXT)
    return _value(draw(HEAD), draw(st.integers(0, 3)), payload)


@st.composite
def stalwart_unknown(draw: st.DrawFn) -> bytes:
    schema = draw(st.integers(0, 3))
    if draw(st.booleans()):
        event = UnknownEvent(tag=draw(_TEXT), schema=draw(st.integers(0, 5)), raw=draw(st.binary()))
        return _value(draw(HEAD), schema, event)
    return _value(draw(HEAD), schema, {"type": "stalwart:unknown", "tag": draw(st.integers(0, 3))})


@st.composite
def corrupt(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 6))
    head = list(draw(HEAD))
    if kind == 0:
        return draw(st.binary(max_size=20))
    if kind == 1:
        whole = _value(tuple(head), 1, SessionClosed(reason=draw(_TEXT)))
        return whole[: draw(st.integers(0, len(whole) - 1))]
    if kind == 2:  # too few fields
        return msgspec.msgpack.encode([*head[:6], 1, {"type": "session:closed", "reason": "r"}])
    if kind == 3:  # the event is not a map
        return _value(tuple(head), 1, draw(st.integers(-9, 9) | _TEXT))
    if kind == 4:  # a map without a tag
        return _value(tuple(head), 1, {"reason": "r"})
    if kind == 5:  # a header field of the wrong type
        head[draw(st.sampled_from([0, 1, 3]))] = [1]
        return _value(tuple(head), 1, {"type": "session:closed", "reason": "r"})
    return _value(tuple(head), "1", {"type": "session:closed", "reason": "r"})


@st.composite
def plugin(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return _value(draw(HEAD), draw(st.integers(1, 2)), Ping(n=draw(st.integers(0, 9))))
    return _value(draw(HEAD), 1, ClosedPlus(reason=draw(_TEXT), extra=draw(st.integers(0, 9))))


VALUE = st.one_of(
    current(),
    compacted_v1(),
    other_schema(),
    unknown_tag(),
    stalwart_unknown(),
    plugin(),
    corrupt(),
)
#: mostly good values, so batches often run far before their first corrupt one
MOSTLY_GOOD = st.one_of(
    current(), current(), current_compaction(), compacted_v1(), other_schema(), VALUE
)


def _stored(draw_value: bytes, view: bool) -> bytes | memoryview:
    return memoryview(draw_value) if view else draw_value


VALUES = st.lists(
    st.builds(_stored, MOSTLY_GOOD, st.booleans()),
    max_size=12,
)


# -- the reference: one decode per value ---------------------------------------------------


def _key(record: RecordedEvent) -> tuple[type, bytes]:
    """A record compared by its class and its encoding (NaN is never equal to itself)."""
    return type(record.event), DEFAULT_CODEC.encode(record)


def _one_by_one(
    codec: Codec, values: list[Any]
) -> tuple[list[tuple[type, bytes]], CorruptRecordError | None]:
    good: list[tuple[type, bytes]] = []
    for value in values:
        try:
            good.append(_key(codec.decode(value)))
        except CorruptRecordError as exc:
            return good, exc
    return good, None


def _same_error(got: CorruptRecordError | None, want: CorruptRecordError | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.position, got.reason) == (want.position, want.reason)


SENTINEL = RecordedEvent(0, "s", 0, 0.0, "id", None, None, 1, SessionClosed(reason="before"))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=VALUES,
    name=st.sampled_from(sorted(CODECS)),
    prefilled=st.integers(0, 2),
    limit=st.integers(1, 14),
)
def test_a_batch_reads_as_one_decode_per_value(
    values: list[Any], name: str, prefilled: int, limit: int
) -> None:
    codec = CODECS[name]
    good, error = _one_by_one(codec, values)

    out = [SENTINEL] * prefilled
    got = codec.decode_batch(values, out)
    assert out[:prefilled] == [SENTINEL] * prefilled
    assert [_key(r) for r in out[prefilled:]] == good
    _same_error(got, error)

    out = [SENTINEL] * prefilled
    got = codec.decode_many(values, out, max(1, len(values)))
    assert [_key(r) for r in out[prefilled:]] == good
    _same_error(got, error)

    # a limit below the batch: the first ``limit`` values only
    out = []
    got = codec.decode_many(iter(values), out, limit)
    head_good, head_error = _one_by_one(codec, values[:limit])
    assert [_key(r) for r in out] == head_good
    _same_error(got, head_error)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(BUILT_IN, min_size=1, max_size=20), name=st.sampled_from(sorted(CODECS)))
def test_current_records_read_back_as_written_in_one_pass(events: list[Event], name: str) -> None:
    """Records written by the codec itself (each at its type's current schema) come back
    as written, and a codec with a fast decoder never goes record by record."""
    codec = CODECS[name]
    records = [
        RecordedEvent(n, "s", n, 1.0, "id", None, None, codec.schema_of(event), event)
        for n, event in enumerate(events, 1)
    ]
    stored = [codec.encode(r) for r in records]
    calls: list[int] = []
    original = codec.decode_many

    def counting(values: Any, out: list[RecordedEvent], limit: int) -> Any:
        calls.append(limit)
        return original(values, out, limit)

    codec.decode_many = counting  # type: ignore[method-assign]
    try:
        out: list[RecordedEvent] = []
        assert codec.decode_batch(stored, out) is None
    finally:
        del codec.decode_many
    assert [_key(r) for r in out] == [_key(r) for r in records]
    if name not in {"plugin", "plugin_at_2"}:  # the codecs with a fast decoder at 4b00eca
        assert calls == []


# -- pinned cases -------------------------------------------------------------------------


def _rec(event: Any, schema: int, position: int = 1) -> bytes:
    return _value((position, "s", position, 1.0, "id", None, None), schema, event)


def _compaction(added: tuple[str, ...] = ("m",)) -> ContextCompacted:
    return ContextCompacted(
        summary_id="s", turn=1, added=added, through_seq=1, tokens=1, budget=2, threshold=0.5
    )


def _v1_payload(**fields: Any) -> dict[str, Any]:
    payload = {
        "type": "context:compacted",
        "summary_id": "s",
        "turn": 1,
        "through_seq": 1,
        "tokens": 1,
        "budget": 2,
        "threshold": 0.5,
    }
    payload.update(fields)
    return payload


def test_an_empty_batch() -> None:
    for codec in CODECS.values():
        out: list[RecordedEvent] = []
        assert codec.decode_batch([], out) is None
        assert codec.decode_many([], out, 5) is None
        assert out == []


def test_a_schema_1_compaction_the_fast_decoder_takes_is_upcast_even_after_current_ones() -> None:
    """The decoy: a schema 1 payload with an ``added`` field fits the current class; among
    records all at schema 1 (types at 1) or 2 it must still go through the upcaster."""
    stored = [
        _rec(SessionClosed(reason="a"), 1, 1),
        _rec(_compaction(("new",)), 2, 2),
        _rec(_v1_payload(covers=["c1", "c2"], added=["decoy"]), 1, 3),
        _rec(SessionClosed(reason="b"), 1, 4),
    ]
    for values in (stored, stored[2:], [stored[0], stored[2]], [stored[2]]):
        out: list[RecordedEvent] = []
        assert DEFAULT_CODEC.decode_batch(values, out) is None
        compactions = [r.event for r in out if isinstance(r.event, ContextCompacted)]
        assert ("decoy",) not in [c.added for c in compactions]
        assert ("c1", "c2") in [c.added for c in compactions]


def test_a_record_only_the_upcaster_finds_corrupt_is_reported_after_the_good_ones() -> None:
    """The fast decoder reads this one (a schema 1 compaction with ``added`` but no
    ``covers``); its upcaster cannot: the batch must stop there, not take it whole."""
    stored = [
        _rec(SessionClosed(reason="a"), 1, 1),
        _rec(_compaction(), 2, 2),
        _rec(_v1_payload(added=["decoy"]), 1, 3),
        _rec(SessionClosed(reason="b"), 1, 4),
    ]
    out: list[RecordedEvent] = []
    error = DEFAULT_CODEC.decode_batch(stored, out)
    assert error is not None
    assert error.position == 3
    assert [r.position for r in out] == [1, 2]


def test_newer_schemas_in_a_batch() -> None:
    fits = _rec(ClosedV3(reason="r", note="n"), 3, 1)
    no_longer = _rec(ClosedV4(reason=7), 4, 2)
    same_shape_at_current = _rec({"type": "session:closed", "reason": 7}, 1, 3)
    out: list[RecordedEvent] = []
    assert DEFAULT_CODEC.decode_batch([fits, no_longer], out) is None
    assert out[0].event == SessionClosed(reason="r")
    assert out[0].schema == 3
    assert isinstance(out[1].event, UnknownEvent)
    assert (out[1].event.tag, out[1].event.schema) == ("session:closed", 4)
    error = DEFAULT_CODEC.decode_batch([fits, no_longer, same_shape_at_current], out := [])
    assert error is not None
    assert error.position == 3
    assert len(out) == 2


def test_unknown_events_written_again_read_in_a_batch_as_decode_reads_them() -> None:
    """An UnknownEvent read and encoded again (no reader in the tree does it: it cannot be
    appended) reads back as ``decode`` reads it, by any path; at record schema 1 (the
    placeholder's own) it comes back as it was."""
    for schema in (1, 2):
        unknown = DEFAULT_CODEC.decode(_rec(Mystery(clue="c"), schema, 1))
        assert isinstance(unknown.event, UnknownEvent)
        again = DEFAULT_CODEC.encode(unknown)
        current = DEFAULT_CODEC.encode(_record_of(_compaction()))
        values = [again, memoryview(again), current]
        out: list[RecordedEvent] = []
        assert DEFAULT_CODEC.decode_batch(values, out) is None
        assert out == [DEFAULT_CODEC.decode(v) for v in values]
        if schema == 1:
            assert out[0] == unknown


def _record_of(event: Event, position: int = 1) -> RecordedEvent:
    return RecordedEvent(
        position, "s", position, 1.0, "id", None, None, DEFAULT_CODEC.schema_of(event), event
    )


def test_a_subclass_of_a_registered_type_is_read_by_its_own_tag() -> None:
    value = _rec(ClosedPlus(reason="r", extra=3), 1)
    plugin = CODECS["plugin"]
    out: list[RecordedEvent] = []
    assert plugin.decode_batch([value, _rec(SessionClosed(reason="s"), 1)], out) is None
    assert type(out[0].event) is ClosedPlus
    assert type(out[1].event) is SessionClosed
    out = []
    assert DEFAULT_CODEC.decode_batch([value], out) is None
    assert isinstance(out[0].event, UnknownEvent)
    assert out[0].event.tag == "session:closed_plus"


def test_a_plugin_upcaster_runs_inside_a_batch() -> None:
    codec = CODECS["plugin_at_2"]
    stored = [_rec(Ping(n=4), 1, 1), _rec(PingV2(count=5), 2, 2), _rec(_compaction(), 2, 3)]
    out: list[RecordedEvent] = []
    assert codec.decode_batch(stored, out) is None
    assert [r.event for r in out[:2]] == [PingV2(count=4), PingV2(count=5)]


def test_a_versions_override_upcasts_in_a_batch() -> None:
    codec = CODECS["closed_at_2"]
    stored = [_rec(SessionClosed(reason="old"), 1, 1), _rec(SessionClosed(reason="new"), 2, 2)]
    out: list[RecordedEvent] = []
    assert codec.decode_batch(stored, out) is None
    assert [r.event.reason for r in out] == ["old!", "new"]  # type: ignore[attr-defined]


# Was: decode_many(values, out, 0) decodes one record; its docstring says "up to limit"
def test_decode_many_with_a_limit_of_zero_decodes_nothing() -> None:
    """Pre-existing (not from 4b00eca): the loop appends before it checks the count. No
    reader in the tree passes 0 (read_all's ``want`` is at least 1)."""
    out: list[RecordedEvent] = []
    stored = [_rec(SessionClosed(reason="a"), 1)] * 3
    assert DEFAULT_CODEC.decode_many(stored, out, 0) is None
    assert out == []


# -- through a real LMDB store ------------------------------------------------------------

MIXED = ("context:c1", "session:s1", "runtime", "other:x")
#: a stream of current records and decoys only: every batch of it the fast decoder reads
#: whole, so only the schema check stands between a decoy and the upcaster
DECOYS = "context:decoys"
STREAMS = (*MIXED, DECOYS)


def _events(kind: int, n: int) -> tuple[Codec | None, list[Event]]:
    """A batch of one writer: None is this version's codec."""
    if kind == 0:
        return None, [_compaction((f"m{n}",)), SessionClosed(reason=f"r{n}")]
    if kind == 1:
        return OLD, [
            CompactedV1(
                summary_id=f"s{n}",
                turn=n,
                covers=(f"m{n}", f"k{n}"),
                through_seq=n,
                tokens=1,
                budget=2,
                threshold=0.5,
            )
        ]
    if kind == 2:
        return NEWER, [ClosedV3(reason=f"r{n}", note="later"), Mystery(clue=f"c{n}")]
    if kind == 3:
        return FUTURE, [ClosedV4(reason=n)]
    return None, [
        MessageAppended(message_id=f"m{n}", role="user", content="hi") for _ in range(n % 7 + 1)
    ]


def _fill(
    location: str, batches: int, stores: dict[Codec | None, EventStore]
) -> dict[int, RecordedEvent]:
    """Append ``batches`` batches from the four writers, interleaved across the streams;
    what each writer recorded, by position, as its own codec encoded it."""
    written: dict[int, RecordedEvent] = {}
    for n in range(batches):
        writer, events = _events(n % 5, n)
        stream = MIXED[(n // 5 + n) % len(MIXED)]
        for record in stores[writer].append(stream, events):
            written[record.position] = record
        if n % 3 == 0:
            decoy = CompactedV1Decoy(
                summary_id=f"d{n}",
                turn=n,
                covers=(f"c{n}",),
                added=("decoy",),
                through_seq=n,
                tokens=1,
                budget=2,
                threshold=0.5,
            )
            news = [(stores[None], [_compaction((f"a{n}",)), SessionClosed(reason="r")])]
            news.insert(n % 2, (stores[DECOY], [decoy]))
            for store, batch in news:
                for record in store.append(DECOYS, batch):
                    written[record.position] = record
    return written


def _writers(location: str) -> dict[Codec | None, EventStore]:
    return {
        codec: store_module.open(location, codec=codec or DEFAULT_CODEC)
        for codec in (None, OLD, DECOY, NEWER, FUTURE)
    }


def _raw_log(directory: Path) -> dict[int, bytes]:
    env = lmdb.open(str(directory), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            cursor = txn.cursor(db=env.open_db(b"log", txn=txn, create=False))
            return {int.from_bytes(k, "big"): bytes(v) for k, v in cursor}
    finally:
        env.close()


def _overwrite(directory: Path, position: int, value: bytes) -> None:
    env = lmdb.open(str(directory), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), value, db=env.open_db(b"log", txn=txn))
    finally:
        env.close()


def _expected(
    values: dict[int, bytes], streams: dict[int, str], stream: str | None = None
) -> tuple[list[tuple[type, bytes]], CorruptRecordError | None]:
    """One decode per stored value, in position order (of one stream: ``streams`` names
    each position's, as written), up to the first corrupt one."""
    good: list[tuple[type, bytes]] = []
    for position in sorted(values):
        if stream is not None and streams[position] != stream:
            continue
        try:
            record = DEFAULT_CODEC.decode(values[position], position)
        except CorruptRecordError as exc:
            return good, CorruptRecordError(position, exc.reason)
        good.append(_key(record))
    return good, None


def _read(reading: Any) -> tuple[list[tuple[type, bytes]], CorruptRecordError | None]:
    got: list[tuple[type, bytes]] = []
    try:
        for record in reading:
            got.append(_key(record))
    except CorruptRecordError as exc:
        return got, exc
    return got, None


def _subscribed(store: EventStore) -> tuple[list[tuple[type, bytes]], CorruptRecordError | None]:
    got: list[tuple[type, bytes]] = []
    subscription = store.subscribe(1)
    head = store.head()
    try:
        for _ in range(head + 2):
            if subscription.position > head:
                break
            try:
                got.extend(_key(r) for r in subscription.poll(0))
            except CorruptRecordError as exc:
                return got, exc
    finally:
        subscription.close()
    return got, None


def _streams(values: dict[int, bytes]) -> dict[int, str]:
    return {p: DEFAULT_CODEC.decode(v).stream for p, v in values.items()}


def _check_reads(
    store: EventStore, values: dict[int, bytes], streams: dict[int, str], windows: bool = True
) -> None:
    want, error = _expected(values, streams)
    got, got_error = _read(store.read_all())
    assert got == want
    assert (got_error and got_error.position) == (error and error.position)
    got, got_error = _subscribed(store)
    assert got == want
    assert (got_error and got_error.position) == (error and error.position)
    for stream in STREAMS:
        want, error = _expected(values, streams, stream)
        for first in (1, 2):
            got, got_error = _read(store.read_stream(stream, first))
            assert got == want[first - 1 :], stream
            assert (got_error and got_error.position) == (error and error.position), stream
    # two versions at a time: windows of schema 1 records only (a decoy and a session
    # close) that the fast decoder reads whole
    ours = sorted(p for p in values if streams[p] == DECOYS) if windows else []
    for version in range(1, len(ours) + 1):
        window = {p: values[p] for p in ours[version - 1 : version + 1]}
        want, error = _expected(window, streams, DECOYS)
        got, got_error = _read(store.read_stream(DECOYS, version, version + 1))
        assert got == want, version
        assert (got_error and got_error.position) == (error and error.position), version


def _decoded_kinds(values: dict[int, bytes]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for value in values.values():
        try:
            record = DEFAULT_CODEC.decode(value)
        except CorruptRecordError:
            continue
        event = record.event
        name = f"{type(event).__name__}@{record.schema}"
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


@pytest.fixture(scope="module")
def lmdb_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of ~1,700 records (past READ_BATCH, and an index that lags), written by
    this version, an older one (schema 1 compactions), and two newer ones, interleaved."""
    directory = tmp_path_factory.mktemp("codec_batch") / "store"
    stores = _writers(str(directory))
    try:
        _fill(str(directory), 600, stores)
        # read while the writer of this process knows its tail (the known-chunk path)
        values = _raw_log_open(stores[None])
        _check_reads(stores[None], values, _streams(values))
    finally:
        for store in stores.values():
            store.close()
    return directory


def _raw_log_open(store: EventStore) -> dict[int, bytes]:
    """The stored bytes while the store is open (through its own environment)."""
    env = store._env  # type: ignore[attr-defined]

    def everything(txn: Any) -> dict[int, bytes]:
        return {int.from_bytes(k, "big"): bytes(v) for k, v in txn.cursor(db=env.log)}

    values: dict[int, bytes] = env.read(everything)
    return values


def test_lmdb_reads_every_record_as_one_decode_does(lmdb_log: Path, tmp_path: Path) -> None:
    values = _raw_log(lmdb_log)
    assert len(values) > 1_024  # past READ_BATCH
    kinds = _decoded_kinds(values)
    # every kind of record is there: current, upcast, newer that fits, newer unknown
    assert {"ContextCompacted@1", "ContextCompacted@2", "SessionClosed@3", "UnknownEvent@4"} <= set(
        kinds
    )
    assert kinds["UnknownEvent@1"] > 0  # the future:mystery ones
    decoys = [
        DEFAULT_CODEC.decode(v).event
        for v in values.values()
        if DEFAULT_CODEC.decode(v).stream == DECOYS
    ]
    assert len(decoys) > 500
    assert ("decoy",) not in [getattr(e, "added", None) for e in decoys]
    with store_module.open(lmdb_log, read_only=True, create=False) as store:  # type: ignore[attr-defined]
        _check_reads(store, values, _streams(values))
    upcast = [DEFAULT_CODEC.decode(v) for v in values.values()]
    assert all(
        r.event.added[0][0] in "mc" and len(r.event.added) == 2 - (r.stream == DECOYS)
        for r in upcast
        if isinstance(r.event, ContextCompacted) and r.schema == 1
    )


@pytest.mark.parametrize("damage", ["garbage", "upcaster_fails", "no_longer_fits_at_current"])
@pytest.mark.parametrize("where", [0.3, 0.7, 0.97])
@pytest.mark.parametrize("among", ["all", DECOYS])
def test_lmdb_a_corrupt_record_is_reported_at_its_position_after_the_good_ones(
    lmdb_log: Path, tmp_path: Path, damage: str, where: float, among: str
) -> None:
    """In the indexed part of the log (0.3, 0.7) and in its unindexed tail (0.97)."""
    directory = tmp_path / "store"
    directory.mkdir()
    for name in ("data.mdb",):
        (directory / name).write_bytes((lmdb_log / name).read_bytes())
    values = _raw_log(directory)
    streams = _streams(values)
    positions = sorted(values)
    pool = [p for p in positions if among in ("all", streams[p])]
    position = pool[int(len(pool) * where)]
    head = msgspec.msgpack.decode(values[position])[:7]
    if damage == "garbage":
        value = b"\xc1garbage"
    elif damage == "upcaster_fails":  # the fast decoder reads it; its upcaster cannot
        value = _value(tuple(head), 1, _v1_payload(added=["decoy"]))
    else:
        value = _value(tuple(head), 1, {"type": "session:closed", "reason": 7})
    _overwrite(directory, position, value)
    values[position] = value
    with store_module.open(directory) as store:  # type: ignore[attr-defined]
        _check_reads(store, values, streams, windows=among == DECOYS)
        want, error = _expected(values, streams)
        assert error is not None
        assert error.position == position
        assert len(want) == positions.index(position)


# -- through a real PostgreSQL store -------------------------------------------------------


def _pg_sql(server: PostgresServer, statement: str, params: tuple[object, ...]) -> None:
    with psycopg.connect(server.url("stalwart_test"), autocommit=True) as admin:
        admin.execute(statement.encode(), params)


@pytest.mark.parametrize(
    ("damage", "among"),
    [(None, "all"), ("garbage", "all"), ("upcaster_fails", "all"), ("upcaster_fails", DECOYS)],
)
def test_postgres_reads_every_record_as_one_decode_does(
    pg_server: PostgresServer,
    pg_url: str,
    damage: Literal["garbage", "upcaster_fails"] | None,
    among: str,
) -> None:
    stores = _writers(pg_url)
    try:
        written = _fill(pg_url, 60, stores)
    finally:
        for store in stores.values():
            store.close()
    # the bytes each writer's codec gives its record: what the table holds, as one value
    codecs = {
        Mystery: NEWER,
        ClosedV3: NEWER,
        ClosedV4: FUTURE,
        CompactedV1: OLD,
        CompactedV1Decoy: DECOY,
    }
    values = {p: codecs.get(type(r.event), DEFAULT_CODEC).encode(r) for p, r in written.items()}
    streams = {p: r.stream for p, r in written.items()}
    if damage is not None:
        pool = [p for p in sorted(values) if among in ("all", streams[p])]
        position = pool[len(pool) // 2]
        record = written[position]
        if damage == "garbage":
            data, schema = b"\xc1", record.schema
            values[position] = b"\xc1"
        else:
            payload = _v1_payload(added=["decoy"])
            data, schema = msgspec.msgpack.encode(payload), 1
            values[position] = _value(
                (
                    position,
                    record.stream,
                    record.version,
                    record.ts,
                    record.id,
                    record.causation_id,
                    record.correlation_id,
                ),
                1,
                payload,
            )
        _pg_sql(
            pg_server,
            f"UPDATE {schema_of(pg_url)}.events SET data = %s, schema = %s WHERE position = %s",
            (data, schema, position),
        )
    with store_module.open(pg_url) as store:  # type: ignore[attr-defined]
        _check_reads(store, values, streams)


def _deep(position: int, stream: str, version: int, depth: int = 2_000) -> bytes:
    """A record of a tag this version does not know whose payload nests ``depth`` lists
    deep: valid msgpack, about 2 KB."""
    head = msgspec.msgpack.encode([position, stream, version, 1.0, "id", None, None, 1, None])
    return head[:-1] + b"\x82\xa4type\xa6x:deep\xa1a" + b"\x91" * depth + b"\x01"


# Was: a deeply nested record raises RecursionError from every reader, not CorruptRecordError
def test_a_deeply_nested_record_is_reported_not_a_recursion_error(tmp_path: Path) -> None:
    """Pre-existing (not from 4b00eca): msgspec raises RecursionError (not DecodeError)
    past the interpreter's recursion limit, and the codec catches only DecodeError. The
    store's read then raises it from inside the chunk, so even the good records before it
    are lost, and callers that handle CorruptRecordError (subscriptions, folds) do not."""
    directory = tmp_path / "store"
    with store_module.open(directory) as store:  # type: ignore[attr-defined]
        recorded = store.append("other:x", [SessionClosed(reason=str(n)) for n in range(3)])
    middle = recorded[1]
    _overwrite(directory, middle.position, _deep(middle.position, "other:x", middle.version))
    with store_module.open(directory) as store:  # type: ignore[attr-defined]
        got, error = _read(store.read_all())
    assert got == [_key(recorded[0])]
    assert error is not None
    assert error.position == middle.position
