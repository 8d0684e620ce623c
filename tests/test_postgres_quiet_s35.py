"""Session 35 review of the PostgreSQL store: a connection that goes quiet.

A network path that drops every packet without closing anything (a partition, a firewall
or NAT that forgot the connection, a failed-over load balancer) left a read, an append
or the tail's listener waiting on libpq's defaults: no keepalive probe for 2 hours, and
unacknowledged data retried for about 15 minutes. Every connection the store opens now
carries TCP keepalives and ``tcp_user_timeout`` (``TCP_DEFAULTS``), unless its URL sets
its own.

The options are read back from the kernel, on this process's own sockets to the test's
real PostgreSQL; the partition is a real one: a store in a network namespace of its own
(``unshare``, no root needed) whose loopback route is turned into a black hole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from stalwart.clock import FakeClock
from stalwart.events import MessageAppended
from stalwart.store import Due, PostgresEventStore
from stalwart.testing import PostgresServer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads TCP options from /proc and Linux"
)

DEADLINE_S = 20.0
#: what the store sets on each of its connections by default (libpq's names), as the
#: kernel reports it: keepalives on, first probe after 10 s, then every 5 s, 4 probes,
#: unacknowledged data given up after 30 s
DEFAULTS = {"keepalive": 1, "idle": 10, "interval": 5, "count": 4, "user_timeout": 30000}


def _msg(n: int) -> MessageAppended:
    return MessageAppended(message_id=str(n), role="user", content="x")


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # real-time: waits on the store's listener thread to connect


def _options(sock: socket.socket) -> dict[str, int]:
    tcp = socket.IPPROTO_TCP
    return {
        "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "idle": sock.getsockopt(tcp, socket.TCP_KEEPIDLE),
        "interval": sock.getsockopt(tcp, socket.TCP_KEEPINTVL),
        "count": sock.getsockopt(tcp, socket.TCP_KEEPCNT),
        "user_timeout": sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT),
    }


def _sockets_to(port: int) -> dict[int, dict[str, int]]:
    """This process's TCP connections to ``port``: their local port -> their options."""
    found: dict[int, dict[str, int]] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            copy = os.dup(int(name))
            try:
                sock = socket.socket(fileno=copy)
            except OSError:
                os.close(copy)
                continue
            with sock:
                if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
                    found[sock.getsockname()[1]] = _options(sock)
    return found


def _names_of(server: PostgresServer, ports: set[int]) -> dict[int, str]:
    """The ``application_name`` of the server's sessions whose client port is in ``ports``."""
    with psycopg.connect(server.url("stalwart_test"), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT client_port, application_name FROM pg_stat_activity "
            "WHERE client_port = ANY(%s)",
            (list(ports),),
        ).fetchall()
    return dict(rows)


@contextlib.contextmanager
def _store_sockets(
    server: PostgresServer, url: str, clock: FakeClock
) -> Iterator[dict[str, list[dict[str, int]]]]:
    """A store on ``url`` that has used its pool (appends, reads, the due queue's claim)
    and its listener: the options of its connections, by ``application_name``."""
    before = set(_sockets_to(server.port))
    with PostgresEventStore(url, clock=clock) as store:
        store.append("session:1", [_msg(1)], expected_version=0, due=Due(clock.now()))
        work = store.claim_due("worker-1", now=clock.now() + 1, limit=8, hold_s=5.0)
        assert [claim.stream for claim in work.claimed] == ["session:1"]  # the due queue's
        store.wait_for(store.head() + 1, timeout=0.1)  # starts the listener

        def ours() -> dict[int, dict[str, int]]:
            return {p: o for p, o in _sockets_to(server.port).items() if p not in before}

        def both_kinds() -> bool:
            names = set(_names_of(server, set(ours())).values())
            return {"stalwart-quiet", "stalwart-listener"} <= names

        _until(both_kinds, "the listener's connection beside the pool's")
        sockets = ours()
        by_name: dict[str, list[dict[str, int]]] = {}
        for port, name in _names_of(server, set(sockets)).items():
            by_name.setdefault(name, []).append(sockets[port])
        yield by_name


def _quiet_url(pg_url: str, extra: str = "") -> str:
    return f"{pg_url}&application_name=stalwart-quiet{extra}"


# Was: DEFECT: no keepalives nor tcp_user_timeout: a silent peer hung reads, appends, the tail.
def test_every_connection_of_the_store_gives_up_a_silent_peer_within_30_s(
    pg_server: PostgresServer, pg_url: str, clock: FakeClock
) -> None:
    with _store_sockets(pg_server, _quiet_url(pg_url), clock) as by_name:
        pool, listener = by_name["stalwart-quiet"], by_name["stalwart-listener"]
        # the pool serves reads, appends and the due queue's claims
        assert pool
        assert listener
        assert all(options == DEFAULTS for options in pool), pool
        assert all(options == DEFAULTS for options in listener), listener


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        (
            "&keepalives_idle=42&keepalives_count=2&tcp_user_timeout=7000",
            {**DEFAULTS, "idle": 42, "count": 2, "user_timeout": 7000},
        ),
        # libpq sets tcp_user_timeout only with keepalives on: both are off (the system's
        # own probe timings are not looked at)
        ("&keepalives=0", {"keepalive": 0, "user_timeout": 0}),
    ],
    ids=["own-timings", "keepalives-off"],
)
def test_a_url_s_own_tcp_settings_win_over_the_store_s_defaults(
    pg_server: PostgresServer, pg_url: str, clock: FakeClock, own: str, expected: dict[str, int]
) -> None:
    with _store_sockets(pg_server, _quiet_url(pg_url, own), clock) as by_name:
        connections = by_name["stalwart-quiet"] + by_name["stalwart-listener"]
        for options in connections:
            assert {key: options[key] for key in expected} == expected


# -- a real silent partition ------------------------------------------------------------------
#
# The store runs in a child process with a network namespace of its own (``unshare
# -Urn``: an unprivileged user namespace). There it reaches PostgreSQL through a relay on
# the namespace's loopback, then over a Unix socket to a bridge in this process; the
# partition is an ``ip rule`` that sends every packet to 127.0.0.0/8 into a black hole, so
# the store's connections see neither an answer nor an acknowledgement nor a close. The
# URL keeps the bound small (1.5 s); with libpq's defaults the read below waited about
# 15 minutes, and with the store's defaults it gives up in about 30 to 60 s.

_CHILD = textwrap.dedent(
    """
    import contextlib, json, os, socket, subprocess, sys, threading, time
    import psycopg
    from stalwart.errors import AppendInDoubtError, StoreUnavailableError
    from stalwart.events import MessageAppended
    from stalwart.store import PostgresEventStore

    bridge, url, schema = sys.argv[1], sys.argv[2], sys.argv[3]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    relay = socket.create_server(("127.0.0.1", 0))

    def pump(source, sink):
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)

    def accept():
        while True:
            client, _ = relay.accept()
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(os.path.join(bridge, ".s.PGSQL.5432"))
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=pair, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    def direct(autocommit):
        return psycopg.connect(host=bridge, port=5432, dbname="stalwart_test",
                               user="stalwart", password="s3cret-test-pw", autocommit=autocommit)

    admin, locker = direct(True), direct(False)

    def until(condition):
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.02)  # real-time: waits on server sessions

    def sessions(where):
        return admin.execute("SELECT count(*) FROM pg_stat_activity WHERE " + where).fetchone()[0]

    def msg(n):
        return [MessageAppended(message_id=str(n), role="user", content="x")]

    def timed(work):
        began = time.monotonic()
        try:
            outcome = type(work()).__name__
        except Exception as exc:
            outcome = type(exc).__name__ + (
                " unavailable" if isinstance(exc, StoreUnavailableError) else "")
        return [outcome, time.monotonic() - began]

    found = {}
    store = PostgresEventStore(url.format(port=relay.getsockname()[1]), connect_timeout=1.0)
    store.append("s:1", msg(1))
    feed = store.subscribe(2)
    feed.poll(0.1)  # the listener starts
    until(lambda: sessions("application_name = 'stalwart-listener' "
                           f"AND query LIKE '%{schema}%'") > 0)
    # an append waits on the stream's row lock inside the server when the path goes quiet
    locker.execute(f'SELECT 1 FROM "{schema}".streams WHERE stream = %s FOR UPDATE', ("s:1",))
    appender = threading.Thread(target=lambda: found.update(append=timed(
        lambda: store.append("s:1", msg(2)))))
    appender.start()
    until(lambda: sessions("wait_event_type = 'Lock' AND application_name = 'quiet'") > 0)
    list(store.read_stream("s:1"))  # a second pooled connection, idle, looks alive
    subprocess.run("ip rule add pref 1 to 127.0.0.0/8 blackhole && ip rule del pref 0 "
                   "&& ip rule add pref 2 lookup local", shell=True, check=True)
    locker.commit()  # the append commits in the server; its answer never arrives
    found["read"] = timed(lambda: list(store.read_stream("s:1")))
    found["poll"] = timed(lambda: feed.poll(1.0))
    appender.join()
    subprocess.run("ip rule del pref 1", shell=True, check=True)  # the path is back
    got = admin.execute(f'SELECT version FROM "{schema}".events ORDER BY version')
    found["versions"] = [version for (version,) in got]
    events = []
    until(lambda: events.extend(feed.poll(0.2)) or [e.version for e in events] == [2])
    found["tail"] = [e.version for e in events]
    store.close()
    print(json.dumps(found))
    """
)


def _namespaces_work() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = ["unshare", "-Urn", "ip", "link", "set", "lo", "up"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0
    return False


class _Bridge:
    """A Unix socket in ``directory`` (named as libpq names a server's) relayed to TCP."""

    def __init__(self, directory: Path, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(str(directory / ".s.PGSQL.5432"))
        self._listener.listen()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="quiet-bridge").start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return
            self._open += [client, upstream]
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=pair, daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.mark.timeout(150)
def test_in_a_silent_partition_a_read_the_tail_and_an_append_end_within_the_bound(
    pg_server: PostgresServer, pg_url: str, tmp_path: Path
) -> None:
    if not _namespaces_work():
        pytest.skip("needs unshare and ip with unprivileged user and network namespaces")
    schema = pg_url.rsplit("schema=", 1)[1]
    PostgresEventStore(pg_url).close()  # the schema exists before the child opens it
    bridge = _Bridge(tmp_path, pg_server.host, pg_server.port)
    url = (
        "postgresql://stalwart:s3cret-test-pw@127.0.0.1:{port}/stalwart_test"
        f"?schema={schema}&application_name=quiet&keepalives_idle=1&keepalives_interval=1"
        "&keepalives_count=2&tcp_user_timeout=1500"
    )
    child = tmp_path / "child.py"
    child.write_text(_CHILD)
    try:
        done = subprocess.run(
            ["unshare", "-Urn", sys.executable, str(child), str(tmp_path), url, schema],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        bridge.close()
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    # a read on a connection gone quiet: tried again, then no connection (typed), in time
    outcome, took = found["read"]
    assert outcome.endswith(" unavailable"), found
    assert took < DEADLINE_S, found
    # the tail's wait ends in about its own time plus the bound, and finds nothing
    outcome, took = found["poll"]
    assert outcome == "list", found
    assert took < DEADLINE_S, found
    # the append committed but its answer was lost: in doubt, never said unwritten
    outcome, took = found["append"]
    assert outcome == "AppendInDoubtError", found
    assert took < DEADLINE_S, found
    assert found["versions"] == [1, 2]  # written once
    assert found["tail"] == [2]  # the tail carries on once the path is back
