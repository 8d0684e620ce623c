"""The jobs many threads hand to one writer thread, which takes them in batches.

A queue wakes its reader for every item put while it waits; a writer that lingers for
the appenders its last commit answered would then wake once per appender, and each wake
is a trip through the GIL that the appenders themselves wait for. The inbox wakes the
writer once: when as many jobs wait as it asked for, when it closes, or when the writer's
own timeout passes.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

_J = TypeVar("_J")


class Inbox(Generic[_J]):
    """Jobs for one taker thread. Safe to put from any number of threads."""

    __slots__ = ("_bell", "_closed", "_jobs", "_mutex", "_want")

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._bell = threading.Lock()  # held while nobody has rung it
        self._bell.acquire()
        self._jobs: list[_J] = []
        self._want = 0  # while the taker sleeps: how many jobs wake it
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: _J) -> bool:
        """Hand in a job; False (and the job is not taken) once the inbox is closed."""
        with self._mutex:
            if self._closed:
                return False
            jobs = self._jobs
            jobs.append(job)
            if self._want and len(jobs) >= self._want:
                self._want = 0
                self._bell.release()
        return True

    def close(self) -> None:
        """Take no more jobs; the taker gets those already in, then nothing."""
        with self._mutex:
            self._closed = True
            if self._want:
                self._want = 0
                self._bell.release()

    def take(self, want: int = 1, timeout: float | None = None) -> list[_J]:
        """Every job waiting, once at least ``want`` wait (or the inbox closes, or
        ``timeout`` seconds pass: then possibly fewer, or none)."""
        with self._mutex:
            if len(self._jobs) < max(want, 1) and not self._closed:
                # a ring that came as the last wait timed out would end this one at once
                self._bell.acquire(blocking=False)
                self._want = max(want, 1)
                wait = True
            else:
                wait = False
        if wait:
            self._bell.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        with self._mutex:
            self._want = 0
            jobs, self._jobs = self._jobs, []
        return jobs
