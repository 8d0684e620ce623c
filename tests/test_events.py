"""The event vocabulary and its codec: tags, round trips, unknown types, upcasting."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.errors import CorruptRecordError, EventError, UnknownEventTypeError
from stalwart.events import (
    DEFAULT_CODEC,
    EVENT_TYPES,
    Codec,
    ContextCompacted,
    Event,
    RecordedEvent,
    RuntimeStarted,
    SessionClosed,
    UnknownEvent,
    event_data,
)

SEED_TAGS = {
    "execution:prompt_timeout",
    "execution:aborted",
    "provider:degraded",
    "provider:recovered",
    "announcement:dead_lettered",
    "announcement:dead_letter_delivered",
    "announcement:dead_letter_expired",
    "context:dag_degraded",
    "subagent:watchdog_timeout",
    "subagent:ghost_swept",
    "session:requires_action",
    "activation:leased",
    "activation:requeued",
    "runtime:started",
}


def test_tags_are_explicit_domain_names() -> None:
    for tag, cls in EVENT_TYPES.items():
        domain, _, name = tag.partition(":")
        assert domain, tag
        assert name, tag
        assert tag == tag.lower(), tag
        assert cls.__struct_config__.tag == tag


def test_seed_named_tags_exist() -> None:
    assert set(EVENT_TYPES) >= SEED_TAGS


def test_every_event_is_frozen() -> None:
    for cls in EVENT_TYPES.values():
        assert cls.__struct_config__.frozen, cls


# msgpack carries 64-bit integers; larger ones are refused at append (see the store tests)
st.register_type_strategy(int, st.integers(min_value=-(2**63), max_value=2**63 - 1))


def _strategy(cls: type[Event]) -> st.SearchStrategy[Event]:
    if cls is RuntimeStarted:
        value = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(max_size=5)
        config = st.dictionaries(st.text(max_size=5), value)
        return st.builds(RuntimeStarted, config=config, stalwart_version=st.text(max_size=8))
    if cls is SessionClosed:
        return st.builds(SessionClosed, reason=st.text(max_size=10))
    return st.from_type(cls)


ALL_EVENTS = st.one_of(
    [_strategy(cls) for tag, cls in sorted(EVENT_TYPES.items()) if cls is not UnknownEvent]
)


def _record(event: Event, position: int = 1, schema: int | None = None) -> RecordedEvent:
    return RecordedEvent(
        position=position,
        stream="session:x",
        version=position,
        ts=1.25,
        id="id",
        causation_id=None,
        correlation_id="corr",
        schema=type(event).schema_version if schema is None else schema,
        event=event,
    )


@settings(max_examples=300, deadline=None)
@given(ALL_EVENTS)
def test_every_event_round_trips_through_the_codec(event: Event) -> None:
    encoded = DEFAULT_CODEC.encode(_record(event))
    decoded = DEFAULT_CODEC.decode(encoded)
    # compare encodings: NaN floats are never equal to themselves
    assert DEFAULT_CODEC.encode(decoded) == encoded
    assert type(decoded.event) is type(event)


@settings(max_examples=100, deadline=None)
@given(ALL_EVENTS)
def test_event_data_is_json_ready(event: Event) -> None:
    data = event_data(event)
    assert "type" not in data
    msgspec.json.encode(data)


def test_schema_of_refuses_unregistered_types() -> None:
    class Stray(Event, frozen=True, tag="test:stray"):
        pass

    with pytest.raises(UnknownEventTypeError):
        DEFAULT_CODEC.schema_of(Stray())


def test_codec_refuses_extra_types_without_a_domain_tag() -> None:
    class Untagged(Event, frozen=True, tag="untagged"):
        pass

    with pytest.raises(EventError, match="domain:name"):
        Codec(extra_types=[Untagged])


# -- unknown event types: kept, shown, never dropped ------------------------------------------


class FutureThing(Event, frozen=True, tag="future:thing"):
    """An event from a newer version of stalwart (or a plugin this process lacks)."""

    size: int
    label: str = ""


def test_unknown_tag_decodes_to_unknown_event_with_raw_bytes() -> None:
    newer = Codec(extra_types=[FutureThing])
    encoded = newer.encode(_record(FutureThing(size=3, label="big")))
    decoded = DEFAULT_CODEC.decode(encoded)
    assert isinstance(decoded.event, UnknownEvent)
    assert decoded.type == "future:thing"
    assert decoded.event.tag == "future:thing"
    assert msgspec.msgpack.decode(decoded.event.raw) == {
        "type": "future:thing",
        "size": 3,
        "label": "big",
    }
    data = event_data(decoded.event)
    assert data["size"] == 3
    assert data["_unknown"] is True
    # and the newer codec still reads its own event back
    assert newer.decode(encoded).event == FutureThing(size=3, label="big")


def test_unknown_event_with_undecodable_payload_is_still_shown() -> None:
    event = UnknownEvent(tag="x:y", schema=1, raw=b"\xc1")
    data = event_data(event)
    assert data["_unknown"] is True
    assert data["_raw_b64"] == "wQ=="


def test_newer_payload_with_extra_fields_decodes() -> None:
    payload = {"type": "provider:recovered", "provider": "p", "rule": "probe", "new": [1, 2]}
    raw = msgspec.msgpack.encode([1, "provider:p", 1, 1.0, "id", None, None, 2, payload])
    decoded = DEFAULT_CODEC.decode(raw)
    assert decoded.event.provider == "p"  # type: ignore[attr-defined]


# -- schema evolution through upcasters ---------------------------------------------------------


class GreetingV1(Event, frozen=True, tag="test:greeting"):
    text: str


class GreetingV2(Event, frozen=True, tag="test:greeting"):
    content: str
    language: str
    schema_version = 2


def _rename(payload: dict[str, Any]) -> dict[str, Any]:
    payload["content"] = payload.pop("text")
    payload.setdefault("language", "en")
    return payload


def test_old_payloads_are_upcast_on_read() -> None:
    old = Codec(extra_types=[GreetingV1])
    new = Codec(extra_types=[GreetingV2], upcasters={("test:greeting", 1): _rename})
    stored = old.encode(_record(GreetingV1(text="hello")))
    record = new.decode(stored)
    assert record.event == GreetingV2(content="hello", language="en")
    assert record.schema == 1  # the schema it was written with
    current = new.encode(msgspec.structs.replace(record, schema=2))
    assert new.decode(current).event == GreetingV2(content="hello", language="en")


def test_missing_upcaster_is_a_corrupt_record_not_a_guess() -> None:
    old = Codec(extra_types=[GreetingV1])
    new = Codec(extra_types=[GreetingV2])
    stored = old.encode(_record(GreetingV1(text="hello"), position=7))
    with pytest.raises(CorruptRecordError, match="no upcaster") as info:
        new.decode(stored)
    assert info.value.position == 7


def test_a_newer_schema_that_no_longer_fits_is_unknown_not_corrupt() -> None:
    """A newer stalwart changed ``test:greeting`` (schema 2); this version knows schema 1."""
    newer = Codec(extra_types=[GreetingV2])
    older = Codec(extra_types=[GreetingV1])
    stored = newer.encode(_record(GreetingV2(content="hi", language="fr"), position=9))
    record = older.decode(stored)
    assert isinstance(record.event, UnknownEvent)
    assert (record.type, record.event.schema, record.position) == ("test:greeting", 2, 9)
    assert event_data(record.event)["content"] == "hi"
    batch: list[RecordedEvent] = []
    assert older.decode_batch([stored], batch) is None
    assert batch == [record]


class _Counting(Codec):
    """The default vocabulary, counting the batches that went record by record."""

    def __init__(self) -> None:
        super().__init__()
        self.record_by_record = 0

    def decode_many(self, values: Any, out: list[RecordedEvent], limit: int) -> Any:
        self.record_by_record += 1
        return super().decode_many(values, out, limit)


def _compaction(added: tuple[str, ...]) -> ContextCompacted:
    return ContextCompacted(
        summary_id="s",
        turn=1,
        added=added,
        through_seq=1,
        tokens=1,
        budget=2,
        threshold=0.5,
    )


def _stored_compaction_v1(covers: list[str], **extra: Any) -> bytes:
    """A ``context:compacted`` record as schema 1 wrote it (``covers``, not ``added``)."""
    payload = {
        "type": "context:compacted",
        "summary_id": "s",
        "turn": 1,
        "covers": covers,
        "through_seq": 1,
        "tokens": 1,
        "budget": 2,
        "threshold": 0.5,
        **extra,
    }
    return msgspec.msgpack.encode([3, "context:x", 3, 1.0, "id", None, None, 1, payload])


def test_a_batch_at_current_schemas_is_decoded_in_one_pass() -> None:
    """The regression behind a replay that fell from 0.39 to 0.27 of a bare decode: once
    one type of the vocabulary moved to schema 2, every batch went record by record."""
    codec = _Counting()
    records = [_record(SessionClosed(reason="r"), position=1), _record(_compaction(("m",)), 2)]
    stored = [codec.encode(r) for r in records]
    out: list[RecordedEvent] = []
    assert codec.decode_batch(stored, out) is None
    assert out == records
    assert codec.record_by_record == 0


def test_a_batch_reads_every_record_as_decode_does() -> None:
    """Old schemas are upcast inside a batch, even a schema 1 payload the current class
    would also take (it carries a field named like the new one: the upcaster decides)."""
    stored = [
        DEFAULT_CODEC.encode(_record(SessionClosed(reason="r"))),
        _stored_compaction_v1(["m1", "m2"]),
        _stored_compaction_v1(["m3"], added=["decoy"]),
        DEFAULT_CODEC.encode(_record(_compaction(("m4",)))),
        msgspec.msgpack.encode([5, "s", 5, 1.0, "id", None, None, 1, {"type": "x:new", "a": 1}]),
    ]
    one_by_one = [DEFAULT_CODEC.decode(value) for value in stored]
    for start in range(len(stored)):  # every run of them as one batch
        for end in range(start + 1, len(stored) + 1):
            batch: list[RecordedEvent] = []
            assert DEFAULT_CODEC.decode_batch(stored[start:end], batch) is None
            many: list[RecordedEvent] = []
            assert DEFAULT_CODEC.decode_many(stored[start:end], many, end - start) is None
            assert batch == many == one_by_one[start:end]
    assert [r.event.added for r in one_by_one[1:4]] == [("m1", "m2"), ("m3",), ("m4",)]  # type: ignore[attr-defined]
    assert isinstance(one_by_one[4].event, UnknownEvent)


def test_a_newer_schema_that_still_fits_decodes() -> None:
    stored = Codec(extra_types=[GreetingV1], versions={"test:greeting": 3}).encode(
        _record(GreetingV1(text="hello"), schema=3)
    )
    assert Codec(extra_types=[GreetingV1]).decode(stored).event == GreetingV1(text="hello")


def test_a_newer_schema_with_garbage_bytes_is_still_corrupt() -> None:
    stored = msgspec.msgpack.encode([4, "s", 1, 1.0, "id", None, None, 2, b"\xc1"])
    with pytest.raises(CorruptRecordError):
        Codec(extra_types=[GreetingV1]).decode(stored)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"a": 1})],
)
def test_garbage_is_a_corrupt_record(data: bytes) -> None:
    with pytest.raises(CorruptRecordError):
        DEFAULT_CODEC.decode(data, 5)
