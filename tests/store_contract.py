"""The EventStore contract: every implementation runs this same suite unchanged.

A test module subclasses :class:`EventStoreContract` and provides a ``store`` fixture
(and ``reopen`` for durability checks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import pytest

from stalwart.errors import (
    ConcurrencyError,
    EventError,
    FencedError,
    InvalidStreamError,
    StoreClosedError,
    UnknownEventTypeError,
)
from stalwart.events import (
    MessageAppended,
    RecordedEvent,
    SessionCreated,
    TurnStarted,
    UnknownEvent,
)
from stalwart.store import NO_STREAM, EventStore, Fence, NewEvent, Snapshot
from stalwart.store._protocol import MAX_SNAPSHOT_NAME_BYTES, MAX_STREAM_BYTES


def msg(n: int | str, content: str = "x") -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content=content)


class EventStoreContract:
    """Ordering, atomic batches, concurrency conflicts, gap-free tailing, durability."""

    reopen: Callable[[], EventStore]

    # -- append and read ------------------------------------------------------------------

    @pytest.mark.parametrize(
        "bad",
        [
            NewEvent(event=MessageAppended(message_id="m", role="user", content=None)),  # type: ignore[arg-type]
            NewEvent(event=msg("m"), ts="yesterday"),  # type: ignore[arg-type]
        ],
        ids=["field-of-the-wrong-type", "ts-not-a-number"],
    )
    def test_an_event_that_would_not_read_back_is_refused(
        self, store: EventStore, bad: NewEvent
    ) -> None:
        with pytest.raises(EventError):
            store.append("session:a", [bad])
        store.append("session:b", [msg(1)])
        assert [r.stream for r in store.read_all()] == ["session:b"]

    def test_empty_store(self, store: EventStore) -> None:
        assert store.head() == 0
        assert list(store.read_all()) == []
        assert store.streams() == []
        assert store.stream_version("session:none") == 0
        assert list(store.read_stream("session:none")) == []

    def test_append_assigns_positions_and_versions(self, store: EventStore) -> None:
        first = store.append("session:a", [SessionCreated(), msg(1)])
        second = store.append("session:b", [SessionCreated()])
        third = store.append("session:a", [msg(2)])
        assert [(r.position, r.stream, r.version) for r in first + second + third] == [
            (1, "session:a", 1),
            (2, "session:a", 2),
            (3, "session:b", 1),
            (4, "session:a", 3),
        ]
        assert store.head() == 4
        assert list(store.read_all()) == first + second + third

    def test_read_stream_in_version_order(self, store: EventStore) -> None:
        for i in range(5):
            store.append("session:a", [msg(f"a{i}")])
            store.append("session:b", [msg(f"b{i}")])
        records = list(store.read_stream("session:a"))
        assert [r.version for r in records] == [1, 2, 3, 4, 5]
        assert [r.event.message_id for r in records] == [f"a{i}" for i in range(5)]  # type: ignore[attr-defined]
        assert [r.version for r in store.read_stream("session:a", 3)] == [3, 4, 5]
        assert [r.version for r in store.read_stream("session:a", 2, 3)] == [2, 3]

    def test_stream_prefix_is_not_confused_with_longer_stream(self, store: EventStore) -> None:
        store.append("session:a", [msg(1)])
        store.append("session:ab", [msg(2), msg(3)])
        assert [r.stream for r in store.read_stream("session:a")] == ["session:a"]
        assert store.stream_version("session:ab") == 2

    def test_read_all_ranges_are_inclusive(self, store: EventStore) -> None:
        store.append("s:1", [msg(i) for i in range(10)])
        assert [r.position for r in store.read_all(4, 6)] == [4, 5, 6]
        assert [r.position for r in store.read_all(9)] == [9, 10]
        assert list(store.read_all(11)) == []

    def test_read_across_batch_boundaries(self, store: EventStore) -> None:
        store.append("s:big", [msg(i) for i in range(2500)])
        assert [r.position for r in store.read_all()] == list(range(1, 2501))
        assert [r.version for r in store.read_stream("s:big", 1000)] == list(range(1000, 2501))

    def test_metadata_round_trips(self, store: EventStore) -> None:
        [recorded] = store.append(
            "session:a",
            [NewEvent(event=msg(1), ts=12.5, id="e1", causation_id="c1", correlation_id="k1")],
        )
        [read] = store.read_all()
        assert read == recorded
        assert (read.ts, read.id, read.causation_id, read.correlation_id) == (
            12.5,
            "e1",
            "c1",
            "k1",
        )

    def test_store_stamps_time_from_its_clock_and_makes_ids(self, store: EventStore) -> None:
        a, b = store.append("session:a", [msg(1), msg(2)])
        assert a.id != b.id
        assert len(a.id) == 32
        assert a.ts > 0

    def test_streams_lists_versions_and_last_event(self, store: EventStore) -> None:
        store.append("session:b", [NewEvent(event=msg(1), ts=5.0)])
        store.append("session:a", [msg(1), NewEvent(event=msg(2), ts=7.0)])
        infos = store.streams()
        assert [(i.stream, i.version, i.last_position, i.last_ts) for i in infos] == [
            ("session:a", 2, 3, 7.0),
            ("session:b", 1, 1, 5.0),
        ]

    def test_empty_append_is_a_no_op(self, store: EventStore) -> None:
        assert store.append("session:a", []) == []
        assert store.head() == 0

    # -- optimistic concurrency ---------------------------------------------------------------

    def test_expected_version_no_stream(self, store: EventStore) -> None:
        store.append("session:a", [SessionCreated()], expected_version=NO_STREAM)
        with pytest.raises(ConcurrencyError) as info:
            store.append("session:a", [SessionCreated()], expected_version=NO_STREAM)
        assert (info.value.stream, info.value.expected, info.value.actual) == ("session:a", 0, 1)
        assert "session:a" in str(info.value)

    def test_conflict_appends_nothing(self, store: EventStore) -> None:
        store.append("session:a", [msg(1), msg(2)])
        with pytest.raises(ConcurrencyError):
            store.append("session:a", [msg(3), msg(4)], expected_version=1)
        assert store.head() == 2
        store.append("session:a", [msg(3)], expected_version=2)
        assert store.stream_version("session:a") == 3

    def test_conflict_on_empty_append_too(self, store: EventStore) -> None:
        with pytest.raises(ConcurrencyError):
            store.append("session:a", [], expected_version=3)

    def test_concurrent_appenders_with_expected_version_never_duplicate(
        self, store: EventStore
    ) -> None:
        winners: list[int] = []
        conflicts: list[int] = []
        barrier = threading.Barrier(8)

        def contend(n: int) -> None:
            barrier.wait()
            try:
                store.append("session:race", [msg(n)], expected_version=NO_STREAM)
                winners.append(n)
            except ConcurrencyError:
                conflicts.append(n)

        threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(winners) == 1
        assert len(conflicts) == 7
        assert store.stream_version("session:race") == 1

    # -- fencing ------------------------------------------------------------------------------

    def test_a_claim_raises_the_lease_epoch(self, store: EventStore) -> None:
        assert store.lease_epoch("session:f") == 0
        store.append("session:f", [msg(1)], fence=Fence(1, claim=True))
        assert store.lease_epoch("session:f") == 1
        store.append("session:f", [msg(2)], fence=Fence(1))
        store.append("session:f", [msg(3)])  # unfenced appends always go through
        store.append("session:f", [msg(4)], fence=Fence(5, claim=True))  # epochs may skip
        assert store.lease_epoch("session:f") == 5
        info = {s.stream: s for s in store.streams()}["session:f"]
        assert (info.version, info.lease_epoch) == (4, 5)

    def test_a_stale_holder_is_fenced_and_writes_nothing(self, store: EventStore) -> None:
        store.append("session:f", [msg(1)], fence=Fence(1, claim=True))
        store.append("session:f", [msg(2)], fence=Fence(2, claim=True))  # the takeover
        head = store.head()
        with pytest.raises(FencedError) as caught:
            store.append("session:f", [msg(3), msg(4)], fence=Fence(1))
        assert (caught.value.stream, caught.value.held, caught.value.current) == (
            "session:f",
            1,
            2,
        )
        assert "epoch 2" in str(caught.value)
        with pytest.raises(FencedError):
            store.append("session:f", [msg(3)], fence=Fence(3))  # holding an unclaimed epoch
        assert store.head() == head
        assert store.stream_version("session:f") == 2

    def test_a_claim_must_be_higher(self, store: EventStore) -> None:
        store.append("session:f", [msg(1)], fence=Fence(2, claim=True))
        for epoch in (1, 2):
            with pytest.raises(FencedError) as caught:
                store.append("session:f", [msg(9)], fence=Fence(epoch, claim=True))
            assert caught.value.claim
        assert store.stream_version("session:f") == 1

    def test_fence_and_expected_version_both_hold(self, store: EventStore) -> None:
        store.append("session:f", [msg(1)], fence=Fence(1, claim=True))
        with pytest.raises(ConcurrencyError):
            store.append("session:f", [msg(2)], expected_version=0, fence=Fence(2, claim=True))
        assert store.lease_epoch("session:f") == 1  # a refused append claims nothing

    def test_concurrent_claims_have_one_winner(self, store: EventStore) -> None:
        store.append("session:claim", [msg(0)])
        winners: list[int] = []
        fenced: list[int] = []
        barrier = threading.Barrier(8)

        def claim(n: int) -> None:
            barrier.wait()
            try:
                store.append("session:claim", [msg(n)], fence=Fence(1, claim=True))
                winners.append(n)
            except FencedError:
                fenced.append(n)

        threads = [threading.Thread(target=claim, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert (len(winners), len(fenced)) == (1, 7)
        assert store.stream_version("session:claim") == 2

    def test_concurrent_appends_are_gap_free(self, store: EventStore) -> None:
        def work(n: int) -> None:
            for i in range(40):
                store.append(f"session:{n % 3}", [msg(f"{n}-{i}"), msg(f"{n}-{i}b")])

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        records = list(store.read_all())
        assert [r.position for r in records] == list(range(1, 641))
        for stream in ("session:0", "session:1", "session:2"):
            versions = [r.version for r in records if r.stream == stream]
            assert versions == list(range(1, len(versions) + 1))
        # each append's two events are adjacent: a batch is atomic and contiguous
        ids = [r.event.message_id for r in records]  # type: ignore[attr-defined]
        for first, second in zip(ids[::2], ids[1::2], strict=True):
            assert second == first + "b"

    # -- bad input ------------------------------------------------------------------------------

    @pytest.mark.parametrize("stream", ["", "a\x00b", "x" * 401])
    def test_invalid_stream_ids(self, store: EventStore, stream: str) -> None:
        with pytest.raises(InvalidStreamError):
            store.append(stream, [msg(1)])
        assert store.head() == 0

    def test_unknown_event_cannot_be_appended(self, store: EventStore) -> None:
        with pytest.raises(UnknownEventTypeError):
            store.append("s:1", [UnknownEvent(tag="x:y", schema=1, raw=b"\x80")])
        with pytest.raises(UnknownEventTypeError):
            store.append("s:1", [object()])  # type: ignore[list-item]
        assert store.head() == 0

    def test_unencodable_event_fails_alone(self, store: EventStore) -> None:
        too_big = MessageAppended(message_id="m", role="user", content="x", turn_id=None)
        too_big = msgspec.structs.replace(too_big, tool_calls=((2**70),))  # type: ignore[arg-type]
        with pytest.raises(EventError):
            store.append("s:1", [msg(1), too_big])
        assert store.head() == 0
        store.append("s:1", [msg(2)])
        assert [r.version for r in store.read_stream("s:1")] == [1]

    # -- tailing ---------------------------------------------------------------------------------

    def test_subscription_sees_existing_then_new_events(self, store: EventStore) -> None:
        store.append("s:1", [msg(1), msg(2)])
        with store.subscribe(2) as subscription:
            assert [r.position for r in subscription.poll(1)] == [2]
            assert subscription.poll(0.05) == []
            store.append("s:1", [msg(3)])
            assert [r.position for r in subscription.poll(5)] == [3]

    def test_subscription_wakes_on_append_from_another_thread(self, store: EventStore) -> None:
        got: list[RecordedEvent] = []
        ready = threading.Event()

        def follow() -> None:
            with store.subscribe(1) as subscription:
                ready.set()
                for record in subscription:
                    got.append(record)
                    if len(got) == 50:
                        return

        follower = threading.Thread(target=follow)
        follower.start()
        assert ready.wait(5)
        for i in range(50):
            store.append(f"s:{i % 2}", [msg(i)])
        follower.join(timeout=10)
        assert not follower.is_alive()
        assert [r.position for r in got] == list(range(1, 51))

    def test_closing_a_subscription_ends_iteration(self, store: EventStore) -> None:
        subscription = store.subscribe(1)
        done = threading.Event()

        def follow() -> None:
            for _ in subscription:
                pass
            done.set()

        threading.Thread(target=follow, daemon=True).start()
        subscription.close()
        assert done.wait(5)

    def test_wait_for_times_out(self, store: EventStore) -> None:
        assert store.wait_for(1, 0.05) == 0
        store.append("s:1", [msg(1)])
        assert store.wait_for(1, 0.05) == 1

    # -- snapshots --------------------------------------------------------------------------------

    def test_snapshots_newest_first_and_pruned(self, store: EventStore) -> None:
        for version in (10, 20, 30, 40):
            store.put_snapshot(
                Snapshot(
                    stream="session:a",
                    name="f@v1",
                    version=version,
                    position=version,
                    data=b"%d" % version,
                )
            )
        found = list(store.snapshots("session:a", "f@v1"))
        assert [s.version for s in found] == [40, 30, 20]
        assert found[0].data == b"40"
        assert list(store.snapshots("session:a", "other")) == []

    def test_a_snapshot_of_a_newer_fold_version_removes_the_older_versions(
        self, store: EventStore
    ) -> None:
        """A fold whose version changed (``f@v2``) never reads ``f@v1`` again: saving it
        deletes the stream's older versions of that fold, and nothing else (another
        fold, another stream, a newer version, a name that only looks versioned)."""

        def put(stream: str, name: str, version: int = 5) -> None:
            store.put_snapshot(
                Snapshot(stream=stream, name=name, version=version, position=1, data=b"x")
            )

        def versions(stream: str, name: str) -> list[int]:
            return [s.version for s in store.snapshots(stream, name)]

        for name in ("f@v1", "f@v9", "g@v1", "f@v1x", "ff@v1", "f"):
            put("session:a", name)
        put("session:b", "f@v1")
        put("session:a", "f@v10", 7)  # an upgraded process: 10 > 9 and 1, as numbers
        put("session:a", "f@v9", 8)  # one not upgraded yet keeps its own, and the newer
        for name, left in [
            ("f@v1", []),
            ("f@v9", [8]),
            ("f@v10", [7]),
            ("g@v1", [5]),
            ("f@v1x", [5]),
            ("ff@v1", [5]),
            ("f", [5]),
        ]:
            assert versions("session:a", name) == left, name
        assert versions("session:b", "f@v1") == [5]

    def test_a_snapshot_name_that_cannot_be_stored_is_refused(self, store: EventStore) -> None:
        """The longest stream id and snapshot name fit one key; a longer name, a NUL or an
        empty name is a typed error on save (LMDB's 511-byte key limit raised from its
        writer before), and has no snapshots to read."""
        longest = Snapshot(
            stream="s" * MAX_STREAM_BYTES,
            name="n" * MAX_SNAPSHOT_NAME_BYTES,
            version=1,
            position=1,
            data=b"1",
        )
        store.put_snapshot(longest)
        assert [s.version for s in store.snapshots(longest.stream, longest.name)] == [1]
        for name in ("n" * (MAX_SNAPSHOT_NAME_BYTES + 1), "a\x00b", ""):
            with pytest.raises(InvalidStreamError, match="snapshot name"):
                store.put_snapshot(msgspec.structs.replace(longest, name=name))
            assert list(store.snapshots(longest.stream, name)) == []

    # -- durability and lifecycle ---------------------------------------------------------------

    def test_events_survive_reopen(self, store: EventStore) -> None:
        written = store.append("session:a", [SessionCreated(), TurnStarted(turn_id="t")])
        store.close()
        again = self.reopen()
        try:
            assert list(again.read_all()) == written
            assert again.stream_version("session:a") == 2
            more = again.append("session:a", [msg(1)], expected_version=2)
            assert more[0].position == 3
        finally:
            again.close()

    def test_closed_store_refuses_calls(self, store: EventStore) -> None:
        store.close()
        with pytest.raises(StoreClosedError):
            store.append("s:1", [msg(1)])
        with pytest.raises(StoreClosedError):
            list(store.read_all())
        store.close()  # closing twice is harmless
