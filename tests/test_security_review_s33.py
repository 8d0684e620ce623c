"""Security review (session 33): secrets and untrusted text, end to end, where the first
review (``test_security_review.py``) did not look.

Real parts only: a real 127.0.0.1 HTTP server that behaves as hostile providers and
webhook receivers do (echoing the request's secret headers back in its own), the real CLI
through click's runner, real log records. Tests marked ``# Was:`` failed before the fix
their comment names.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.channels import OutboundMessage, channel_from_settings
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import ChannelSettings
from stalwart.errors import ChannelError
from stalwart.events import MessageAppended, SessionCreated, ToolCompleted, ToolStarted
from tests._runtime_support import GUARD

#: a gateway's key: no ``sk-`` prefix, no ``Bearer`` in front of it (Anthropic's header)
KEY = "gw7Live0REVIEW33abcdefXYZ"
KEY_ENV = "STALWART_REVIEW_S33_KEY"
TOKEN = "hook-REVIEW33-tok-5e6f7a8b"
TOKEN_ENV = "STALWART_REVIEW_S33_TOKEN"
URL_PASSWORD = "Url-Pa55-REVIEW33-9d2e"


# -- a server that echoes what it was sent ---------------------------------------------------


class _Echo(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, status: int = 401) -> None:
        super().__init__(("127.0.0.1", 0), _EchoHandler)
        self.status = status
        self.lock = threading.Lock()
        self.seen: list[dict[str, str]] = []  # each request's headers (lower-case names)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _EchoHandler(BaseHTTPRequestHandler):
    """Answers every POST with its status, and the request's headers echoed in the
    response's headers and body (a debugging proxy, a misconfigured gateway)."""

    protocol_version = "HTTP/1.1"
    server: _Echo

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {name.lower(): value for name, value in self.headers.items()}
        with self.server.lock:
            self.server.seen.append(headers)
        body = json.dumps({"error": {"message": "denied", "headers": headers}}).encode()
        self.send_response(self.server.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for name, value in headers.items():
            if name not in ("content-length", "content-type", "host", "connection"):
                self.send_header(f"x-echo-{name}", value)
        self.end_headers()
        self.wfile.write(body)
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


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


# -- secrets of any shape stay out of log lines ----------------------------------------------


# Was: DEFECT: a key with no sk- shape echoed in a response header is shown by --log-level debug
def test_a_key_of_any_shape_echoed_in_a_header_stays_out_of_the_debug_log(
    tmp_path: Path, echo: _Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stalwart --log-level debug run`` against an Anthropic-style gateway (the key goes
    in ``x-api-key``, bare) that echoes the request's headers in its 401: httpcore's
    DEBUG trace prints the response headers, and the key with them, unless the library
    knows the key itself and not only what keys usually look like."""
    monkeypatch.setenv(KEY_ENV, KEY)
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[providers.gw]\nkind = "anthropic"\nbase_url = "{echo.url}"\n'
        f'api_key_env = "{KEY_ENV}"\n'
        '[agents.default]\nprovider = "gw"\nmodel = "m1"\n'
    )
    where = str(tmp_path / "store")
    code, out, err = _cli(
        "--store", where, "--log-level", "debug", "run", "--config", str(config), "hi"
    )
    assert code == 1, (out, err)
    assert [seen.get("x-api-key") for seen in echo.seen] == [KEY]  # it was sent
    assert "receive_response_headers.complete" in err  # httpcore's trace was printed
    assert KEY not in out + err, "`stalwart --log-level debug run` printed the API key"


# Was: DEFECT: a base_url password sent as HTTP Basic and echoed back is shown by --log-level debug
def test_a_base_url_password_echoed_as_basic_auth_stays_out_of_the_debug_log(
    tmp_path: Path, echo: _Echo
) -> None:
    """A provider behind a proxy that takes a user and password in ``base_url`` (sent as
    HTTP Basic authentication): the proxy echoes the request's headers in its 401, and
    the ``Basic`` credential (the password, base64-encoded) is no more printed than the
    password itself."""
    host = echo.url.removeprefix("http://")
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[providers.main]\nkind = "openai"\nbase_url = "http://proxy:{URL_PASSWORD}@{host}/v1"\n'
        '[agents.default]\nprovider = "main"\nmodel = "m1"\n'
    )
    basic = base64.b64encode(f"proxy:{URL_PASSWORD}".encode()).decode()
    where = str(tmp_path / "store")
    code, out, err = _cli(
        "--store", where, "--log-level", "debug", "run", "--config", str(config), "hi"
    )
    assert code == 1, (out, err)
    assert [seen.get("authorization") for seen in echo.seen] == [f"Basic {basic}"]
    assert "receive_response_headers.complete" in err
    assert URL_PASSWORD not in out + err
    assert basic not in out + err, "`stalwart --log-level debug run` printed the proxy's credential"


# Was: DEFECT: a webhook secret header value echoed by the receiver reaches httpcore's log
def test_a_webhook_secret_echoed_by_the_receiver_stays_out_of_the_debug_log(
    echo: _Echo, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that rejects the message and echoes the request's headers back: the
    send fails as ``rejected``, and no log line (httpcore's wire trace included) shows
    the secret header's value, or the url's password (sent as HTTP Basic)."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    host = echo.url.removeprefix("http://")
    basic = base64.b64encode(f"hook:{URL_PASSWORD}".encode()).decode()
    settings = ChannelSettings(
        kind="webhook",
        url=f"http://hook:{URL_PASSWORD}@{host}/hook",
        secret_header="X-Hook-Token",
        secret_env=TOKEN_ENV,
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

    error = anyio.run(send)
    assert error.kind == "rejected"
    [seen] = echo.seen
    assert (seen.get("x-hook-token"), seen.get("authorization")) == (TOKEN, f"Basic {basic}")
    assert any(record.name.startswith("httpcore") for record in caplog.records)
    for record in caplog.records:
        line = record.getMessage()
        for secret in (TOKEN, basic, URL_PASSWORD):
            assert secret not in line, f"a {record.name} log line holds a secret: {line[:160]!r}"


# -- untrusted text in the CLI's JSON output -------------------------------------------------

#: what JSON leaves raw and a terminal acts on: CSI as a C1 control (U+009B, which xterm
#: reads as ESC [), DEL, a right-to-left override (the rest of the line reads backwards),
#: a line separator
_RAW = ("\x9b", "\x7f", "\u202e", "\u2028", "\u2066")
_HOSTILE = "ok \x9b2J\x9b31mred\x7f \u202etxt.exe\u2028next \u2066iso"


# Was: DEFECT: --json outputs write C1 controls (CSI), DEL and bidi overrides raw
def test_json_outputs_escape_what_json_leaves_raw_and_a_terminal_acts_on(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Model and tool text with an 8-bit CSI (U+009B), DEL, a right-to-left override and
    a line separator: ``tail --json``, ``status --json``, ``replay --json`` and ``streams
    --json`` write those as ``\\uXXXX`` escapes (JSON escapes only U+0000-U+001F
    itself), and every line still decodes to the text as it was recorded."""
    location = tmp_path / "store"
    stream = f"session:s{_HOSTILE[:4]}\u202e"
    with store_module.open(location, clock=clock) as store:
        store.append(
            stream,
            [
                SessionCreated(title=_HOSTILE),
                MessageAppended(message_id="m1", role="assistant", content=_HOSTILE),
                ToolStarted(call_id="c1", tool="fetch", arguments=_HOSTILE),
                ToolCompleted(call_id="c1", tool="fetch", output=_HOSTILE),
            ],
        )
    for args in (
        ("tail", "--json"),
        ("status", "--json"),
        ("replay", stream, "--json"),
        ("streams", "--json"),
        ("session", "events", stream, "--json"),
    ):
        code, out, err = _cli("--store", str(location), *args)
        assert code == 0, (args, err)
        for raw in _RAW:
            assert raw not in out, f"`stalwart {args[0]} --json` wrote {raw!r} raw: {out!r}"
        decoded = json.dumps([json.loads(line) for line in out.splitlines()], ensure_ascii=False)
        assert _HOSTILE in decoded or stream in decoded, (args, decoded)  # the same JSON


def test_a_postgres_stores_password_is_kept_out_of_log_lines_while_it_is_open(
    pg_url: str,
) -> None:
    from stalwart._logs import scrub_secrets
    from stalwart.store import PostgresEventStore
    from stalwart.store._postgres_connect import PostgresUrl

    password = PostgresUrl(pg_url).password
    assert password, "the test server's URL carries a password"
    line = f"pool: cannot connect with {password} (a library quoting it)"
    with PostgresEventStore(pg_url):
        assert password not in scrub_secrets(line)
