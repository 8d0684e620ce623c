"""What a fold is: an initial state, a pure ``apply(state, record) -> state``, and a folder.

A *folder* is the same fold as a mutable accumulator: ``aggregate.folder(state)`` returns
an object whose ``add(record)`` takes events one by one and whose ``state()`` gives the
frozen state, equal to applying each record in turn. Replaying a million events through a
folder avoids building a new frozen state per event; ``apply`` stays the pure,
one-event interface. Nothing escapes a folder but frozen states, so folds stay pure.

A folder may also have ``add_all(records)``, the same as ``add`` of each record in turn,
for a fold that can take a store's batch in one loop (see :func:`batch_adder`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from stalwart.events import Event, RecordedEvent

S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)


class Folder(Protocol[S_co]):
    """A fold in progress."""

    def add(self, record: RecordedEvent) -> None:
        """Fold one more event in."""
        ...

    def state(self) -> S_co:
        """The frozen state so far; folding may go on afterwards."""
        ...


class Aggregate(Protocol[S]):
    """A pure fold over one stream's events.

    ``name`` and ``version`` identify the fold and the shape of its state: a snapshot is
    only used by the fold (name and version) that wrote it. ``state_type`` is a msgspec
    Struct, so states encode for snapshots and print as JSON.
    """

    name: str
    version: int
    state_type: type[S]

    def initial(self, stream: str) -> S:
        """The state of a stream with no events."""
        ...

    def apply(self, state: S, record: RecordedEvent) -> S:
        """The state after one more event. Pure: no I/O, no clock, no randomness."""
        ...

    def folder(self, state: S) -> Folder[S]:
        """A folder starting at ``state``, equivalent to applying each record in turn."""
        ...


class ApplyFolder(Generic[S]):
    """The plain folder: ``apply`` per event (for folds with no faster one)."""

    __slots__ = ("_apply", "_state")

    def __init__(self, apply: Callable[[S, RecordedEvent], S], state: S) -> None:
        self._apply = apply
        self._state = state

    def add(self, record: RecordedEvent) -> None:
        self._state = self._apply(self._state, record)

    def state(self) -> S:
        return self._state


class FolderAggregate(Generic[S]):
    """An aggregate whose fold is a folder class: ``folder_type(state)`` folds records in,
    ``apply`` takes one record through a fresh one, and a stream with no events starts at
    ``state_type()``. ``moves``, when given, names the only event types that change the
    state (replay verification hands the folder no others)."""

    __slots__ = ("_folder_type", "moves", "name", "state_type", "version")

    def __init__(
        self,
        name: str,
        state_type: type[S],
        folder_type: Callable[[S], Folder[S]],
        *,
        version: int = 1,
        moves: frozenset[type[Event]] | None = None,
    ) -> None:
        self.moves = moves
        self.name = name
        self.version = version
        self.state_type = state_type
        self._folder_type = folder_type

    def initial(self, stream: str) -> S:
        return self.state_type()

    def apply(self, state: S, record: RecordedEvent) -> S:
        folder = self._folder_type(state)
        folder.add(record)
        return folder.state()

    def folder(self, state: S) -> Folder[S]:
        return self._folder_type(state)


def batch_adder(folder: Folder[Any]) -> Callable[[Sequence[RecordedEvent]], None]:
    """``folder.add_all`` when it has one, else a loop of ``folder.add``."""
    add_all: Callable[[Sequence[RecordedEvent]], None] | None = getattr(folder, "add_all", None)
    if add_all is not None:
        return add_all
    add = folder.add

    def each(records: Sequence[RecordedEvent]) -> None:
        for record in records:
            add(record)

    return each


def fold(
    aggregate: Aggregate[S], stream: str, records: Iterable[RecordedEvent], state: S | None = None
) -> S:
    """Fold ``records`` into ``state`` (or the aggregate's initial state)."""
    folder = aggregate.folder(aggregate.initial(stream) if state is None else state)
    add = folder.add
    for record in records:
        add(record)
    return folder.state()


def fold_streams(
    records: Iterable[RecordedEvent], aggregate_for: Callable[[str], Aggregate[Any]]
) -> dict[str, Any]:
    """Fold an interleaved log (``read_all``) into one state per stream."""
    folders: dict[str, Folder[Any]] = {}
    get = folders.get
    for record in records:
        folder = get(record.stream)
        if folder is None:
            aggregate = aggregate_for(record.stream)
            folder = folders[record.stream] = aggregate.folder(aggregate.initial(record.stream))
        folder.add(record)
    return {stream: folder.state() for stream, folder in folders.items()}
