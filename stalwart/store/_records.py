"""What a store's read returns: its records one by one, or in the batches it read them in.

Both stores read in batches (one LMDB read transaction, one SQL query) and decode each
batch in one C-level pass. A caller iterating record by record gets a plain generator
over those batches. A fold (``load_state``) asks for the batches themselves and folds a
whole one per call, instead of paying a generator step and a method call per record.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence

from stalwart.events import RecordedEvent

Batches = Generator[list[RecordedEvent], None, None]


def _flat(batches: Iterable[list[RecordedEvent]]) -> Iterator[RecordedEvent]:
    for batch in batches:
        yield from batch


class Records(Iterator[RecordedEvent]):
    """The records of one read, lazily: nothing is read until the first record (or
    batch) is asked for, and an error (``CorruptRecordError``) comes after every good
    record before it, as from a generator.

    Iterate it for records, or call :meth:`batches` once, before iterating, for lists of
    records in order (possibly empty ones). Not both.
    """

    __slots__ = ("_batches", "_flat")

    def __init__(self, batches: Batches) -> None:
        self._batches = batches
        self._flat: Iterator[RecordedEvent] | None = None

    def __iter__(self) -> Iterator[RecordedEvent]:
        # the flat generator itself, so a ``for`` loop steps it in C, not through __next__
        flat = self._flat
        if flat is None:
            flat = self._flat = _flat(self._batches)
        return flat

    def __next__(self) -> RecordedEvent:
        return next(iter(self))

    def batches(self) -> Batches:
        """The records in the store's batches (lists, in order, some possibly empty)."""
        if self._flat is not None:
            raise RuntimeError("these records are already being read one by one")
        return self._batches

    def close(self) -> None:
        """Stop reading, as a generator's ``close``."""
        self._batches.close()


def record_batches(records: Iterable[RecordedEvent]) -> Iterable[Sequence[RecordedEvent]]:
    """``records`` in batches: a store's own when it read them as :class:`Records`
    (the built-in stores do), else one record at a time (a store of another make, or
    one wrapped by a caller, is read exactly as it yields)."""
    if isinstance(records, Records):
        return records.batches()
    return ((record,) for record in records)
