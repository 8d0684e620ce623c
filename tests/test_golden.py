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


def test_session_v1_encodes_to_the_same_bytes() -> None:
    """The wire format itself is stable: field order and names did not move."""
    for data in _log("session-v1.log"):
        assert DEFAULT_CODEC.encode(DEFAULT_CODEC.decode(data)) == data


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
