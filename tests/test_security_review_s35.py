"""Security review (session 35): secrets and untrusted text on the surfaces the last three
sessions added, and where the earlier reviews (``test_security_review.py``,
``test_security_review_s33.py``) did not look.

Real parts only: a real provider client holding a key read from the environment, the
runtime's real Scheduler and pykka actors raising real exceptions, a host's real
``logging`` handler and structlog configuration writing to a buffer. Tests marked
``# Was:`` failed before the fix their comment names.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pykka
import pytest
import structlog

from stalwart.actors import Scheduler
from stalwart.channels import OutboundMessage, channel_from_settings
from stalwart.clock import FakeClock
from stalwart.config import ChannelSettings, ProviderSettings
from stalwart.errors import ChannelError
from stalwart.providers import ProviderClient
from tests._runtime_support import GUARD

#: a gateway's key: no ``sk-`` shape, so only the client's holding it can hide it
KEY = "gw7Live0REVIEW35abcdefXYZ"
KEY_ENV = "STALWART_REVIEW_S35_KEY"


@pytest.fixture
def held_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A provider client open on KEY, as a runtime holds one for its life."""
    monkeypatch.setenv(KEY_ENV, KEY)
    settings = ProviderSettings(
        kind="openai", base_url="http://127.0.0.1:9/v1", api_key_env=KEY_ENV
    )
    client = ProviderClient("gateway", settings)
    try:
        yield KEY
    finally:
        anyio.run(client.aclose)


@pytest.fixture
def host_logging() -> Iterator[io.StringIO]:
    """A host that configured the standard library's ``logging`` (not structlog): a
    handler with the standard Formatter on the root logger, at INFO."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _failing_callback(_: float) -> None:
    # a host's timer callback quoting what a gateway answered (its key echoed back)
    raise RuntimeError(f"the gateway refused: invalid key {KEY}")


class _Echoing(pykka.ThreadingActor):
    def on_receive(self, message: object) -> object:
        raise RuntimeError(f"the gateway refused: invalid key {KEY}")


# -- a logged exception's traceback ----------------------------------------------------------


# Was: DEFECT: under a host's stdlib logging, a logged exception's traceback showed a held key
def test_a_logged_exceptions_traceback_shows_no_held_secret_under_host_logging(
    held_key: str, host_logging: io.StringIO, clock: FakeClock
) -> None:
    scheduler = Scheduler(clock).start()
    try:
        scheduler.schedule(clock.now(), _failing_callback)
        clock.advance(0)  # fires the callback here, which raises: logged with its traceback
    finally:
        scheduler.stop()
    actor = _Echoing.start()
    try:
        with pytest.raises(RuntimeError):  # pykka logs the ask's exception, then raises it
            actor.ask("hello")
    finally:
        actor.stop()
    shown = host_logging.getvalue()
    assert "scheduler.callback_failed" in shown, shown
    assert shown.count("Traceback (most recent call last):") == 2, shown
    assert shown.count("RuntimeError: the gateway refused: invalid key [redacted]") == 2, shown
    assert held_key not in shown, "a key this process holds is never in a log line"


# Was: DEFECT: under a host's structlog, a logged exception's traceback showed a held key
def test_a_logged_exceptions_traceback_shows_no_held_secret_under_host_structlog(
    held_key: str, clock: FakeClock
) -> None:
    out = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=out),
    )
    scheduler = Scheduler(clock).start()
    try:
        scheduler.schedule(clock.now(), _failing_callback)
        clock.advance(0)
    finally:
        scheduler.stop()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    failed = [line for line in lines if line["event"] == "scheduler.callback_failed"]
    assert len(failed) == 1, lines
    assert failed[0]["exception"].startswith("Traceback (most recent call last):")
    assert failed[0]["exception"].endswith("invalid key [redacted]")
    assert held_key not in out.getvalue(), "a key this process holds is never in a log line"


# -- a secret that a log line shows escaped ---------------------------------------------------

#: a webhook's secret header value with a backslash and a quote in it (a generated
#: password's symbols): a wire trace shows it as bytes do, ``\\`` for its backslash
ESCAPED_TOKEN = "hookREVIEW35\\tok'\"-9f8e"
ESCAPED_TOKEN_ENV = "STALWART_REVIEW_S35_TOKEN"


class _Echo(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _EchoHandler)
        self.lock = threading.Lock()
        self.seen: list[dict[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _EchoHandler(BaseHTTPRequestHandler):
    """Refuses every POST (401), echoing the request's headers in its own (a debugging
    proxy, a misconfigured gateway)."""

    protocol_version = "HTTP/1.1"
    server: _Echo

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {name.lower(): value for name, value in self.headers.items()}
        with self.server.lock:
            self.server.seen.append(headers)
        self.send_response(401)
        self.send_header("content-length", "0")
        for name, value in headers.items():
            if name not in ("content-length", "content-type", "host", "connection"):
                self.send_header(f"x-echo-{name}", value)
        self.end_headers()
        self.wfile.flush()


@pytest.fixture
def echo() -> Iterator[_Echo]:
    server = _Echo()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(GUARD)


# Was: DEFECT: a webhook secret with a backslash, echoed back, showed escaped in httpcore's trace
def test_a_secret_shown_escaped_in_the_wire_trace_is_hidden_too(
    echo: _Echo, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(ESCAPED_TOKEN_ENV, ESCAPED_TOKEN)
    settings = ChannelSettings(
        kind="webhook",
        url=f"{echo.url}/hook",
        secret_header="X-Hook-Token",
        secret_env=ESCAPED_TOKEN_ENV,
        max_attempts=1,
    )
    message = OutboundMessage(conversation="c1", text="hello", idempotency_key="k1")

    async def send() -> ChannelError:
        channel = channel_from_settings("ops", settings)
        try:
            with pytest.raises(ChannelError) as failed:
                await channel.send(message)
        finally:
            await channel.aclose()
        return failed.value

    assert anyio.run(send).kind == "rejected"
    [seen] = echo.seen
    assert seen.get("x-hook-token") == ESCAPED_TOKEN
    traced = [r.getMessage() for r in caplog.records if r.name.startswith("httpcore")]
    assert any("x-echo-x-hook-token" in line for line in traced), traced
    for line in traced:
        assert "hookREVIEW35" not in line, f"a wire trace line shows the secret: {line[:300]!r}"
