"""A database that goes away: a TCP relay in front of the test's PostgreSQL that a test
cuts (at once, or right after the server committed a marked request) and restores, a
store handle whose connections go through it, and a direct one beside it.

``tests/conftest.py`` imports the fixtures."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.errors import StoreError
from stalwart.store import EventStore, PostgresEventStore
from stalwart.testing import PostgresServer


def schema_of(pg_url: str) -> str:
    return pg_url.rsplit("schema=", 1)[1]


def reachable(store: EventStore) -> bool:
    """Whether ``store`` reaches its database (its pool has reconnected)."""
    try:
        store.head()
    except StoreError:
        return False
    return True


@pytest.fixture
def pg_store(pg_url: str, clock: FakeClock) -> Iterator[EventStore]:
    """A direct handle on the test's schema (the relay does not cut it)."""
    opened = store_module.open(pg_url, clock=clock)
    try:
        yield opened
    finally:
        opened.close()


class CuttingRelay:
    """A TCP relay in front of PostgreSQL. ``arm(marker)``: when a request holding
    ``marker`` has been answered by the server, that answer is dropped, every relayed
    connection is cut and new ones are refused until :meth:`restore` (a network
    partition that began right after the server committed)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._marker: bytes | None = None
        self._refusing = False
        self.cut = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()

    def arm(self, marker: bytes) -> None:
        self._marker = marker

    def cut_now(self) -> None:
        """Cut every relayed connection and refuse new ones (the database went away)."""
        with self._lock:
            self._refusing = True
        self._cut_all()

    def restore(self) -> None:
        with self._lock:
            self._refusing = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        self._cut_all()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing or self._closed
            if refusing:
                client.close()
                continue
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            pair = (client, server)
            with self._lock:  # a pair made as the relay closes is closed here, not leaked
                kept = not self._closed
                if kept:
                    self._pairs.append(pair)
            if not kept:
                client.close()
                server.close()
                return
            marked = threading.Event()
            threading.Thread(
                target=self._pump, args=(client, server, marked, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, marked, False), daemon=True
            ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, marked: threading.Event, up: bool
    ) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                marker = self._marker
                if up and marker is not None and marker in data:
                    marked.set()
                elif not up and marked.is_set():  # the server answered: it committed
                    self._marker = None
                    with self._lock:
                        self._refusing = True
                    self._cut_all()
                    self.cut.set()
                    return
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _cut_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()


@pytest.fixture
def relay(pg_server: PostgresServer) -> Iterator[CuttingRelay]:
    opened = CuttingRelay(pg_server.host, pg_server.port)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def relayed_store(
    pg_server: PostgresServer, pg_url: str, relay: CuttingRelay, clock: FakeClock
) -> Iterator[PostgresEventStore]:
    """A store handle on the test's schema whose connections go through ``relay`` (as
    another process's would)."""
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{relay.port}/")
    opened = PostgresEventStore(
        f"{url}?schema={schema_of(pg_url)}", clock=clock, connect_timeout=1.0
    )
    try:
        yield opened
    finally:
        opened.close()
