"""A store outage waited out by an actor that serves the whole runtime.

The provider health actor and the dead-letter queue act on messages their timers and
followers tell them, and each reads or appends the log. While the store is away
(PostgreSQL restarting, a network partition), such a message would raise a StoreError
and kill the actor: a restart for each, what it held in memory lost (the queue's send
outcomes not yet recorded), and a store that came and went three times within the
restart window would have supervision give it up for good (no more outage detection,
no more dead-letter retries, and no one to tell). Instead the message is told again a
moment later, until the store answers; the outage is logged once, and its end.
A closed store (or a read-only one, a lost lease, a stream id no append takes) is no
outage: it ends the actor as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.errors import (
    FencedError,
    InvalidStreamError,
    StoreClosedError,
    StoreError,
    StoreReadOnlyError,
)

from ._scheduler import Scheduler

__all__ = ["StoreOutage"]

log = get_logger(__name__)

T = TypeVar("T")

#: Store errors no wait mends (a closed store, a read-only handle, a lease lost, a
#: stream id no append takes): raised, as before.
_FOR_GOOD = (StoreClosedError, StoreReadOnlyError, FencedError, InvalidStreamError)

#: How long a message whose handling the store failed waits to be told again.
STORE_RETRY_S = 1.0


class StoreOutage:
    """Runs an actor's handling of a message; on a store error, tells the message again
    in :data:`STORE_RETRY_S` (a scheduler timer on the runtime's clock) instead of
    raising. ``name`` prefixes the two log events (``<name>.store_unreachable``,
    ``<name>.store_back``)."""

    def __init__(
        self, name: str, scheduler: Scheduler, clock: Clock, tell: Callable[[Any], object]
    ) -> None:
        self._name = name
        self._scheduler = scheduler
        self._clock = clock
        self._tell = tell
        self.down = False

    def run(self, message: object, handle: Callable[[], T]) -> T | None:
        """``handle()``'s result, or None when the store failed it (``message`` is told
        again later)."""
        try:
            result = handle()
        except _FOR_GOOD:
            raise
        except StoreError as exc:
            if not self.down:  # the error's class only: its text may name the store's URL
                log.warning(f"{self._name}.store_unreachable", error_class=type(exc).__name__)
            self.down = True
            again = self._clock.now() + STORE_RETRY_S
            self._scheduler.schedule(again, lambda _at: self._tell(message))
            return None
        if self.down:
            log.info(f"{self._name}.store_back")
            self.down = False
        return result
