"""Third review of the spine: the codec, unknown events, snapshots and the CLI's read
commands (``tail``, ``replay``, ``replay --verify``), as an operator reading a damaged or
foreign log would meet them.

Every test uses a real LMDB directory and the CLI as a real subprocess. Each one marked
``# Was: DEFECT:`` fails on the code it was written against.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgspec

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationReady,
    Codec,
    Event,
    MessageAppended,
    RecordedEvent,
    SessionClosed,
    SessionCreated,
)
from stalwart.state import SESSION
from stalwart.store import Snapshot, load_state
from stalwart.store._projection import snapshot_name
from tests.test_spine_review import _stalwart
from tests.test_spine_review_two import _damage
from tests.test_store_lmdb import _overwrite_record

NOW = 1_800_000_000.0
#: the UTF-8 encoding of a lone surrogate (U+D800): bytes no UTF-8 decoder accepts
NOT_UTF8 = b"\xed\xa0\x80"


def _session(store_dir: Path, *contents: str) -> list[RecordedEvent]:
    """A session with one message per content; its records as stored."""
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        store.append("session:s1", [SessionCreated(agent="helper", title="hello")])
        for n, content in enumerate(contents):
            store.append(
                "session:s1", [MessageAppended(message_id=str(n), role="user", content=content)]
            )
        records: list[RecordedEvent] = list(store.read_all())
    return records


def _with_bytes(stored: bytes, text: bytes, replacement: bytes) -> bytes:
    """``stored`` with its one occurrence of ``text`` replaced (same length, so every
    msgpack length prefix still holds)."""
    assert len(text) == len(replacement)
    assert stored.count(text) == 1
    return stored.replace(text, replacement)


def _record_bytes(position: int, stream: str, version: int, event: dict[str, object]) -> bytes:
    """The bytes another writer stores for a record holding ``event`` (a tagged map)."""
    payload = msgspec.Raw(msgspec.msgpack.encode(event))
    return msgspec.msgpack.encode([position, stream, version, NOW, "id", None, None, 1, payload])


def _json_lines(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


# -- 1. a string whose bytes are not UTF-8 ---------------------------------------------------


# Was: DEFECT: a record whose string bytes are not UTF-8 (one damaged byte) raised a raw
# UnicodeDecodeError from the codec: `tail` and `replay` were an "internal error", not
# CorruptRecordError naming the position, and `tail` printed none of the good records
def test_a_record_with_a_string_that_is_not_utf8_is_corrupt_at_its_position(
    store_dir: Path,
) -> None:
    records = _session(store_dir, "abc", "after it")
    stored = Codec().encode(records[1])
    _overwrite_record(store_dir, 2, _with_bytes(stored, b"abc", NOT_UTF8))

    tail = _stalwart("--store", str(store_dir), "tail", "--json")
    assert tail.returncode == 1
    assert [line["position"] for line in _json_lines(tail.stdout)] == [1]
    assert tail.stderr.startswith("stalwart: error: record at position 2 is corrupt")
    assert len(tail.stderr.splitlines()) == 1

    replay = _stalwart("--store", str(store_dir), "replay", "session:s1")
    assert replay.returncode == 1
    assert replay.stderr.startswith("stalwart: error: record at position 2 is corrupt")

    # the records after it are still there to read, and verify reports it and reads on
    since = _stalwart("--store", str(store_dir), "tail", "--json", "--since", "2")
    assert since.returncode == 0
    assert [line["position"] for line in _json_lines(since.stdout)] == [3]
    verify = _stalwart("--store", str(store_dir), "replay", "session:s1", "--verify")
    assert verify.returncode == 1
    assert "UNDECODABLE  position 2" in verify.stdout


# Was: DEFECT: an event of a tag this version does not know whose payload holds a string
# that is not UTF-8 crashed `tail` (UnicodeDecodeError while showing its fields) instead of
# showing it as unknown with its raw bytes
def test_an_unknown_event_whose_payload_is_not_utf8_is_still_shown_with_its_raw_bytes(
    store_dir: Path,
) -> None:
    _session(store_dir, "first")
    event = {"type": "plugin:scan", "note": "xyz", "size": 3}
    value = _with_bytes(_record_bytes(2, "session:s1", 2, event), b"xyz", NOT_UTF8)
    _overwrite_record(store_dir, 2, value)

    tail = _stalwart("--store", str(store_dir), "tail", "--json")
    assert tail.returncode == 0, tail.stderr
    unknown = _json_lines(tail.stdout)[1]
    assert unknown["type"] == "plugin:scan"
    data = unknown["data"]
    assert isinstance(data, dict)
    assert data["_unknown"] is True
    raw = base64.b64decode(str(data["_raw_b64"]))
    assert raw == _with_bytes(msgspec.msgpack.encode(event), b"xyz", NOT_UTF8)

    text = _stalwart("--store", str(store_dir), "tail")
    assert text.returncode == 0, text.stderr
    assert "plugin:scan (unknown type)" in text.stdout


# -- 2. a known event whose open-ended field JSON has no form for -------------------------


# Was: DEFECT: `tail` (and `tail --json`) stopped with "internal error: TypeError" at a
# `session:closed` whose `details` (dict[str, Any]) held a map keyed by nil or by an array,
# or a msgpack extension value: the store took it, and the log could no longer be listed
def test_tail_shows_an_event_whose_details_hold_keys_json_has_no_form_for(
    store_dir: Path,
) -> None:
    details = {
        "votes": {None: 2, (1, 2): "pair"},
        "blob": msgspec.msgpack.Ext(7, b"\x01\x02"),
        "plain": [1, "two"],
    }
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        store.append("session:s1", [SessionClosed(reason="done", details=details)])
        store.append("session:s1", [SessionCreated(agent="after")])

    tail = _stalwart("--store", str(store_dir), "tail", "--json")
    assert tail.returncode == 0, tail.stderr
    closed, after = _json_lines(tail.stdout)
    assert set(closed) == {"position", "stream", "version", "type", "ts", "data"}
    assert closed["data"] == {
        "reason": "done",
        "details": {
            "votes": {"null": 2, "[1,2]": "pair"},
            "blob": "msgpack ext 7: AQI=",
            "plain": [1, "two"],
        },
    }
    assert after["position"] == 2

    text = _stalwart("--store", str(store_dir), "tail")
    assert text.returncode == 0, text.stderr
    assert '"[1,2]":"pair"' in text.stdout.splitlines()[0]


# -- 3. a snapshot that cannot be decoded -------------------------------------------------


# Was: DEFECT: a saved snapshot holding a string that is not UTF-8 stopped `replay` (and
# every load_state, so an Agent's rebuild) with UnicodeDecodeError instead of falling back
# to the full fold as any other undecodable snapshot does
def test_a_snapshot_with_a_string_that_is_not_utf8_falls_back_to_the_full_fold(
    store_dir: Path,
) -> None:
    _session(store_dir, "one", "two")
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        state = load_state(store, "session:s1", SESSION, snapshot_every=0)
        data = _with_bytes(msgspec.msgpack.encode(state), b"hello", NOT_UTF8 + b"xy")
        store.put_snapshot(
            Snapshot(
                stream="session:s1",
                name=snapshot_name(SESSION),
                version=state.version,
                position=3,
                data=data,
            )
        )
        assert load_state(store, "session:s1", SESSION, snapshot_every=0) == state

    replay = _stalwart("--store", str(store_dir), "replay", "session:s1", "--json")
    assert replay.returncode == 0, replay.stderr
    full = _stalwart("--store", str(store_dir), "replay", "session:s1", "--json", "--no-snapshots")
    assert replay.stdout == full.stdout
    assert json.loads(replay.stdout)["title"] == "hello"


# -- 4. `replay --verify` prints an unknown event's tag -------------------------------------


class _Escaping(Event, frozen=True, tag="plugin:\x1b[2J\x1b[32mscan\nclean: all good"):
    """A plugin's event whose tag holds a terminal escape and a line break."""

    size: int = 1


# Was: DEFECT: `replay --verify` printed the tag of an event it does not know as it is: a
# foreign writer's escape sequences reached the terminal (clearing it, recolouring it) and
# a line break in the tag forged a line of the report
def test_verify_shows_an_unknown_events_tag_escaped_on_its_own_line(store_dir: Path) -> None:
    codec = Codec(extra_types=[_Escaping])
    with store_module.open(store_dir, codec=codec, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        store.append("session:s1", [SessionCreated(agent="helper"), _Escaping()])

    for scope in (["session:s1"], ["--all"]):
        verify = _stalwart("--store", str(store_dir), "replay", *scope, "--verify")
        assert verify.returncode == 1
        assert "\x1b" not in verify.stdout
        finding = next(
            line for line in verify.stdout.splitlines() if line.startswith("UNDECODABLE")
        )
        assert finding.startswith("UNDECODABLE  position 2  session:s1 v2  plugin:")
        assert "clean: all good" in finding  # the rest of the tag, on the finding's line
        assert not any(line.startswith("clean:") for line in verify.stdout.splitlines())


# -- found from this review: the same damaged string in the index's tail and a due row -----


# Was: DEFECT: a record whose stream id bytes are not UTF-8 stopped `replay STREAM` with an
# internal UnicodeDecodeError from the LMDB index's tail scan (tail and --verify read on)
def test_replay_of_a_stream_whose_record_has_a_damaged_stream_id_is_a_one_line_error(
    store_dir: Path,
) -> None:
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        for n in range(3):
            store.append(
                "session:abc", [MessageAppended(message_id=str(n), role="user", content="x")]
            )
        stored = Codec().encode(list(store.read_all())[1])
    _overwrite_record(store_dir, 2, _with_bytes(stored, b"session:abc", b"session:" + NOT_UTF8))
    replay = _stalwart("--store", str(store_dir), "replay", "session:abc")
    assert replay.returncode == 1
    assert replay.stderr.startswith("stalwart: error: "), replay.stderr
    assert "internal error" not in replay.stderr
    assert len(replay.stderr.splitlines()) == 1


# Was: DEFECT: a work-queue row whose holder bytes are not UTF-8 raised UnicodeDecodeError
# from every claim_due (a damaged row must count as due now, as an undecodable one does)
def test_a_due_row_with_a_damaged_string_is_due_now(store_dir: Path) -> None:
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        store.append("session:a", [ActivationReady(activation_id="a1", kind="message")])
        store.append("session:b", [ActivationReady(activation_id="b1", kind="message")])
    row = msgspec.msgpack.encode((NOW, 1, "wXYZ", NOW))  # at, version, holder, until
    _damage(store_dir, b"due", b"session:a", _with_bytes(row, b"XYZ", NOT_UTF8))
    with store_module.open(store_dir, clock=FakeClock(NOW)) as store:  # type: ignore[attr-defined]
        work = store.claim_due("worker-1", NOW + 1, 10, 5.0)
    assert sorted(claim.stream for claim in work.claimed) == ["session:a", "session:b"]
