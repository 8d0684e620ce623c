"""Rebuild a stream's state: newest valid snapshot, then the events after it."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import TypeVar

import msgspec

from stalwart._logs import get_logger
from stalwart.errors import CorruptRecordError, StoreError
from stalwart.events import UNREADABLE, RecordedEvent
from stalwart.state import Aggregate, batch_adder

from ._protocol import DEFAULT_SNAPSHOT_EVERY, EventStore, Snapshot
from ._records import record_batches

log = get_logger(__name__)

S = TypeVar("S")

_POSITION = attrgetter("position")

__all__ = ["DEFAULT_SNAPSHOT_EVERY", "load_state", "save_snapshot", "snapshot_name"]


def snapshot_name(aggregate: Aggregate[S]) -> str:
    """Snapshots are keyed by fold name and version: a changed fold ignores old ones."""
    return f"{aggregate.name}@v{aggregate.version}"


def read_readable(
    store: EventStore,
    stream: str,
    from_version: int = 1,
    *,
    unreadable: Callable[[int, CorruptRecordError], object] | None = None,
) -> Iterator[RecordedEvent]:
    """``stream``'s records from ``from_version`` on, passing over each one that cannot be
    read (``unreadable(version, error)`` hears of it): for a fold whose state is worth
    more than the damaged record, such as a provider's breaker or the dead-letter queue.
    A reader that must not guess past damage uses ``read_stream``."""
    for batch in _readable_batches(store, stream, from_version, unreadable):
        yield from batch


def _readable_batches(
    store: EventStore,
    stream: str,
    from_version: int,
    unreadable: Callable[[int, CorruptRecordError], object] | None,
) -> Iterator[Sequence[RecordedEvent]]:
    """:func:`read_readable` in the store's batches (see :func:`record_batches`)."""
    version = from_version
    while True:
        try:
            for batch in record_batches(store.read_stream(stream, version)):
                if batch:
                    version = batch[-1].version + 1
                    yield batch
            return
        except CorruptRecordError as exc:  # the record holding ``version``: the next one on
            if unreadable is not None:
                unreadable(version, exc)
            version += 1


class Passed(msgspec.Struct, frozen=True):
    """What a read of the log passed over: the record at ``position`` that cannot be read,
    or the run ``position..through`` of missing ones, and the store's ``error``."""

    position: int
    through: int
    error: CorruptRecordError


def read_all_passing(
    store: EventStore, from_position: int = 1, until_position: int | None = None
) -> Iterator[RecordedEvent | Passed]:
    """The log from ``from_position`` (to ``until_position``), each record that cannot be
    read in its place as a :class:`Passed` (a run of missing records as one, read on
    after its end in one step, ``CorruptRecordError.through``)."""
    position = from_position
    while True:
        try:
            for record in store.read_all(position, until_position):
                position = record.position + 1
                yield record
            return
        except CorruptRecordError as exc:
            at = max(exc.position, position)
            through = max(exc.through, at)
            yield Passed(at, through, exc)
            position = through + 1


def read_all_readable(
    store: EventStore,
    from_position: int = 1,
    until_position: int | None = None,
    *,
    unreadable: Callable[[int, CorruptRecordError], object] | None = None,
) -> Iterator[RecordedEvent]:
    """The log from ``from_position`` (to ``until_position``), passing over each record
    that cannot be read (``unreadable(position, error)`` hears of it; of a run of missing
    records once, ``error.through`` its end): for a view that shows what it can and says
    what it could not."""
    for item in read_all_passing(store, from_position, until_position):
        if isinstance(item, Passed):
            if unreadable is not None:
                unreadable(item.position, item.error)
        else:
            yield item


def _until(
    batches: Iterable[Sequence[RecordedEvent]], position: int
) -> Iterator[Sequence[RecordedEvent]]:
    """One stream's ``batches`` up to ``position`` (its positions grow with its versions)."""
    for batch in batches:
        if batch and batch[-1].position > position:
            yield batch[: bisect_right(batch, position, key=_POSITION)]
            return
        yield batch


def _unreadable_logged(stream: str, fold: str) -> Callable[[int, CorruptRecordError], None]:
    def logged(version: int, exc: CorruptRecordError) -> None:
        log.error(
            "state.record_unreadable",
            stream=stream,
            fold=fold,
            version=version,
            position=exc.position,
        )

    return logged


def load_state(
    store: EventStore,
    stream: str,
    aggregate: Aggregate[S],
    *,
    until_position: int | None = None,
    snapshot_every: int | None = None,
    use_snapshots: bool = True,
    skip_unreadable: bool = False,
) -> S:
    """The state of ``stream`` (as of ``until_position`` when given).

    Starts from the newest snapshot that decodes (a corrupt one falls back to an older one
    or to the full fold) and folds the events after it. When ``snapshot_every`` (unless
    given, the store's ``snapshot_every`` attribute, see :func:`stalwart.store.open`,
    else 500) > 0 and
    the fold went that many events past the snapshot, a new snapshot is saved (never for
    a time-travel read with ``until_position``). A record that cannot be read raises
    ``CorruptRecordError``, or with ``skip_unreadable`` is logged (``state.record_unreadable``
    at ERROR) and folded past; such a load saves no snapshot (one past the damage would
    let a later load that does not skip fold past it in silence).
    """
    if snapshot_every is None:  # the store's cadence (not in the protocol: a third-party
        # store may not say, and gets the default)
        snapshot_every = getattr(store, "snapshot_every", DEFAULT_SNAPSHOT_EVERY)
    name = snapshot_name(aggregate)
    decoder = msgspec.msgpack.Decoder(aggregate.state_type)
    state: S = aggregate.initial(stream)
    base_version = 0
    if use_snapshots:
        for snapshot in store.snapshots(stream, name):
            if until_position is not None and snapshot.position > until_position:
                continue
            try:
                state = decoder.decode(snapshot.data)
            except UNREADABLE as exc:
                log.warning(
                    "state.snapshot_unusable",
                    stream=stream,
                    fold=name,
                    version=snapshot.version,
                    reason=str(exc),
                )
                continue
            base_version = snapshot.version
            break
    folder = aggregate.folder(state)
    add_all = batch_adder(folder)
    last_version, last_position = base_version, 0
    batches: Iterable[Sequence[RecordedEvent]]
    skipped: list[int] = []  # the versions a skipping load folded past
    if skip_unreadable:
        logged = _unreadable_logged(stream, name)

        def unreadable(version: int, exc: CorruptRecordError) -> None:
            skipped.append(version)
            logged(version, exc)

        batches = _readable_batches(store, stream, base_version + 1, unreadable)
    else:
        batches = record_batches(store.read_stream(stream, base_version + 1))
    if until_position is not None:
        batches = _until(batches, until_position)
    for batch in batches:
        if batch:
            add_all(batch)
            last_version, last_position = batch[-1].version, batch[-1].position
    state = folder.state()
    if (
        snapshot_every > 0
        and until_position is None
        and not skipped  # a load that does not skip must still meet the damage
        and last_version - base_version >= snapshot_every
    ):
        save_snapshot(store, stream, name, last_version, last_position, state)
    return state


def save_snapshot(
    store: EventStore, stream: str, name: str, version: int, position: int, state: object
) -> bool:
    """Save ``state`` as ``stream``'s snapshot ``name`` at ``version`` / ``position``;
    False (logged ``state.snapshot_not_saved``) when the store refuses it: a snapshot only
    saves time, the state is still right."""
    snapshot = Snapshot(
        stream=stream,
        name=name,
        version=version,
        position=position,
        data=msgspec.msgpack.encode(state),
    )
    try:
        store.put_snapshot(snapshot)
    except StoreError as exc:
        log.warning(
            "state.snapshot_not_saved",
            stream=stream,
            fold=name,
            version=version,
            error=type(exc).__name__,
        )
        return False
    return True
