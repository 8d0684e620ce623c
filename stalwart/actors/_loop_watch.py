"""Says when something blocks the I/O loop, and where.

Every network call of a runtime runs on the portal's one event loop, so a channel or an
async tool that makes a synchronous call there (a blocking SDK inside ``async def``)
holds up every model call, send and tool of every session until it returns. Nothing
fails, and nothing says why. The watch hands the loop a beat every ``every_s`` on the
runtime's Clock; when a beat has waited ``after_s`` and as many checks found it waiting, it
logs ``io.loop_blocked`` once, with the code the loop thread is running (file, line and
function of its innermost frames: code locations only, never values), and
``io.loop_unblocked`` with the whole wait once the loop takes the beat.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import traceback

from stalwart._logs import get_logger
from stalwart.clock import Clock

from ._portal import IoPortal
from ._scheduler import Scheduler, TimerHandle

__all__ = ["LoopWatch"]

log = get_logger(__name__)

#: How many of the loop thread's innermost frames a warning names.
FRAMES = 4


class LoopWatch:
    """Watches one portal's loop; ``start()`` arms it, ``stop()`` disarms it."""

    def __init__(
        self,
        portal: IoPortal,
        scheduler: Scheduler,
        clock: Clock,
        *,
        every_s: float = 1.0,
        after_s: float = 5.0,
    ) -> None:
        if every_s <= 0 or after_s < every_s:
            raise ValueError(f"expected 0 < every_s <= after_s, got {every_s} and {after_s}")
        self._portal = portal
        self._scheduler = scheduler
        self._clock = clock
        self._every_s = every_s
        self._after_s = after_s
        #: checks that must find a beat waiting, as many as ``after_s`` holds: a clock
        #: that jumps (a FakeClock) is not taken for a loop that waited
        self._checks_needed = max(2, math.floor(after_s / every_s))
        self._lock = threading.Lock()
        self._timer: TimerHandle | None = None
        self._sent_at: float | None = None  # the beat waiting for the loop, if any
        self._checks = 0  # how many checks found it waiting
        self._warned = False
        #: counts starts: a check armed before a stop (and already firing as it came)
        #: must not go on beside the checks of the next start
        self._generation = 0

    def start(self) -> LoopWatch:
        """Hand the loop its first beat now, and check every ``every_s``."""
        now = self._clock.now()
        with self._lock:
            if self._timer is not None:
                return self
            self._generation += 1
            self._timer = self._arm(now + self._every_s)
            self._sent_at, self._checks, self._warned = now, 0, False
        self._send_beat()
        return self

    def _arm(self, at: float) -> TimerHandle:
        return self._scheduler.schedule(at, functools.partial(self._check, self._generation))

    def stop(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
            self._sent_at = None
        if timer is not None:
            timer.cancel()

    def _check(self, generation: int, at: float) -> None:
        """On the scheduler's thread: beat, or say the last beat is still waiting."""
        with self._lock:
            if self._timer is None or generation != self._generation:
                return  # stopped, or a check of an earlier start
            self._timer = self._arm(at + self._every_s)
            sent_at = self._sent_at
            blocked: float | None = None  # how long the beat has waited, to say it
            if sent_at is None:
                self._sent_at, self._checks = at, 0
            else:
                self._checks += 1
                if (
                    not self._warned
                    and self._checks >= self._checks_needed
                    and at - sent_at >= self._after_s
                ):
                    self._warned = True
                    blocked = at - sent_at
        if sent_at is None:
            self._send_beat()
        elif blocked is not None:
            log.warning("io.loop_blocked", blocked_s=round(blocked, 3), where=self._where())

    def _send_beat(self) -> None:
        if not self._portal.call_soon(self._beat):
            with self._lock:
                self._sent_at = None  # the portal stopped: nothing to watch

    def _beat(self) -> None:
        """On the loop: the beat got through."""
        now = self._clock.now()
        with self._lock:
            sent_at, self._sent_at = self._sent_at, None
            warned, self._warned = self._warned, False
        if warned and sent_at is not None:
            log.warning("io.loop_unblocked", blocked_s=round(now - sent_at, 3))

    def _where(self) -> list[str]:
        """The loop thread's innermost frames, innermost last: ``file:line in function``."""
        ident = self._portal.thread_ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return []
        stack = traceback.extract_stack(frame)[-FRAMES:]
        return [f"{entry.filename}:{entry.lineno} in {entry.name}" for entry in stack]
