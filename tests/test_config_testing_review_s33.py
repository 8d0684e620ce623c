"""Review of the config loader's errors and the public testing kit (session 33).

Real parts only: the fake provider on 127.0.0.1 spoken to over raw sockets and
``http.client``, the fake provider and a PostgreSQL cluster in real subprocesses. A test
that proved a defect carries a ``# Was: DEFECT:`` line (each failed before its fix).
"""

from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from stalwart.clock import SystemClock
from stalwart.config import parse_config
from stalwart.errors import ConfigError
from stalwart.testing import FakeProvider

from ._postgres import require_postgres

GUARD = 10.0  # real seconds: a bound on what should take milliseconds
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
TOKEN = "T0S33REVIEW/B0S33/hook-token-s33"
PASSWORD = "pw-s33-review"


def _request() -> bytes:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n"
        "connection: close\r\n\r\n"
    )
    return (head + BODY).encode()


def _config_error(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value


def _until(condition: Any, what: str) -> None:
    clock = SystemClock()
    deadline = clock.monotonic() + GUARD
    while not condition():
        assert clock.monotonic() < deadline, what
        threading.Event().wait(0.05)  # real-time: polling a process outside this one


# -- the fake provider ----------------------------------------------------------------------


# Was: DEFECT: stop() left a kept-alive connection open, served by a thread that outlived it
def test_stop_closes_a_kept_alive_connection_and_serves_nothing_after_it() -> None:
    fake = FakeProvider().start()
    port = fake.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GUARD)  # real-time: a bound
    try:
        conn.request("POST", "/v1/chat/completions", BODY, {"content-type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        reply.read()
        assert not reply.will_close  # the connection is kept alive for the next request
        fake.stop()
        assert conn.sock is not None
        assert conn.sock.recv(1) == b""  # the stopped server closed it
    finally:
        conn.close()
        fake.stop()
    served = [t for t in threading.enumerate() if t.name.startswith(f"fake-provider:{port}")]
    assert served == []
    [record] = fake.requests
    assert record.outcome == "completed"


_FAKE_CHILD = textwrap.dedent(
    """
    import sys
    from stalwart.testing import FakeProvider
    fake = FakeProvider().start()
    print(fake.port, flush=True)
    sys.stdin.read()
    fake.stop()
    """
)


# Was: DEFECT: the fake provider queued 5 connections: a pool's burst of 64 stalled or was reset
def test_the_fake_provider_queues_a_whole_pool_of_connections_while_it_is_busy() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _FAKE_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    sockets: list[socket.socket] = []
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGSTOP)  # it accepts nothing now: the kernel queues
        for _ in range(64):  # a provider's default max_in_flight
            conn = socket.socket()
            conn.setblocking(False)
            conn.connect_ex(("127.0.0.1", port))
            sockets.append(conn)
        pending = list(sockets)

        def connected() -> bool:
            _, writable, _ = select.select([], pending, [], 0.05)
            for conn in writable:
                assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                pending.remove(conn)
            return not pending

        _until(connected, "connections beyond the listen backlog were never taken")
        os.kill(child.pid, signal.SIGCONT)
        for conn in sockets:
            conn.setblocking(True)
            conn.settimeout(GUARD)  # real-time: a bound on a reply on loopback
            conn.sendall(_request())
        for conn in sockets:
            assert conn.makefile("rb").readline().startswith(b"HTTP/1.1 200")
    finally:
        for conn in sockets:
            conn.close()
        os.kill(child.pid, signal.SIGCONT)
        child.communicate("", timeout=GUARD)


# -- the PostgreSQL helper -------------------------------------------------------------------


_PG_CHILD = textwrap.dedent(
    """
    from stalwart.testing import PostgresServer
    server = PostgresServer(fsync=False)
    pid = (server.data / "postmaster.pid").read_text().split()[0]
    print(server.root, pid, flush=True)
    raise RuntimeError("the test failed, and nobody stopped the server")
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Was: DEFECT: a PostgresServer its interpreter never stopped ran on, its directory left behind
def test_a_postgres_server_never_stopped_goes_with_its_interpreter(tmp_path: Path) -> None:
    require_postgres()
    done = subprocess.run(
        [sys.executable, "-c", _PG_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    root_text, pid_text = done.stdout.split()
    root, pid = Path(root_text), int(pid_text)
    try:
        assert done.returncode == 1
        assert "the test failed" in done.stderr
        _until(lambda: not _alive(pid), "the postmaster outlived the interpreter")
        assert not root.exists()
    finally:  # what the old code left behind
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            _until(lambda: not _alive(pid), "the leaked postmaster did not stop")
        shutil.rmtree(root, ignore_errors=True)


# -- config errors ---------------------------------------------------------------------------


_PASTED = {
    "channels.alerts.kind": {
        "channels": {"alerts": {"kind": f"https://hooks.slack.com/services/{TOKEN}"}}
    },
    "providers.main.kind": {
        "providers": {
            "main": {"kind": f"https://me:{PASSWORD}@gw.example/v1", "base_url": "http://x"}
        }
    },
    "context_engine.pipeline.default_tier": {
        "context_engine": {"pipeline": {"default_tier": f"https://me:{PASSWORD}@h/{TOKEN}"}}
    },
    "agents.a.fallback_models": {
        "providers": {"p": {"kind": "openai", "base_url": "http://x"}},
        "agents": {
            "a": {
                "provider": "p",
                "model": "m",
                "fallback_models": [f"https://me:{PASSWORD}@gw.example/{TOKEN}"],
            }
        },
    },
}


# Was: DEFECT: a URL in a field of fixed choices (kind...) was echoed whole, token and password
@pytest.mark.parametrize("key", list(_PASTED))
def test_a_url_pasted_into_a_field_of_choices_is_not_echoed(key: str) -> None:
    error = _config_error(_PASTED[key])
    assert error.key == key
    assert TOKEN not in str(error)
    assert PASSWORD not in str(error)
    assert "/..." in str(error)  # what was found, as its origin


# Was: DEFECT: a wrong item of a list was reported as "found None"
def test_a_wrong_item_in_a_list_is_shown_as_found() -> None:
    error = _config_error(
        {
            "providers": {"p": {"kind": "openai", "base_url": "http://x"}},
            "agents": {"a": {"provider": "p", "model": "m", "fallback_models": ["p:m", 42]}},
        }
    )
    assert error.key == "agents.a.fallback_models[1]"
    assert str(error).endswith("found 42")


# Was: DEFECT: a value that quoted a msgspec path ("at `$.x`") named that path as the key
def test_the_key_named_is_where_the_value_is_not_what_it_says() -> None:
    error = _config_error({"context_engine": {"version": "dag - at `$.store`"}})
    assert error.key == "context_engine.version"
    error = _config_error(  # the same inside the pipeline's own knobs
        {"context_engine": {"pipeline": {"default_tier": "x - at `$.history_turns`"}}}
    )
    assert error.key == "context_engine.pipeline.default_tier"
