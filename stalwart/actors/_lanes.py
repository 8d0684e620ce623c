"""Per-key lanes: one key's jobs run one at a time and in order, different keys side by
side, on at most ``workers`` threads, which the busy keys take in turns (a job each).

An actor whose work waits on the network for one key (a session's summarizer call)
hands it to a lane instead of running it in its mailbox, so the other keys go on. The
actor replies with the lane's future; the caller waits on that (:func:`answer`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pykka

from stalwart.clock import SystemClock

__all__ = ["Lanes", "Turnstile", "answer"]


def answer(ref: Any, message: object, timeout: float) -> Any:
    """Ask ``ref`` and wait, within ``timeout`` seconds in all, for the answer, also
    when the actor answers with a future (a lane's) rather than a value."""
    deadline = _WAITS.monotonic() + timeout
    reply = ref.ask(message, timeout=timeout)
    if isinstance(reply, pykka.Future):
        # the mailbox answered with the lane's future: the rest of the time is the lane's
        return reply.get(timeout=max(0.0, deadline - _WAITS.monotonic()))
    return reply


class Turnstile:
    """A lock one thread holds while it works, and lets go while it waits on something
    slow (``with turnstile.open(): call()``), so that another may work meanwhile."""

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> Turnstile:
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *_: object) -> None:
        self._owner = None
        self._lock.release()

    @contextmanager
    def open(self) -> Iterator[None]:
        """Let go for the block when this thread holds it (otherwise a no-op)."""
        me = threading.get_ident()
        if self._owner != me:
            yield
            return
        self._owner = None
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()
            self._owner = me


class Lanes:
    """Jobs by key. Safe to submit from any thread; :meth:`close` fails what has not
    started with ``pykka.ActorDeadError`` and takes no more."""

    def __init__(self, workers: int, *, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name)
        self._mutex = threading.Lock()
        self._queued: dict[Hashable, deque[tuple[Callable[[], Any], pykka.ThreadingFuture[Any]]]]
        self._queued = {}
        self._closed = False
        self._name = name

    def busy(self, key: Hashable) -> bool:
        """Whether ``key`` has a job queued or running."""
        return key in self._queued

    def submit(self, key: Hashable, job: Callable[[], Any]) -> pykka.ThreadingFuture[Any]:
        """Run ``job()`` after ``key``'s earlier jobs; its result (or exception) comes
        in the future returned."""
        reply: pykka.ThreadingFuture[Any] = pykka.ThreadingFuture()
        with self._mutex:
            if self._closed:
                reply.set_exception(exc_info=_dead(self._name))
                return reply
            lane = self._queued.get(key)
            if lane is not None:
                lane.append((job, reply))
                return reply
            self._queued[key] = deque([(job, reply)])
            self._pool.submit(self._drain, key)
        return reply

    def close(self) -> None:
        """Take no more jobs, fail those not started; a job running finishes."""
        with self._mutex:
            self._closed = True
            waiting = [item for lane in self._queued.values() for item in lane]
            for lane in self._queued.values():
                lane.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for _, reply in waiting:
            reply.set_exception(exc_info=_dead(self._name))

    def _drain(self, key: Hashable) -> None:
        """Run ``key``'s next job, then queue the lane again behind the keys waiting for a
        thread: a key whose jobs keep coming does not hold a thread while others wait."""
        with self._mutex:
            lane = self._queued[key]
            if not lane:  # closed meanwhile: its jobs were failed
                del self._queued[key]
                return
            # the key stays busy while its job runs: the lane goes only once empty
            job, reply = lane.popleft()
        try:
            result = job()
        except BaseException as exc:
            reply.set_exception(exc_info=(type(exc), exc, exc.__traceback__))
        else:
            reply.set(result)
        with self._mutex:
            if lane and not self._closed:
                self._pool.submit(self._drain, key)
            else:
                del self._queued[key]


#: a wait's real time (a fake clock cannot bound a thread's wait)
_WAITS = SystemClock()


def _dead(name: str) -> tuple[type[BaseException], BaseException, None]:
    error = pykka.ActorDeadError(f"{name} stopped before handling the message")
    return (pykka.ActorDeadError, error, None)
