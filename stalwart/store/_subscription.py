"""A live feed over any EventStore: read what is there, wait for more, never skip.

A store that cannot be reached for a while (a database restart, a failover: the store
raises :class:`~stalwart.errors.StoreUnavailableError`) is waited out: the feed logs it
once, keeps looking at the store's pace, and carries on from the next position it had
not returned, so nothing is skipped or repeated across the outage."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stalwart._logs import get_logger
from stalwart.clock import SystemClock
from stalwart.errors import CorruptRecordError, StoreUnavailableError
from stalwart.events import RecordedEvent

if TYPE_CHECKING:
    from ._protocol import EventStore

log = get_logger(__name__)

_WAIT_SLICE = 0.25
#: a feed's waits are on the network's time, not the runtime's Clock
_REAL_TIME = SystemClock()


def deadline_after(timeout: float | None) -> float | None:
    """When a wait of ``timeout`` seconds from now ends, on the real monotonic clock."""
    return None if timeout is None else _REAL_TIME.monotonic() + timeout


def remaining(deadline: float | None, step: float) -> float | None:
    """How long the next wait may be (None when the deadline has passed)."""
    if deadline is None:
        return step
    left = deadline - _REAL_TIME.monotonic()
    if left <= 0:
        return None
    return min(step, left)


class Subscription:
    """Events from a position on, in order, blocking for new ones until closed.

    Positions have no gaps, so remembering the next position to read is enough to see
    every event exactly once. Iterate it, or call :meth:`poll` to wait with a timeout.
    """

    def __init__(self, store: EventStore, from_position: int = 1, batch: int = 1024) -> None:
        self._store = store
        self._next = max(1, from_position)
        self._batch = batch
        self._closed = threading.Event()
        self._failed: CorruptRecordError | None = None  # raised once the good ones are out
        self._unreachable = False  # the store could not be reached at the last look

    @property
    def position(self) -> int:
        """The position of the next event this subscription will return."""
        return self._next

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def poll(self, timeout: float | None = None) -> list[RecordedEvent]:
        """The next events, waiting up to ``timeout`` seconds (None: until some arrive).

        A record that cannot be read raises :class:`CorruptRecordError`, after every good
        record before it has been returned (by this call, then the next one raises).
        """
        if self._failed is not None:
            return self._read()  # raises it
        deadline = deadline_after(timeout)  # the store's own waits count too
        wait: float | None = 0.0  # first a look at what is there already
        while not self.closed and wait is not None:
            try:
                arrived = self._store.wait_for(self._next, wait) >= self._next
            except StoreUnavailableError as exc:
                self._lost(exc)
                self._closed.wait(wait)  # it may refuse at once: look again at this pace
                arrived = False
            else:
                self._reached()  # it answered, though there may be nothing new
            if arrived and (events := self._read()):
                return events
            wait = remaining(deadline, _WAIT_SLICE)
        return []

    def _read(self) -> list[RecordedEvent]:
        failed = self._failed
        if failed is not None:
            self._failed = None  # raised once: the next poll reads (and fails) again
            raise failed
        end = self._next + self._batch - 1
        events: list[RecordedEvent] = []
        try:
            events.extend(self._store.read_all(self._next, end))
        except CorruptRecordError as exc:
            if not events:
                raise
            self._failed = exc
        except StoreUnavailableError as exc:
            self._lost(exc)  # the events read before it are returned; the rest next time
        else:
            self._reached()
        if events:
            self._next = events[-1].position + 1
        return events

    def _reached(self) -> None:
        if self._unreachable:  # the outage is over, events or not
            self._unreachable = False
            log.info("subscription.store_reachable", position=self._next)

    def _lost(self, exc: StoreUnavailableError) -> None:
        if not self._unreachable:  # once per outage
            self._unreachable = True
            log.warning("subscription.store_unreachable", position=self._next, error=str(exc))

    def __iter__(self) -> Iterator[RecordedEvent]:
        while not self.closed:
            yield from self.poll(None)

    def close(self) -> None:
        """Stop the feed; an iteration in another thread ends within a fraction of a second."""
        self._closed.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
