"""Time, injected: the only module of stalwart that reads a clock.

``Clock.now()`` is wall time in unix seconds (what events carry); ``Clock.monotonic()``
measures intervals. ``FakeClock`` moves only when a test calls :meth:`FakeClock.advance`,
so a ten-minute deadline is tested in microseconds.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FakeClock", "SystemClock", "Timer"]


#: ``timer(seconds, expire)`` arms a deadline ``seconds`` from now on the caller's Clock
#: and returns what disarms it; ``expire`` must then be called on the event loop running
#: the call (the runtime's is a scheduler timer that submits it to its portal).
Timer = Callable[[float, Callable[[], object]], Callable[[], object]]


@runtime_checkable
class Clock(Protocol):
    """Where every part of stalwart gets the time from."""

    def now(self) -> float:
        """Wall-clock time in unix seconds."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin that never goes backwards."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock that only moves when told to; safe to share between threads.

    Callbacks registered with :meth:`on_advance` run after each advance, which is how a
    scheduler turns fake time into fired deadlines.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._mono = 0.0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[float], None]] = []

    def now(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backwards, and a finite amount: a
        ``nan`` made every later ``now()`` nan) and return the new now."""
        if not math.isfinite(seconds):
            raise ValueError(f"a clock advances by a finite number of seconds: advance({seconds})")
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards: advance({seconds})")
        with self._lock:
            self._now += seconds
            self._mono += seconds
            now = self._now
            listeners = list(self._listeners)
        for listener in listeners:
            listener(now)
        return now

    def set(self, now: float) -> None:
        """Jump wall time to ``now`` (which must not be in the past)."""
        with self._lock:
            current = self._now
        self.advance(now - current)

    def on_advance(self, callback: Callable[[float], None]) -> None:
        """Call ``callback(now)`` after every advance."""
        with self._lock:
            self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[float], None]) -> None:
        """Stop calling ``callback`` (one that :meth:`on_advance` registered; else nothing),
        so that a stopped scheduler is neither called nor kept alive by the clock."""
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now!r})"
