"""The tagged union of every event, the recorded envelope, and the codec.

A stored record is one msgpack array: ``[position, stream, version, ts, id, causation_id,
correlation_id, schema, event]`` where ``event`` is the event's tagged map and ``schema``
the version of that event's payload when it was written. Decoding takes one msgspec pass
in the common case; a record written at an older schema goes through the upcasters, and
a record whose tag this version does not know, or whose schema is newer than this
version's and no longer fits its class, becomes an :class:`UnknownEvent` holding its raw
bytes.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Union

import msgspec

from stalwart.errors import CorruptRecordError, EventError, UnknownEventTypeError

from . import (  # noqa: F401  (imported for their Event subclasses)
    _activation,
    _announcement,
    _context,
    _draft,
    _prompt,
    _provider,
    _runtime,
    _session,
    _subagent,
)
from ._base import Event, UnknownEvent

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def _collect(root: type[Event]) -> dict[str, type[Event]]:
    found: dict[str, type[Event]] = {}
    stack = list(root.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if not isinstance(tag, str) or ":" not in tag:
            raise EventError(
                f"{cls.__qualname__} needs an explicit 'domain:name' tag, found {tag!r}"
            )
        if tag in found and found[tag] is not cls:
            raise EventError(
                f"tag {tag!r} is used by {found[tag].__qualname__} and {cls.__qualname__}"
            )
        found[tag] = cls
    return found


#: Every event type this version knows, by tag (``stalwart:unknown`` included).
EVENT_TYPES: Mapping[str, type[Event]] = _collect(Event)

if TYPE_CHECKING:
    AnyEvent = Event
else:
    AnyEvent = Union[tuple(EVENT_TYPES[t] for t in sorted(EVENT_TYPES))]  # noqa: UP007


def _compacted_added(payload: dict[str, Any]) -> dict[str, Any]:
    """``context:compacted`` 1 -> 2: every id covered so far (``covers``) becomes
    ``added``; the fold takes the union, so it reads the same."""
    payload["added"] = payload.pop("covers")
    return payload


#: Upcasters of the built-in vocabulary: ``(tag, from_schema) -> fn(payload) -> payload``.
UPCASTERS: Mapping[tuple[str, int], Upcaster] = {("context:compacted", 1): _compacted_added}


class RecordedEvent(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An event as the log holds it: where it is, when it happened, and what caused it."""

    position: int
    stream: str
    version: int
    ts: float
    id: str
    causation_id: str | None
    correlation_id: str | None
    schema: int
    event: AnyEvent

    @property
    def type(self) -> str:
        """The event's tag (for an unknown event, the tag it was written with)."""
        event = self.event
        if isinstance(event, UnknownEvent):
            return event.tag
        return event_tag(event)


class _RawRecord(msgspec.Struct, frozen=True, array_like=True, gc=False):
    position: int
    stream: str
    version: int
    ts: float
    id: str
    causation_id: str | None
    correlation_id: str | None
    schema: int
    event: msgspec.Raw


#: what decoding bytes raises when they are not a record: msgspec's error, RecursionError
#: (for data nested deeper than the interpreter's recursion limit), or UnicodeDecodeError
#: (a string whose bytes are not UTF-8: msgspec raises Python's own error for it)
UNREADABLE = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
#: a place kept in a batch for a record the fast pass could not take (decoded again)
_REFUSED = RecordedEvent(
    position=-1,
    stream="",
    version=0,
    ts=0.0,
    id="",
    causation_id=None,
    correlation_id=None,
    schema=0,
    event=UnknownEvent(tag="", schema=0, raw=b""),
)
_SCHEMA = attrgetter("schema")
_EVENT = attrgetter("event")
_V1 = frozenset({1})


class _Tagged(msgspec.Struct):
    type: str


def event_tag(event: Event) -> str:
    """The wire tag of an event instance."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


class Codec:
    """Encodes recorded events and decodes them back, upcasting old payloads.

    ``extra_types`` adds event classes outside the built-in vocabulary (a plugin's);
    ``versions`` and ``upcasters`` override the current schema version of a tag and add
    upcasters, which is how a schema change is made and tested. The default codec decodes
    in a single msgspec pass.
    """

    def __init__(
        self,
        *,
        extra_types: Iterable[type[Event]] = (),
        versions: Mapping[str, int] | None = None,
        upcasters: Mapping[tuple[str, int], Upcaster] | None = None,
    ) -> None:
        types = dict(EVENT_TYPES)
        extra = tuple(extra_types)
        for cls in extra:
            tag = cls.__struct_config__.tag
            if not isinstance(tag, str) or ":" not in tag:
                raise EventError(f"{cls.__qualname__} needs an explicit 'domain:name' tag")
            types[tag] = cls
        self._types = types
        unknown = sorted(set(versions or {}) - set(types))
        if unknown:  # a record of it would find no class to upcast into
            raise EventError(f"versions names tags no event type has: {', '.join(unknown)}")
        self._versions = {tag: cls.schema_version for tag, cls in types.items()}
        self._versions.update(versions or {})
        self._by_class = {types[tag]: v for tag, v in self._versions.items()}
        #: the classes whose current schema is not 1: a record of one written with schema
        #: 1 needs its upcaster, though the fast decoder may take it
        self._not_v1 = frozenset(cls for cls, v in self._by_class.items() if v != 1)
        self._upcasters = {**UPCASTERS, **(upcasters or {})}
        self._encoder = msgspec.msgpack.Encoder()
        self._checkers: dict[type[Event], msgspec.msgpack.Decoder[Any]] = {}
        self._raw_decoder = msgspec.msgpack.Decoder(_RawRecord)
        self._tag_decoder = msgspec.msgpack.Decoder(_Tagged)
        #: one record's bytes to the record, in C where it can be (raises DecodeError
        #: for a record it cannot take: an unknown tag, a corrupt one)
        self._fast: Callable[[bytes | memoryview], RecordedEvent]
        if extra:  # RecordedEvent's event field is the built-in union: two passes
            union: Any = Union[tuple(types[t] for t in sorted(types))]  # noqa: UP007
            self._event_decoder: Any = msgspec.msgpack.Decoder(union)
            self._fast = self._decode_with_extra_types
        else:
            self._event_decoder = msgspec.msgpack.Decoder(AnyEvent)
            self._fast = msgspec.msgpack.Decoder(RecordedEvent).decode

    # -- the vocabulary -------------------------------------------------------------------

    def knows(self, event: object) -> bool:
        """Whether ``event`` is an instance of a type this codec can write."""
        return type(event) in self._by_class and not isinstance(event, UnknownEvent)

    def check(self, event: Event, encoded: bytes) -> None:
        """EventError unless ``event``, as ``encoded`` (its msgpack bytes), reads back.

        msgspec Structs do not check their fields when built, so an event can hold a
        value its type does not allow (``None`` for a ``str``, a set): it would encode,
        and then every read of the log would stop at it. Appends check first.
        """
        cls = type(event)
        decoder = self._checkers.get(cls)
        if decoder is None:
            decoder = self._checkers[cls] = msgspec.msgpack.Decoder(cls)
        try:
            decoder.decode(encoded)
        except UNREADABLE as exc:
            raise EventError(
                f"cannot append {cls.__qualname__}: it would not read back ({exc})"
            ) from None

    def readable(self, value: bytes) -> None:
        """EventError unless the stored bytes of a record decode back (what the LMDB
        writer checks of each record before it writes it: a field holding a value its
        type forbids, or a ``ts`` that is not a number, would stop every read)."""
        try:
            self.decode(value)
        except CorruptRecordError as exc:
            raise EventError(f"the record would not read back ({exc})") from None

    def schema_of(self, event: Event) -> int:
        """The current schema version of ``event``'s type."""
        try:
            return self._by_class[type(event)]
        except KeyError:
            raise UnknownEventTypeError(
                f"{type(event).__qualname__} is not a registered event type"
            ) from None

    # -- records ----------------------------------------------------------------------------

    def encode(self, record: RecordedEvent) -> bytes:
        """The stored bytes of a record."""
        return self._encoder.encode(record)

    def decode(self, data: bytes | memoryview, position: int = -1) -> RecordedEvent:
        """Decode stored bytes; raises :class:`CorruptRecordError` when they cannot be read."""
        try:
            record = self._fast(data)
        except UNREADABLE:
            return self._decode_slow(data, position)
        if record.schema == self._by_class.get(type(record.event)):
            return record
        return self._decode_slow(data, position)

    def decode_many(
        self, values: Iterable[bytes | memoryview], out: list[RecordedEvent], limit: int
    ) -> CorruptRecordError | None:
        """Decode up to ``limit`` values into ``out``; stop at the first corrupt one.

        One msgspec call per record in the common case (a record written with its type's
        current schema). A corrupt record ends the loop and is returned (not raised) so the
        caller can hand over every good record before it first; its position is unknown
        here (-1).
        """
        if limit <= 0:
            return None
        fast = self._fast
        current = self._by_class.get
        append = out.append
        for count, value in enumerate(values, 1):
            try:
                try:
                    record = fast(value)
                except UNREADABLE:
                    record = self._decode_slow(value, -1)
                else:
                    if record.schema != current(type(record.event)):
                        record = self._decode_slow(value, -1)
            except CorruptRecordError as exc:
                return exc
            append(record)
            if count >= limit:
                break
        return None

    def decode_batch(
        self, values: Sequence[bytes | memoryview], out: list[RecordedEvent]
    ) -> CorruptRecordError | None:
        """Decode every value into ``out``; stop at the first corrupt one (its index is
        ``len(out)`` on return).

        Like :meth:`decode_many`, but on a sequence already read: one C-level pass
        (``map`` over the decoder), resumed after any record it cannot take, and a C-level
        check that every record has its type's current schema. Only the records that need
        it (an unknown tag, an older or newer schema, a corrupt one) are decoded again on
        their own, so one such record costs its batch nothing more than itself.
        """
        fast = self._fast
        records: list[RecordedEvent] = []
        refused: list[int] = []  # the indexes the fast pass could not take
        while True:
            at = len(records)
            try:
                records.extend(map(fast, values[at:] if at else values))
            except UNREADABLE:
                refused.append(len(records))
                records.append(_REFUSED)
                continue
            break
        if not refused and self._all_current(records):
            out.extend(records)
            return None
        current = self._by_class.get
        again = set(refused)
        append = out.append
        for index, fast_read in enumerate(records):
            record = fast_read
            if index in again or record.schema != current(type(record.event)):
                try:
                    record = self._decode_slow(values[index], -1)
                except CorruptRecordError as exc:
                    return exc
            append(record)
        return None

    def _all_current(self, records: list[RecordedEvent]) -> bool:
        """Whether every record was written with its type's current schema (so the fast
        decoder's reading is the right one)."""
        if set(map(_SCHEMA, records)) <= _V1:
            not_v1 = self._not_v1
            return not not_v1 or not_v1.isdisjoint(map(type, map(_EVENT, records)))
        current = self._by_class.get
        return all(record.schema == current(type(record.event)) for record in records)

    def _decode_with_extra_types(self, data: bytes | memoryview) -> RecordedEvent:
        """The fast decode of a codec with extra types: the record, then its event with
        the whole vocabulary (two C passes); DecodeError for a record it cannot take."""
        raw = self._raw_decoder.decode(data)
        event = self._event_decoder.decode(raw.event)
        return RecordedEvent(
            raw.position,
            raw.stream,
            raw.version,
            raw.ts,
            raw.id,
            raw.causation_id,
            raw.correlation_id,
            raw.schema,
            event,
        )

    def _decode_slow(self, data: bytes | memoryview, position: int) -> RecordedEvent:
        try:
            raw = self._raw_decoder.decode(data)
        except UNREADABLE as exc:
            raise CorruptRecordError(position, f"not a stalwart record ({exc})") from exc
        try:
            tag = self._tag_decoder.decode(raw.event).type
        except UNREADABLE as exc:
            raise CorruptRecordError(raw.position, f"event payload has no tag ({exc})") from exc
        current = self._versions.get(tag)
        if current is None or tag == "stalwart:unknown":
            event: Event = UnknownEvent(tag=tag, schema=raw.schema, raw=bytes(raw.event))
        else:
            event = self._upcast(raw, tag, current)
        return RecordedEvent(
            position=raw.position,
            stream=raw.stream,
            version=raw.version,
            ts=raw.ts,
            id=raw.id,
            causation_id=raw.causation_id,
            correlation_id=raw.correlation_id,
            schema=raw.schema,
            event=event,
        )

    def _upcast(self, raw: _RawRecord, tag: str, current: int) -> Event:
        if raw.schema > current:
            return self._newer(raw, tag)
        try:
            if raw.schema == current:
                event: Event = self._event_decoder.decode(raw.event)
                return event
            payload: dict[str, Any] = msgspec.msgpack.decode(raw.event)
            for version in range(raw.schema, current):
                upcaster = self._upcasters.get((tag, version))
                if upcaster is None:
                    raise CorruptRecordError(
                        raw.position, f"no upcaster for {tag!r} from schema {version}"
                    )
                try:
                    payload = upcaster(payload)
                    payload["type"] = tag
                except Exception as exc:  # a plugin's code: its failure is the record's
                    raise CorruptRecordError(
                        raw.position,
                        f"the upcaster of {tag!r} from schema {version} failed "
                        f"({type(exc).__name__})",
                    ) from exc
            # the tag's own class: converting into the whole union builds its converter
            # again on every call (about 95 µs, against 0.5)
            upcast: Event = msgspec.convert(payload, self._types[tag])
            return upcast
        except UNREADABLE as exc:
            raise CorruptRecordError(raw.position, f"{tag!r} payload: {exc}") from exc
        except msgspec.ValidationError as exc:
            raise CorruptRecordError(raw.position, f"{tag!r} payload: {exc}") from exc

    def _newer(self, raw: _RawRecord, tag: str) -> Event:
        """A record a newer stalwart wrote at a schema this version does not have yet.

        It decodes when the change only added fields; otherwise its shape is not this
        version's to guess, so it is kept as an :class:`UnknownEvent` (never a corrupt
        record: the bytes are sound, they are just from the future).
        """
        try:
            event: Event = self._event_decoder.decode(raw.event)
        except msgspec.ValidationError:
            return UnknownEvent(tag=tag, schema=raw.schema, raw=bytes(raw.event))
        except UNREADABLE as exc:
            raise CorruptRecordError(raw.position, f"{tag!r} payload: {exc}") from exc
        return event


def event_data(event: Event) -> dict[str, Any]:
    """An event's fields as JSON-ready builtins, without its tag.

    An unknown event shows what can be read of its raw payload, plus ``_unknown``,
    ``_schema`` and ``_raw_b64`` so nothing about it is hidden.
    """
    if isinstance(event, UnknownEvent):
        data = _readable(event.raw)
        data["_unknown"] = True
        data["_schema"] = event.schema
        data["_raw_b64"] = base64.b64encode(event.raw).decode("ascii")
        return data
    # an ``Any`` field may hold what JSON has no form for: a msgpack extension value (as
    # text), a map keyed by an array or nil (its keys as text: ``to_builtins`` refuses
    # such a key with ``str_keys``, and the rare event that has one takes ``_plain``)
    built: dict[str, Any]
    try:
        built = msgspec.to_builtins(event, enc_hook=_shown, str_keys=True)
    except TypeError:
        built = _plain(msgspec.to_builtins(event, enc_hook=_shown))
    built.pop("type", None)
    return built


def _readable(payload: bytes) -> dict[str, Any]:
    """What can be read of an event's msgpack map as JSON-ready builtins, without its tag
    (every key as text, a value JSON has no form for as text; nothing when the bytes are
    not a map)."""
    try:
        decoded = msgspec.msgpack.decode(payload)
        if not isinstance(decoded, dict):
            return {}
        data: dict[str, Any] = msgspec.to_builtins(
            {k: v for k, v in _plain(decoded).items() if k != "type"},
            enc_hook=_shown,
            builtin_types=(),
        )
    except (*UNREADABLE, TypeError):
        return {}
    return data


def _shown(value: Any) -> str:
    """A decoded value JSON has no form for (a msgpack extension value) as text."""
    if isinstance(value, msgspec.msgpack.Ext):
        return f"msgpack ext {value.code}: {base64.b64encode(value.data).decode('ascii')}"
    return repr(value)


def _plain(value: Any) -> Any:
    """A decoded msgpack value whose maps all have string keys (a newer event's
    ``dict[tuple[int, int], str]`` has tuple keys: valid msgpack, not valid JSON)."""
    if isinstance(value, dict):
        return {_key_text(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _key_text(key: Any) -> str:
    """A map key as text: a string as it is, anything else as its JSON (``[0,1]``,
    ``true``, ``null``, ``3``), or its repr when it has none."""
    if isinstance(key, str):
        return key
    try:
        return msgspec.json.encode(_plain(key), enc_hook=_shown).decode()
    except (TypeError, ValueError):
        return repr(key)


#: The codec every store uses unless given another.
DEFAULT_CODEC = Codec()
