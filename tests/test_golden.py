"""Golden logs: bytes written by earlier versions must still read the same way."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from stalwart.errors import CorruptRecordError
from stalwart.events import DEFAULT_CODEC, UnknownEvent
from stalwart.state import SESSION, SessionState, fold

GOLDEN = Path(__file__).parent / "golden"


def _log(name: str) -> list[bytes]:
    records: list[bytes] = msgspec.msgpack.decode((GOLDEN / name).read_bytes())
    return records


def test_session_v1_folds_to_the_recorded_state() -> None:
    raw = _log("session-v1.log")
    records = [DEFAULT_CODEC.decode(data) for data in raw]
    expected = msgspec.json.decode(
        (GOLDEN / "session-v1.expected.json").read_bytes(), type=SessionState
    )
    assert fold(SESSION, expected.stream, records) == expected


def test_session_v1_reencodes_to_a_superset_of_its_fields() -> None:
    """The wire format is stable: no field was renamed, dropped or changed its value.

    Fields added since (with their defaults) may appear; nothing else may differ.
    """
    for data in _log("session-v1.log"):
        old = msgspec.msgpack.decode(data)
        record = DEFAULT_CODEC.decode(data)
        new = msgspec.msgpack.decode(DEFAULT_CODEC.encode(record))
        assert new[:8] == old[:8]  # the envelope
        added = set(new[8]) - set(old[8])
        assert {k: new[8][k] for k in old[8]} == old[8]
        for key in added:
            assert new[8][key] == _default(type(record.event), key), key


def _default(cls: type, name: str) -> object:
    for field in msgspec.structs.fields(cls):
        if field.name == name:
            if field.default is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default)
            if field.default_factory is not msgspec.NODEFAULT:
                return msgspec.to_builtins(field.default_factory())
    raise AssertionError(f"{cls.__name__}.{name} has no default")


def test_a_log_from_a_newer_version_keeps_its_unknown_event() -> None:
    records = [DEFAULT_CODEC.decode(data) for data in _log("session-future.log")]
    last = records[-1]
    assert isinstance(last.event, UnknownEvent)
    assert last.type == "session:sentiment_scored"
    assert last.schema == 3
    state = fold(SESSION, last.stream, records)
    assert state.version == last.version
    assert state.status == "idle"


def test_the_broken_log_must_fail_at_its_bad_record() -> None:
    raw = _log("session-broken.log")
    DEFAULT_CODEC.decode(raw[0])
    DEFAULT_CODEC.decode(raw[1])
    with pytest.raises(CorruptRecordError) as info:
        DEFAULT_CODEC.decode(raw[2])
    assert info.value.position == 3
