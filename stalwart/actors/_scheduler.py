"""The scheduler: the one component that turns deadlines into messages.

Actors compute deadlines with the pure functions of :mod:`stalwart.state`
(``watchdog_deadline``, ``ghost_deadline``, ``suspicious_at``, ``health_deadline``,
``next_retry_at``, ``expiry_at``) and hand them here with a cheap callback, usually a
closure over ``actor_ref.tell``. When the deadline comes, the callback is called with the
time it fired at, and the actor folds, decides and appends as for any other message.

Deadlines are unix seconds in the time base of the scheduler's :class:`Clock` (``now()``).

Two ways to run, chosen by the clock:

* a clock with ``on_advance`` (:class:`~stalwart.clock.FakeClock`): every due timer fires
  synchronously inside ``advance()``, in deadline order (ties in scheduling order), so
  ``clock.advance(600)`` fires a ten-minute watchdog in microseconds. A timer scheduled
  for a time the clock has already reached fires at once on a small helper thread, as
  it would with a real clock: an actor that read ``now()`` just before another thread
  advanced the clock, and armed its timer just after, is not left waiting for an
  advance that may never come;
* any other clock (:class:`~stalwart.clock.SystemClock`): one daemon thread waits on a
  condition until the earliest deadline and is woken when an earlier timer arrives, a
  timer is cancelled, or the scheduler stops. It never busy-waits.

Timers live in a heap of ``(deadline, seq, handle)``; a cancelled or replaced timer stays
in the heap, marked dead, until it reaches the top or the heap is compacted, so
``schedule`` and ``cancel`` are O(log n) and O(1).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Literal, Protocol, Self, runtime_checkable

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock

log = get_logger(__name__)

Callback = Callable[[float], object]
TimerState = Literal["pending", "fired", "cancelled"]

#: How many of the most recent lateness samples ``stats()`` computes percentiles over.
DEFAULT_LATENESS_WINDOW = 10_000

#: The longest the thread waits before it reads the clock again with timers pending, so a
#: wall clock that jumps forward (NTP, suspend) fires what it passed this late at most (one
#: stepped back delays every deadline by the step: deadlines are wall-clock times).
MAX_WAIT_S = 1.0

_COMPACT_MIN = 64  # never compact a heap with fewer dead entries than this


def _dropped(at: float) -> None:
    """A cancelled timer's callback: what it held is let go before its entry leaves."""


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@runtime_checkable
class _AdvancingClock(Protocol):
    """A clock that moves by hand and tells listeners (``FakeClock``)."""

    def now(self) -> float: ...

    def on_advance(self, callback: Callable[[float], None]) -> None: ...


class TimerHandle:
    """One scheduled timer: its deadline, its key, and whether it is still pending."""

    __slots__ = ("_callback", "_scheduler", "deadline", "key", "state")

    def __init__(
        self,
        scheduler: Scheduler,
        deadline: float,
        callback: Callback,
        key: Hashable | None,
    ) -> None:
        self._scheduler = scheduler
        self._callback = callback
        self.deadline = deadline
        self.key = key
        self.state: TimerState = "pending"

    @property
    def active(self) -> bool:
        """True until the timer fires or is cancelled (or replaced by its key)."""
        return self.state == "pending"

    def cancel(self) -> bool:
        """Cancel this timer; False when it already fired or was cancelled."""
        return self._scheduler.cancel(self)

    def __repr__(self) -> str:
        return f"TimerHandle(deadline={self.deadline!r}, key={self.key!r}, state={self.state!r})"


class SchedulerStats(msgspec.Struct, frozen=True):
    """How the scheduler kept its deadlines.

    ``fired`` and ``failed`` (callbacks that raised) count every timer since the start;
    ``p50_ms`` and ``p99_ms`` are the lateness (fired_at - deadline) over the last
    ``samples`` timers fired; ``max_ms`` is the worst lateness ever seen.
    """

    fired: int
    failed: int
    pending: int
    samples: int
    p50_ms: float
    p99_ms: float
    max_ms: float


def _percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


class Scheduler:
    """Turns deadlines (from a :class:`Clock`) into callbacks.

    Nothing fires before :meth:`start` or after :meth:`stop`; timers scheduled meanwhile
    wait. A timer whose deadline has passed fires at once (with a fake clock: on the
    helper thread, or inside the next ``advance()`` if that comes first). Callbacks run
    on the scheduler's thread (or inside ``advance()``), one at a time, and must be
    cheap; one that raises is logged and the scheduler carries on.
    """

    def __init__(self, clock: Clock, *, lateness_window: int = DEFAULT_LATENESS_WINDOW) -> None:
        if lateness_window < 1:
            raise ValueError(f"lateness_window must be at least 1, got {lateness_window}")
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._keys: dict[Hashable, TimerHandle] = {}
        self._live = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self._manual = clock if isinstance(clock, _AdvancingClock) else None
        self._listening = False
        self._overdue = False  # fake clock: a timer was scheduled at or before now()
        self._firing = threading.RLock()  # serializes firing inside advance()
        self._lateness: deque[float] = deque(maxlen=lateness_window)
        self._fired = 0
        self._failed = 0
        self._max_late = 0.0

    # -- timers ----------------------------------------------------------------------------

    def schedule(
        self, when: float, callback: Callback, *, key: Hashable | None = None
    ) -> TimerHandle:
        """Call ``callback(fired_at)`` at ``when`` (unix seconds on the scheduler's clock).

        With a ``key``, a pending timer of the same key is replaced (its deadline and its
        callback), so re-arming a watchdog leaves exactly one timer.
        """
        if not math.isfinite(when):
            raise ValueError(f"a deadline must be a finite number of seconds, got {when!r}")
        handle = TimerHandle(self, when, callback, key)
        with self._cond:
            if key is not None:
                old = self._keys.get(key)
                if old is not None:
                    self._retire(old)
                self._keys[key] = handle
            heapq.heappush(self._heap, (when, next(self._seq), handle))
            self._live += 1
            if self._manual is not None and when <= self._manual.now():
                self._overdue = True
                self._cond.notify_all()
            elif self._heap[0][2] is handle:
                self._cond.notify()
        return handle

    def cancel(self, handle_or_key: TimerHandle | Hashable) -> bool:
        """Cancel a pending timer by handle or by key; False when there was none."""
        with self._cond:
            if isinstance(handle_or_key, TimerHandle):
                handle: TimerHandle | None = handle_or_key
            else:
                handle = self._keys.get(handle_or_key)
            if handle is None or handle._scheduler is not self or not handle.active:
                return False
            was_next = self._heap[0][2] is handle
            self._retire(handle)
            if handle.key is not None and self._keys.get(handle.key) is handle:
                del self._keys[handle.key]
            if was_next:
                self._cond.notify()
            return True

    def pending(self) -> int:
        """How many timers are waiting to fire."""
        with self._cond:
            return self._live

    def next_deadline(self) -> float | None:
        """The earliest pending deadline, or None when nothing is pending."""
        with self._cond:
            top = self._peek()
            return None if top is None else top.deadline

    def stats(self) -> SchedulerStats:
        """Counts and lateness percentiles (milliseconds) of the timers fired so far."""
        with self._cond:
            ordered = sorted(self._lateness)
            fired, failed, pending, worst = self._fired, self._failed, self._live, self._max_late
        return SchedulerStats(
            fired=fired,
            failed=failed,
            pending=pending,
            samples=len(ordered),
            p50_ms=_percentile(ordered, 0.50) * 1000,
            p99_ms=_percentile(ordered, 0.99) * 1000,
            max_ms=worst * 1000,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        """Begin firing timers: listen to a fake clock, or start the waiting thread."""
        with self._cond:
            if self._running:
                return self
            self._running = True
            if self._manual is not None:
                listen = not self._listening
                self._listening = True
                target, name = self._run_overdue, "stalwart-scheduler-overdue"
                # what fell due while stopped fires at once, as the real clock's thread does
                top = self._peek()
                if top is not None and top.deadline <= self._manual.now():
                    self._overdue = True
            else:
                listen = False
                target, name = self._run, "stalwart-scheduler"
            self._thread = threading.Thread(target=target, name=name, daemon=True)
            self._thread.start()
        if listen and self._manual is not None:
            self._manual.on_advance(self._on_advance)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop firing (pending timers are kept) and join the thread within ``timeout``.
        A manual scheduler leaves its clock's listeners: a clock shared by many runtimes
        (tests) neither calls nor keeps the stopped ones."""
        with self._cond:
            self._running = False
            thread, self._thread = self._thread, None
            unlisten = self._listening
            self._listening = False
            self._cond.notify_all()
        remove = getattr(self._manual, "remove_listener", None)  # FakeClock's
        if unlisten and remove is not None:
            remove(self._on_advance)
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            log.warning("scheduler.stop_timed_out", timeout_s=timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        mode = "manual" if self._manual is not None else "thread"
        return f"Scheduler({self._clock!r}, mode={mode}, pending={self._live})"

    # -- internals (callers hold self._cond unless said otherwise) ------------------------

    def _retire(self, handle: TimerHandle) -> None:
        """Mark a pending timer cancelled; its heap entry is dropped lazily, but not what
        its callback holds (an Agent's turn timer holds the Agent, which a passivated
        session must let go of at once)."""
        handle.state = "cancelled"
        handle._callback = _dropped
        self._live -= 1
        dead = len(self._heap) - self._live
        if dead > _COMPACT_MIN and dead > self._live:
            self._heap = [entry for entry in self._heap if entry[2].active]
            heapq.heapify(self._heap)

    def _peek(self) -> TimerHandle | None:
        """The earliest pending timer, dropping dead entries off the top."""
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _pop_due(self, now: float) -> tuple[TimerHandle, float] | None:
        """Take the earliest timer if it is due at ``now``, recording its lateness."""
        top = self._peek()
        if top is None or top.deadline > now:
            return None
        heapq.heappop(self._heap)
        top.state = "fired"
        self._live -= 1
        if top.key is not None and self._keys.get(top.key) is top:
            del self._keys[top.key]
        late = now - top.deadline
        self._lateness.append(late)
        self._fired += 1
        self._max_late = max(self._max_late, late)
        return top, now

    def _call(self, handle: TimerHandle, fired_at: float) -> None:
        """Run one callback (without the lock); log and count one that raises, whatever
        it raises (``sys.exit()``, an asyncio ``CancelledError``): raised through, it
        would end the thread, and every later timer would wait for ever."""
        try:
            handle._callback(fired_at)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and _on_main_thread():
                raise  # Ctrl-C during an advance(): the host's, not the callback's
            with self._cond:
                self._failed += 1
            log.exception(
                "scheduler.callback_failed",
                callback=getattr(handle._callback, "__qualname__", type(handle._callback).__name__),
                key=repr(handle.key)[:120],
                deadline=handle.deadline,
                fired_at=fired_at,
            )

    def _on_advance(self, now: float) -> None:
        """FakeClock listener: fire everything due at ``now``, in deadline order."""
        with self._firing:
            while True:
                with self._cond:
                    due = self._pop_due(now) if self._running else None
                if due is None:
                    return
                self._call(*due)

    def _run(self) -> None:
        """The thread: wait for the earliest deadline, fire it, repeat until stopped."""
        while True:
            with self._cond:
                due = self._wait_due()
            if due is None:
                return
            self._call(*due)

    def _run_overdue(self) -> None:
        """The fake clock's helper thread: fire timers scheduled at or before ``now()``."""
        assert self._manual is not None
        while True:
            with self._cond:
                while self._running and not self._overdue:
                    self._cond.wait()
                if not self._running:
                    return
                self._overdue = False
            self._on_advance(self._manual.now())

    def _wait_due(self) -> tuple[TimerHandle, float] | None:
        """Block until a timer is due (and take it) or the scheduler stops (None)."""
        while self._running:
            top = self._peek()
            if top is None:
                self._cond.wait()
                continue
            now = self._clock.now()
            if top.deadline <= now:
                return self._pop_due(now)
            self._cond.wait(min(top.deadline - now, MAX_WAIT_S))
        return None
