"""A thread that follows the store's head for an actor that folds a stream the other
processes on the store append to too (a provider's health, the dead-letter queue).

It waits on ``store.wait_for`` (no decoding) and calls ``moved()`` on its own thread each
time the head moved; ``moved`` tells the actor to read what is new (and may look at the
store first: an error it raises counts as the store out of reach). The head is captured
when the follower is made, before the actor's first fold, so nothing appended around
start-up is missed. A store out of reach is logged once (``<part>.follower_store_unreachable``)
and looked at again every :data:`UNREACHABLE_WAIT_S`; a closed store ends the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from stalwart._logs import get_logger
from stalwart.errors import StalwartError, StoreClosedError
from stalwart.store import EventStore

__all__ = ["FOLLOW_SLICE_S", "UNREACHABLE_WAIT_S", "HeadFollower"]

log = get_logger(__name__)

#: The longest the follower waits on the store before it checks whether it should stop.
FOLLOW_SLICE_S = 0.05
#: How long the follower waits before it looks again at a store it could not reach.
UNREACHABLE_WAIT_S = 0.5


class HeadFollower:
    """Calls ``moved()`` whenever the store's head moved (see the module); ``part`` names
    its log lines, ``pace_s`` is the least time between two calls (a busy store)."""

    def __init__(
        self,
        store: EventStore,
        moved: Callable[[], None],
        name: str,
        *,
        part: str,
        pace_s: float = 0.0,
    ) -> None:
        self._store = store
        self._moved = moved
        self._part = part
        self._pace_s = pace_s
        self._stop = threading.Event()
        start = store.head()  # before the actor's first fold: nothing falls in between
        self._thread = threading.Thread(target=self._run, args=(start,), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self, seen: int) -> None:
        unreachable = False
        while not self._stop.is_set():
            try:
                head = self._store.wait_for(seen + 1, FOLLOW_SLICE_S)
                if head > seen:
                    self._moved()
            except StoreClosedError:  # the store closed under us: nothing more to follow
                log.info(f"{self._part}.follower_stopped")
                return
            except StalwartError as exc:  # out of reach for now (a database down): wait it out
                if not unreachable:
                    log.warning(
                        f"{self._part}.follower_store_unreachable", error_class=type(exc).__name__
                    )
                unreachable = True
                self._stop.wait(UNREACHABLE_WAIT_S)
                continue
            if unreachable:
                log.info(f"{self._part}.follower_store_back")
                unreachable = False
            if head > seen:
                seen = head
                if self._pace_s:
                    self._stop.wait(self._pace_s)
