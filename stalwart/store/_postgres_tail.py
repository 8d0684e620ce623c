"""The doorbell of tailing readers: LISTEN/NOTIFY, with polling as the truth.

A daemon thread holds one connection that LISTENs on the store's channel; every append
NOTIFYs it on commit, and the thread rings the bell (a counter under a condition) so
waiting readers look at ``head`` at once. The bell only says "look now": a reader always
reads ``head`` from the database and also looks every poll interval, so a notification
lost while the listener was down (a killed connection, a restart) delays a reader by at
most one interval and never loses an event. A lost connection is reopened with backoff.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import structlog
from psycopg import sql

from stalwart.clock import SystemClock

log = structlog.get_logger(__name__)

_LISTEN_SLICE = 0.2
_RETRY_FIRST = 0.05
_RETRY_MAX = 2.0
_REAL_TIME = SystemClock()


class Doorbell:
    """Rings when this process appends, or when a NOTIFY on ``channel`` arrives."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channel: str) -> None:
        self._connect = connect
        self._channel = channel
        self.rung = threading.Condition()
        self.count = 0
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._start_lock = threading.Lock()

    def ring(self) -> None:
        with self.rung:
            self.count += 1
            self.rung.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds unless the bell rang since ``seen`` was read."""
        with self.rung:
            if self.count == seen and not self._stop.is_set():
                self.rung.wait(timeout)

    def start(self, ready_within: float = 1.0) -> None:
        """Start listening (once); wait briefly for LISTEN to be in place."""
        with self._start_lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="stalwart-pg-listener", daemon=True
                )
                self._thread.start()
        self.listening.wait(ready_within)

    def _run(self) -> None:
        retry = _RETRY_FIRST
        while not self._stop.is_set():
            try:
                self._listen()
                retry = _RETRY_FIRST
            except (psycopg.Error, OSError) as exc:
                self.listening.clear()
                if self._stop.is_set():
                    return
                log.warning("store.listener_lost", channel=self._channel, error=type(exc).__name__)
                self.ring()  # readers fall back to polling; let them look now
                self._stop.wait(retry)
                retry = min(retry * 2, _RETRY_MAX)
            except Exception as exc:  # the StoreError of a failed reconnect
                self.listening.clear()
                log.warning("store.listener_lost", channel=self._channel, error=type(exc).__name__)
                self._stop.wait(retry)
                retry = min(retry * 2, _RETRY_MAX)
            finally:
                self._close_conn()

    def _listen(self) -> None:
        conn = self._connect()
        self._conn = conn
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
        self.listening.set()
        self.ring()  # anything appended before LISTEN took hold is seen by the next look
        while not self._stop.is_set():
            for _ in conn.notifies(timeout=_LISTEN_SLICE):
                self.ring()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self.listening.clear()
        self.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_LISTEN_SLICE * 5)

    @property
    def alive(self) -> bool:
        return self.listening.is_set()


def remaining(deadline: float | None, step: float) -> float | None:
    """How long the next wait may be (None when the deadline has passed)."""
    if deadline is None:
        return step
    left = deadline - _REAL_TIME.monotonic()
    if left <= 0:
        return None
    return min(step, left)


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else _REAL_TIME.monotonic() + timeout
