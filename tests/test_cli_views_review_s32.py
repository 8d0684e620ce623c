"""Review (session 32) of the operator's views: ``stalwart incidents``, ``watch``,
``activations``, ``status`` and ``session events``, against docs/cli.md.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against. Real parts
only: LMDB stores in temporary directories (damaged with the ``lmdb`` module while no
store of this process has them open), the PostgreSQL fixture behind a TCP relay on
127.0.0.1 that counts what the server sends, the real CLI in subprocesses (exit codes
and stderr as a user sees them; a pseudo-terminal for the live frame).
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    SessionCreated,
    SessionRequiresAction,
)
from stalwart.store import NewEvent
from stalwart.testing import PostgresServer
from tests._relay import schema_of
from tests.test_cli_read_review import (
    T0,
    append,
    assert_one_error_line,
    damage,
    position,
    stalwart,
)
from tests.test_cli_review_s31 import _with_reader_gone

_STALWART = (sys.executable, "-m", "stalwart")


def _failed(model: str = "gpt-4o") -> ProviderCallFailed:
    return ProviderCallFailed(provider="openai", model=model, agent="a", error_class="timeout")


def _succeeded(model: str = "gpt-4o") -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="openai", model=model, agent="a", latency_ms=10)


# -- the exit code when the reader goes away ---------------------------------------------------


# Was: DEFECT: `stalwart incidents | head` and `stalwart watch --once | head` exit 0 on damage.
def test_incidents_and_watch_exit_1_on_damage_when_the_reader_goes_away(
    store_dir: Path,
) -> None:
    """cli.md: a reader that goes away ends the output quietly, "exit code 0, or 1 when
    the command had already found something wrong"; the views exit 1 for a record they
    passed over. ``incidents`` and ``watch`` never said they had (only ``status`` did),
    so piped into ``head`` a damaged store read as a clean one."""
    append(store_dir, "provider:openai", _failed(), _succeeded(), _failed())
    append(store_dir, "session:s1", SessionCreated(title="t"), ts=T0 + 10)
    damage(store_dir, b"log", position(1))
    for args in (("incidents",), ("incidents", "--json"), ("watch", "--once")):
        assert stalwart(store_dir, *args)[0] == 1, args
        assert _with_reader_gone(store_dir, *args) == (1, ""), args
    # an intact store still exits 0 when the reader goes away
    clean = store_dir.parent / "clean"
    append(clean, "provider:openai", _failed())
    assert _with_reader_gone(clean, "incidents") == (0, "")
    assert _with_reader_gone(clean, "watch", "--once") == (0, "")


# -- activations --session ----------------------------------------------------------------------


def _lifecycle(activation: str, epoch: int) -> list[Event]:
    return [
        ActivationReady(activation_id=activation, kind="message", text="hi"),
        ActivationLeased(activation_id=activation, owner="w1", epoch=epoch, expires_at=T0 + 60),
        ActivationAcked(activation_id=activation, epoch=epoch),
    ]


# Was: DEFECT: `activations --session S` reads the whole log, and stops at another stream's damage.
def test_activations_of_one_session_read_its_stream_not_the_whole_log(store_dir: Path) -> None:
    """``activations --session s1`` filtered ``store.read_all()``: every record of the
    log was read and decoded to show one session's (on a 300,000-event log, 1.3 s where
    its stream takes milliseconds), and a damaged record of another stream, read on the
    way, ended the command with an error before s1's own lifecycle was shown. Now only
    s1's stream is read (as ``session events`` and ``status SESSION`` do); --follow
    goes on from the head."""
    append(store_dir, "provider:openai", _failed())
    append(store_dir, "session:s1", *_lifecycle("a1", 1), ts=T0 + 1)
    append(store_dir, "session:s2", *_lifecycle("b1", 1), ts=T0 + 5)
    damage(store_dir, b"log", position(1))
    code, out, err = stalwart(store_dir, "activations", "--session", "s1", "--json")
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["session"], r["activation_id"], r["what"]) for r in rows] == [
        ("session:s1", "a1", "ready"),
        ("session:s1", "a1", "leased"),
        ("session:s1", "a1", "acked"),
    ]
    # the whole log's lifecycle still stops at the damage, as tail does
    code, _, err = stalwart(store_dir, "activations")
    assert_one_error_line(code, err)
    assert "position 1" in err


def test_activations_follow_of_one_session_shows_its_history_then_what_comes(
    store_dir: Path,
) -> None:
    """The --follow of one session: its stream up to the head, then the new records of
    that session only, each once."""
    append(store_dir, "session:s1", *_lifecycle("a1", 1))
    append(store_dir, "session:s2", *_lifecycle("b1", 1))
    proc = subprocess.Popen(
        [*_STALWART, "--store", str(store_dir), "activations", "--session", "s1", "-f", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = [json.loads(proc.stdout.readline()) for _ in range(3)]
        append(store_dir, "session:s2", *_lifecycle("b2", 2), ts=T0 + 10)
        append(store_dir, "session:s1", *_lifecycle("a2", 2), ts=T0 + 20)
        seen += [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert [(r["activation_id"], r["what"]) for r in seen] == [
        ("a1", "ready"),
        ("a1", "leased"),
        ("a1", "acked"),
        ("a2", "ready"),
        ("a2", "leased"),
        ("a2", "acked"),
    ]
    assert proc.returncode == 0, err


# -- incidents --since DURATION: one pass ------------------------------------------------------


class _CountingRelay:
    """A TCP relay in front of PostgreSQL that counts the bytes the server sends."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sent = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="counting-relay").start()

    @property
    def sent(self) -> int:
        with self._lock:
            return self._sent

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self._target)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if counted:
                    with self._lock:
                        self._sent += len(data)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def counting(pg_server: PostgresServer) -> Iterator[_CountingRelay]:
    relay = _CountingRelay(pg_server.host, pg_server.port)
    try:
        yield relay
    finally:
        relay.close()


def _bytes_read(relay: _CountingRelay, url: str, *args: str) -> tuple[int, str]:
    """What the server sent for ``stalwart --store URL ARGS`` (in a subprocess), and its
    output."""
    before = relay.sent
    proc = subprocess.run(
        [*_STALWART, "--store", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    return relay.sent - before, proc.stdout


# Was: DEFECT: incidents --since DURATION read the whole log twice (a pass for the newest time).
def test_incidents_since_a_duration_reads_the_log_once(
    pg_server: PostgresServer, pg_url: str, counting: _CountingRelay
) -> None:
    """To count ``--since 30m`` back from the newest time in the log, ``incidents`` read
    the whole log once for that time and once more to fold it: on PostgreSQL every
    record crossed the network twice (on LMDB, a second decode of every record). Now the
    newest time is taken from the log's last records and the one pass that folds the log
    checks it (a second pass only when a record further back is newer: workers' clocks
    differ). The counts are the same as before."""
    with store_module.open(pg_url) as log:  # type: ignore[attr-defined]
        for batch in range(20):  # 4,000 calls over 4,000 s, one failed in 4
            events = [
                NewEvent(event=_failed() if k % 4 == 0 else _succeeded(), ts=T0 + batch * 200 + k)
                for k in range(200)
            ]
            log.append("provider:openai", events)
    url = pg_server.url("stalwart_test").replace(f":{pg_server.port}/", f":{counting.port}/")
    url += f"?schema={schema_of(pg_url)}"
    whole, _ = _bytes_read(counting, url, "incidents", "--json")
    spanned, out = _bytes_read(counting, url, "incidents", "--since", "30m", "--json")
    # the last 1,800 s of 4,000: T0 + 2,199 on, 1,801 calls, 450 of them failed
    [row] = [json.loads(line) for line in out.splitlines()]
    assert (row["calls"], row["failed"]) == (1801, 450)
    assert spanned < whole * 1.3, f"--since 30m read {spanned} bytes, the whole log {whole}"


def test_incidents_since_a_duration_finds_a_newer_record_further_back(store_dir: Path) -> None:
    """The newest time is not always at the log's end (a worker whose clock runs ahead
    wrote earlier): the pass that checks the guess finds the newer record, and the span
    counts back from it. A log whose last records cannot be read counts back from the
    newest one that can."""
    append(store_dir, "provider:openai", _failed(), ts=T0 + 3600)  # a clock an hour ahead
    for k in range(300):  # more than the tail the newest time is guessed from
        append(store_dir, "provider:openai", _succeeded(), ts=T0 + k)
    code, out, err = stalwart(store_dir, "incidents", "--since", "45m", "--json")
    assert (code, err) == (0, "")
    [row] = [json.loads(line) for line in out.splitlines()]
    assert (row["calls"], row["failed"]) == (1, 1)  # the last 45 minutes: the one ahead
    damage(store_dir, b"log", position(301))
    code, out, err = stalwart(store_dir, "incidents", "--since", "45m", "--json")
    assert_one_error_line(code, err)
    [row] = [json.loads(line) for line in out.splitlines()]
    assert (row["calls"], row["failed"]) == (1, 1)


# -- watch on a terminal narrower than its lines --------------------------------------------


def _wide_overview(store_dir: Path) -> None:
    """12 sessions with 32-character ids (as ``new_id`` makes), each waiting for an
    approval: rows well over 80 columns."""
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        for k in range(12):
            log.append(
                f"session:{k:032x}",
                [
                    NewEvent(event=SessionCreated(title="t"), ts=T0),
                    NewEvent(
                        event=SessionRequiresAction(
                            request_id=f"request-{k:024x}",
                            kind="approval",
                            tool="delete_everything_in_the_bucket",
                            arguments='{"bucket": "b"}',
                        ),
                        ts=T0 + 1,
                    ),
                ],
            )


def _first_frame(store_dir: Path, lines: int, columns: int) -> str:
    """The first frame ``stalwart watch`` draws on a pseudo-terminal of that size."""
    master, replica = pty.openpty()
    proc = subprocess.Popen(
        [*_STALWART, "--store", str(store_dir), "watch", "--interval", "5"],
        stdout=replica,
        stderr=subprocess.PIPE,
        env={**os.environ, "LINES": str(lines), "COLUMNS": str(columns)},
    )
    os.close(replica)
    drawn = b""
    try:
        give_up = time.monotonic() + 20  # real-time: a subprocess's first frame, polled
        while b"\x1b[J" not in drawn and time.monotonic() < give_up:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    drawn += os.read(master, 65536)
                except OSError:  # the terminal's other end closed: watch exited
                    break
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
        os.close(master)
    text = drawn.decode()
    assert "\x1b[J" in text, text[-500:]
    return text.split("\x1b[H", 1)[1].split("\x1b[J", 1)[0]


# Was: DEFECT: on an 80-column terminal every session row of watch wraps, and the frame scrolls.
def test_watch_on_a_narrow_terminal_draws_lines_that_do_not_wrap(store_dir: Path) -> None:
    """A frame fits the terminal's height (LINES - 1 lines), but its lines were drawn
    whole: a session row (a 40-character session id, the lease, the pending approval)
    is 150 columns, so on an 80-column terminal each wrapped onto a second line, the
    frame took twice the lines it counted, and the terminal scrolled on every redraw
    (the header pushed off the top). Now each line of a live frame is cut to the
    terminal's width, less one column, ending in ``…``."""
    _wide_overview(store_dir)
    first = _first_frame(store_dir, 40, 80)
    lines = [line.removesuffix("\x1b[K") for line in first.replace("\r\n", "\n").split("\n")]
    lines = [line for line in lines if line]
    assert any(line.startswith("session:00000000") for line in lines), lines
    too_wide = [line for line in lines if len(line) > 79]
    assert not too_wide, too_wide
    assert any(line.endswith("…") for line in lines)
    # a wide terminal shows the rows whole
    wide = _first_frame(store_dir, 40, 250)
    assert re.search(r"approval delete_everything_in_the_bucket \(request-0+\)", wide), wide


# -- status: the table's columns ---------------------------------------------------------------


# Was: DEFECT: a control character in a session id or provider name shifts status's columns.
def test_status_tables_stay_aligned_when_a_cell_is_escaped(store_dir: Path) -> None:
    """``status`` measured its table cells raw and escaped each line afterwards, so a
    session id holding ESC (shown as the six characters ``\\u001b``) pushed the rest of
    its row five columns right of the header (and the provider table likewise). Cells
    are now escaped before they are measured, as the incidents table does."""
    append(store_dir, "session:a\x1b[2Jb", SessionCreated(title="t"))
    append(store_dir, "session:plain-session", SessionCreated(title="t"))
    for name in ("open\x1bai", "openai"):
        append(
            store_dir,
            f"provider:{name}",
            ProviderCallFailed(provider=name, model="m", agent="a", error_class="timeout"),
        )
    code, out, err = stalwart(store_dir, "status")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert "\x1b" not in out
    sessions = [line for line in lines if line.startswith(("SESSION ", "session:"))]
    assert len(sessions) == 3
    assert len({line.index("idle" if line.startswith("s") else "STATUS") for line in sessions}) == 1
    providers = [line for line in lines if line.startswith(("  PROVIDER", "  open"))]
    assert len(providers) == 3
    columns = {
        line.index("healthy" if line.startswith("  open") else "HEALTH") for line in providers
    }
    assert len(columns) == 1, providers
