"""The doorbell of tailing readers: LISTEN/NOTIFY, with the head polled as the truth.

Once something waits for new events, a daemon thread holds one connection that LISTENs
on the store's channel. Every append batch NOTIFYs it on commit; between notifications
the thread reads the head on the same connection every poll interval. Either way, when
there may be something new it rings the bell (a counter under a condition) and the
waiting readers read the head themselves. So a notification lost while nobody listened
delays readers by at most one poll interval and never loses an event, and however many
readers wait, one handle polls the database once per interval. While the listener is
down (a killed connection, a failover) the readers poll the head themselves at that
interval until it reconnects, with backoff. An outage is logged once
(``store.listener_lost``; each failed reconnect after it at debug level) and its end once
(``store.listener_back``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from stalwart._logs import get_logger

log = get_logger(__name__)

_RETRY_FIRST = 0.05
_RETRY_MAX = 2.0
#: How long a reader waits between its own looks at the head while the listener is up
#: (the listener's polling and notifications wake it sooner).
_SAFETY_WAIT = 1.0


class Doorbell:
    """Rings when this process appends, a NOTIFY arrives, or the polled head moves."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        channel: str,
        head_query: sql.Composed,
        poll_interval: float,
    ) -> None:
        self._connect = connect
        self._channel = channel
        self._head_query = head_query
        self.poll_interval = poll_interval
        self.rung = threading.Condition()
        self.count = 0
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._head = -1
        self._retry = _RETRY_FIRST
        self._down = False  # lost, and not listening again since (logged once)

    def ring(self) -> None:
        with self.rung:
            self.count += 1
            self.rung.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds unless the bell rang since ``seen`` was read."""
        with self.rung:
            if self.count == seen and not self._stop.is_set():
                self.rung.wait(timeout)

    def next_wait(self) -> float:
        """How long a reader may wait before it looks at the head itself."""
        return _SAFETY_WAIT if self.listening.is_set() else self.poll_interval

    def start(self, ready_within: float = 1.0) -> None:
        """Start listening (once); the first start waits up to ``ready_within`` for LISTEN
        to be in place. Later calls never wait: while the listener is down, readers poll
        the head themselves every poll interval."""
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name="stalwart-pg-listener", daemon=True
            )
            self._thread.start()
        self.listening.wait(ready_within)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # psycopg's, or the StoreError of a failed reconnect
                self.listening.clear()
                if self._stop.is_set():
                    return
                self._lost(exc)
                self.ring()  # readers poll for themselves now; let them look at once
                self._stop.wait(self._retry)
                self._retry = min(self._retry * 2, _RETRY_MAX)

    def _lost(self, exc: Exception) -> None:
        """Log the listener's loss once per outage: a warning at every failed reconnect
        (every 2 s) filled a worker's log for as long as the database was away."""
        level = log.debug if self._down else log.warning
        self._down = True
        level("store.listener_lost", channel=self._channel, error=type(exc).__name__)

    def _listening(self) -> None:
        self.listening.set()
        self._retry = _RETRY_FIRST  # a later loss is retried at once again
        if self._down:
            self._down = False
            log.info("store.listener_back", channel=self._channel)
        self.ring()  # whatever came before LISTEN took hold is seen by the next look

    def _listen(self) -> None:
        with contextlib.closing(self._connect()) as conn:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            self._listening()
            while not self._stop.is_set():
                for _ in conn.notifies(timeout=self.poll_interval):
                    self.ring()
                row = conn.execute(self._head_query).fetchone()
                if row is not None and row[0] != self._head:
                    self._head = row[0]
                    self.ring()

    def close(self) -> None:
        self._stop.set()
        self.listening.clear()
        self.ring()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.poll_interval * 5 + 1)
