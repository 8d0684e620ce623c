"""Security review: secrets (API keys, URL passwords, database passwords) and untrusted
content, end to end.

A distinctive fake key is configured the way a user would (an environment variable named
by ``api_key_env``), and real failures are driven through a real 127.0.0.1 HTTP server
that behaves as hostile providers and proxies do: error bodies and headers that echo the
request's ``Authorization``, event streams that carry the key in a malformed frame or cut
off mid-frame, redirects to another host, a malformed response header. Then everything a
user or an operator could see is scanned: the store's bytes, the library's log lines
(structlog and the standard library's, httpx's included), the channel's messages, the
CLI's outputs, exception messages and tracebacks, reprs.

Tests marked ``# Was:`` failed on the code they were written against (``1ae0d67``), until
the fix their comment names; each assertion message says what a user would expect.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT, DEGRADED_TEXT, FAILED_TEXT
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import ProviderSettings, parse_config
from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer
from stalwart.errors import ConfigError, ProviderError
from stalwart.events import Codec, Event, MessageAppended, SessionCreated
from stalwart.providers import Message, ProviderClient, ProviderRequest
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, PostgresServer
from tests._runtime_support import GUARD, delivered_by_clock

KEY = "sk-live-REVIEW-0123456789abcdef"
KEY_ENV = "STALWART_REVIEW_SECURITY_KEY"
URL_PASSWORD = "Url-Pa55-REVIEW-7c1d"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hello"),), max_tokens=16)


# -- a hostile provider on 127.0.0.1 --------------------------------------------------------------


class _Hostile(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _HostileHandler)
        self.lock = threading.Lock()
        self.plans: dict[str, list[str]] = {}  # model -> behaviours, taken in order
        self.fallback = "500"
        self.seen: list[dict[str, str]] = []  # each request's headers (lower-case names)
        self.redirect_to = ""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def take(self, model: str) -> str:
        with self.lock:
            plan = self.plans.get(model) or []
            return plan.pop(0) if plan else self.fallback


class _HostileHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Hostile

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {name.lower(): value for name, value in self.headers.items()}
        with self.server.lock:
            self.server.seen.append(headers)
        try:
            model = str(json.loads(raw or b"{}").get("model"))
        except ValueError:
            model = "?"
        auth = headers.get("authorization", "")
        echo = json.dumps(
            {"error": {"message": f"Incorrect API key provided: {auth}", "headers": headers}}
        ).encode()
        behaviour = self.server.take(model)
        if behaviour in ("401", "403", "500"):
            self._send(
                int(behaviour),
                echo,
                "application/json",
                www_authenticate=f'Bearer realm="api", error="invalid_token {auth}"',
                x_echo_authorization=auth,
            )
        elif behaviour == "429":
            self._send(429, echo, "application/json", retry_after="0", x_echo_authorization=auth)
        elif behaviour == "sse_malformed":
            good = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
            bad = b"data: {not json, your key " + auth.encode() + b"\n\n"
            self._send(200, good + bad, "text/event-stream")
        elif behaviour == "sse_error":
            frame = json.dumps({"error": {"message": f"key {auth} was revoked", "type": "x"}})
            self._send(200, f"data: {frame}\n\n".encode(), "text/event-stream")
        elif behaviour == "cut":  # a chunked body that stops mid-frame, then the socket closes
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            part = b'data: {"choices":[{"delta":{"content":"' + auth.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif behaviour == "redirect":
            self._send(307, b"", "text/plain", location=self.server.redirect_to)
        else:
            raise AssertionError(f"unknown behaviour {behaviour}")


@pytest.fixture
def hostile() -> Iterator[_Hostile]:
    server = _Hostile()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(GUARD)


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY_ENV


def _bytes_under(root: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file())


def _cli(*args: str, color: bool = False) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), color=color)
    return result.exit_code, result.stdout, result.stderr


# -- the key, end to end ------------------------------------------------------------------


def test_a_key_echoed_by_every_kind_of_provider_failure_is_seen_nowhere(
    tmp_path: Path,
    clock: FakeClock,
    hostile: _Hostile,
    key_env: str,
    chat: MemoryChannel,
    logs: list[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 500, a 429, a stream with the key in a malformed frame, a 401 and a 403 whose
    bodies and headers echo ``Authorization``, an in-stream error quoting it and a stream
    cut mid-frame right after it: the user gets one static text, and neither the log's
    bytes, the library's log lines, the channel nor any read command shows the key."""
    caplog.set_level(logging.DEBUG)  # every logger, httpx's and httpcore's included
    hostile.plans = {
        "m1": ["500", "429", "sse_malformed"],
        "m2": ["401"],
        "m3": ["cut", "sse_error", "403"],
    }
    agent = {
        "provider": "main",
        "model": "m1",
        "fallback_models": ["main:m2", "main:m3"],
        "prompt_timeout_ms": 5_000,
        "retry_prompt_timeout_ms": 5_000,
        "max_retries": 2,
        "retry_base_ms": 1,
        "retry_cap_ms": 2,
    }
    provider = {
        "kind": "openai",
        "base_url": hostile.base_url,
        "api_key_env": key_env,
        "breaker_failure_threshold": 50,
    }
    cfg = parse_config({"providers": {"main": provider}, "agents": {"default": agent}})
    where = tmp_path / "store"
    store = store_module.open(where, clock=clock)
    try:
        with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
            rt.session("s1", channel="chat").send("hello")
            [notice, *_] = delivered_by_clock(clock, chat, 1)
    finally:
        store.close()
    assert notice.text in (FAILED_TEXT, DEGRADED_TEXT, ABANDONED_TEXT), notice.text
    assert len(hostile.seen) >= 5, "the scripted failures were not all played"
    assert {h.get("authorization") for h in hostile.seen} == {f"Bearer {KEY}"}  # it was sent
    for message in chat.attempted:
        assert KEY not in message.text, f"the user was sent the API key: {message.text!r}"
    assert KEY.encode() not in _bytes_under(where), "the API key is in the store's files"
    assert KEY not in repr(logs), "a library log line holds the API key"
    # httpcore's own DEBUG trace prints the response headers the server sent (the
    # echo): the library redacts it too
    assert any(r.name.startswith("httpcore") for r in caplog.records)
    for record in caplog.records:
        line = record.getMessage()
        assert KEY not in line, f"a {record.name} log line holds the API key: {line[:160]!r}"
    for args in (
        ("tail",),
        ("tail", "--json"),
        ("status",),
        ("status", "--json"),
        ("incidents",),
        ("incidents", "--json"),
        ("replay", "session:s1"),
        ("replay", "provider:main", "--json"),
        ("streams",),
    ):
        code, out, err = _cli("--store", str(where), "--log-level", "debug", *args)
        assert code in (0, 1), (args, code, err)
        assert KEY not in out + err, f"`stalwart {' '.join(args)}` shows the API key"


def test_stalwart_run_against_a_key_echoing_provider_says_one_static_line(
    tmp_path: Path, hostile: _Hostile, key_env: str
) -> None:
    """``stalwart run --log-level debug`` (the CLI's own JSON log lines on stderr) against
    a provider whose every answer echoes the key: exit 1, the documented static line, and
    the key in no output, log line or recorded event."""
    hostile.plans = {"m1": ["401"], "m2": ["sse_malformed", "500", "cut"]}
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[providers.main]\nkind = "openai"\nbase_url = "{hostile.base_url}"\n'
        f'api_key_env = "{key_env}"\n'
        '[agents.default]\nprovider = "main"\nmodel = "m1"\nfallback_models = ["main:m2"]\n'
        "max_retries = 2\nretry_base_ms = 1\nretry_cap_ms = 2\n"
    )
    where = str(tmp_path / "store")
    code, out, err = _cli(
        "--store", where, "--log-level", "debug", "run", "--config", str(config), "hi"
    )
    assert code == 1, (out, err)
    assert err.splitlines()[-1] == (
        "stalwart: error: the model did not answer: every configured model failed or timed out"
    ), err
    assert len(hostile.seen) == 4
    assert KEY not in out + err, "`stalwart run` printed the API key"
    code, out, err = _cli("--store", where, "tail", "--json")
    assert code == 0, err
    assert KEY not in out


def test_a_redirect_to_another_host_never_carries_the_key_there(
    hostile: _Hostile, key_env: str
) -> None:
    """A provider (or a captive portal in front of it) answering 307 to another host: the
    client does not follow, so the key goes to the configured host only, and the failure
    is a typed error that names neither the key nor the other host's answer."""
    other = _Hostile()
    thread = threading.Thread(target=other.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        hostile.redirect_to = other.base_url + "/chat/completions"
        hostile.fallback = "redirect"
        settings = ProviderSettings(kind="openai", base_url=hostile.base_url, api_key_env=key_env)
        client = ProviderClient("main", settings)

        async def both() -> list[ProviderError]:
            errors = []
            with pytest.raises(ProviderError) as streamed:
                async for _ in client.stream("m1", REQUEST):
                    pass
            errors.append(streamed.value)
            with pytest.raises(ProviderError) as completed:
                await client.complete("m1", REQUEST)
            errors.append(completed.value)
            await client.aclose()
            return errors

        errors = anyio.run(both)
    finally:
        other.shutdown()
        other.server_close()
        thread.join(GUARD)
    assert other.seen == [], "the key was sent to the host a redirect named"
    assert len(hostile.seen) == 2
    for error in errors:
        assert (error.status, error.retryable) == (307, False)
        assert KEY not in str(error) + repr(error)


def test_httpx_request_log_line_does_not_show_a_provider_url_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Was: httpx's INFO request line prints a provider base_url's user:password
    """A host that logs at INFO (``logging.basicConfig(level=logging.INFO)``) gets httpx's
    request line for every model call. For a webhook's url stalwart rewrites that line
    (docs/channels.md); a provider's base_url with user info (a proxy behind basic auth)
    goes out with its password, although the recorded config and the client's repr
    both drop it."""
    caplog.set_level(logging.INFO, logger="httpx")
    with FakeProvider() as fake:
        fake.set_default(Answer(text="hi"))
        url = fake.base_url.replace("http://", f"http://ops:{URL_PASSWORD}@")
        client = ProviderClient("main", ProviderSettings(kind="openai", base_url=url))

        async def call() -> str:
            try:
                return (await client.complete("m1", REQUEST)).text
            finally:
                await client.aclose()

        assert anyio.run(call) == "hi"
    assert URL_PASSWORD not in repr(client)  # the client's own repr hides it
    lines = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert lines, "httpx logged no request line"
    leaked = [line for line in lines if URL_PASSWORD in line]
    assert not leaked, (
        "expected the provider URL's password to stay out of log lines (as it does for a "
        f"webhook's url); httpx's request line shows it: {leaked[0]!r}"
    )


def _echoing_raw_server(reply: Callable[[bytes], bytes]) -> tuple[socket.socket, int]:
    """A socket server that answers each request with ``reply(request_head)``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                conn.sendall(reply(head))

    threading.Thread(target=serve, daemon=True).start()
    return listener, int(listener.getsockname()[1])


def test_a_malformed_response_header_echoing_the_key_stays_out_of_the_traceback(
    key_env: str,
) -> None:
    # Was: a ProviderError's chained cause quotes raw response bytes: the echoed key
    """A broken proxy that echoes the request's headers back without the colon: h11
    refuses the header line and quotes it, bytes and all. stalwart's ProviderError text
    is clean, but it is raised ``from`` that error, so the key is in the traceback a host
    logs with ``log.exception`` (docs/providers.md: the key never appears in an exception
    message; ``_cause`` cuts the chain only for a request httpx refused to send)."""

    def reply(head: bytes) -> bytes:
        echoed = [line for line in head.split(b"\r\n") if line.lower().startswith(b"authoriz")]
        return (
            b"HTTP/1.1 401 Unauthorized\r\n"
            + echoed[0].replace(b":", b"")
            + b"\r\ncontent-length: 0\r\n\r\n"
        )

    listener, port = _echoing_raw_server(reply)
    settings = ProviderSettings(
        kind="openai", base_url=f"http://127.0.0.1:{port}/v1", api_key_env=key_env
    )
    client = ProviderClient("main", settings)

    async def call() -> ProviderError:
        try:
            with pytest.raises(ProviderError) as caught:
                await client.complete("m1", REQUEST)
            return caught.value
        finally:
            await client.aclose()

    try:
        error = anyio.run(call)
    finally:
        listener.close()
    assert KEY not in str(error) + repr(error)  # the message itself is ours
    shown = "".join(traceback.format_exception(error))
    assert KEY not in shown, (
        "expected a provider failure's traceback to hold no API key; it quotes it from the "
        "chained cause: " + next(line for line in shown.splitlines() if KEY in line).strip()[:160]
    )


# -- the key, pasted where the name of its variable goes -----------------------------------------


def test_a_key_pasted_into_api_key_env_is_refused_or_at_least_not_recorded(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    # Was: a key pasted into api_key_env is recorded in runtime:started, shown by tail
    """``api_key_env = "sk-..."``: the key where the *name* of its variable goes. It is no
    variable name (a hyphen), so the config could refuse it without echoing it; instead
    the runtime records it in ``runtime:started`` for ever, and every ``stalwart tail``
    and ``replay runtime`` prints it (docs/embedding.md: "API keys are never in the
    config (only the names of their env vars)")."""
    provider = {"kind": "openai", "base_url": fake.base_url, "api_key_env": KEY}
    agent = {"provider": "main", "model": "m1"}
    refused: ConfigError | None = None
    try:
        cfg = parse_config({"providers": {"main": provider}, "agents": {"default": agent}})
    except ConfigError as error:  # a fix may refuse it: then without echoing it
        refused = error
    if refused is not None:
        assert KEY not in str(refused), str(refused)
        return
    where = tmp_path / "store"
    with Runtime(cfg, store=str(where), clock=clock, channels={"chat": MemoryChannel("chat")}):
        pass
    code, out, _ = _cli("--store", str(where), "tail", "--json")
    assert code == 0
    assert KEY not in out, (
        "expected a key pasted into api_key_env to be refused or kept out of the log; "
        "`stalwart tail --json` prints it from runtime:started"
    )


def test_the_config_repr_shows_no_password(tmp_path: Path) -> None:
    # Was: repr(Config) prints store.location's and a provider base_url's password
    """docs/scaling.md: "stalwart never shows a password: location, repr, log lines and
    error messages carry the URL without it". ``ChannelSettings`` has a repr that hides
    its url's secrets and ``ProviderClient`` drops user info, but a ``Config`` (what a
    host logs, or a traceback with locals shows) prints both passwords as written."""
    cfg = parse_config(
        {
            "store": {"location": f"postgresql://app:{URL_PASSWORD}@db.internal/agents"},
            "providers": {
                "main": {"kind": "openai", "base_url": f"https://u:{URL_PASSWORD}@proxy/v1"}
            },
            "agents": {"default": {"provider": "main", "model": "m1"}},
        }
    )
    assert URL_PASSWORD not in str(cfg.to_record())  # the recorded form is clean
    shown = {
        "repr(config)": repr(cfg),
        "repr(config.store)": repr(cfg.store),
        "repr(config.providers['main'])": repr(cfg.providers["main"]),
    }
    leaking = [name for name, text in shown.items() if URL_PASSWORD in text]
    assert not leaking, f"expected no password in a repr; these show it: {leaking}"


# -- PostgreSQL passwords in the CLI ------------------------------------------------------


def test_the_cli_never_shows_a_database_password_that_failed(
    pg_server: PostgresServer,
) -> None:
    """A password with characters URLs encode (``@ : / %``), wrong for a live server and
    right-looking for a port where nothing listens; and a ``?password=`` parameter: each
    read command says what failed in one line, with neither the password nor its
    percent-encoded form, at ``--log-level debug`` too."""
    wrong = "p@ss:w/rd%REVIEW"
    encoded = quote(wrong, safe="")
    live = pg_server.url("stalwart_test").replace(quote(pg_server.password, safe=""), encoded)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = int(probe.getsockname()[1])
    nowhere = f"postgresql://agent:{encoded}@127.0.0.1:{closed}/x?connect_timeout=2"
    as_param = f"postgresql://agent@127.0.0.1:{closed}/x?password={encoded}&connect_timeout=2"
    cases = [(live, "authentication failed"), (nowhere, "nothing is listening")]
    cases.append((as_param, "nothing is listening"))
    for url, reason in cases:
        for command in (["streams"], ["tail", "--json"], ["status"]):
            code, out, err = _cli("--store", url, "--log-level", "debug", *command)
            shown = out + err
            assert code == 1, (command, shown)
            assert wrong not in shown, (command, shown)
            assert encoded not in shown, (command, shown)
            assert "Traceback" not in shown
            assert err.startswith("stalwart: error: "), (command, err)
            assert reason in err, (command, err)
            assert err.count("\n") == 1, err


# -- untrusted text on an operator's terminal --------------------------------------------------

_PAINT = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x1b[H"  # set the clipboard, clear the screen


def test_stalwart_run_does_not_let_the_reply_drive_the_terminal(
    tmp_path: Path, fake: FakeProvider
) -> None:
    # Was: `stalwart run` writes the model's text to the terminal raw, ESC and all
    """Model output is untrusted (docs/channels.md: the console channel writes ESC
    escaped "so a reply cannot move the cursor or forge a line"). ``stalwart run`` prints
    the streamed reply with ``sys.stdout.write``: an OSC 52 sequence sets the operator's
    clipboard and CSI 2J clears the screen."""
    fake.set_default(Answer(text=f"Sure.{_PAINT} Done.", chunks=1))
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[providers.main]\nkind = "openai"\nbase_url = "{fake.base_url}"\n'
        '[agents.default]\nprovider = "main"\nmodel = "m1"\n'
    )
    code, out, err = _cli(
        "--store", str(tmp_path / "store"), "run", "--config", str(config), "hi", color=True
    )
    assert code == 0, err
    assert "Sure." in out
    assert "Done." in out
    for char in ("\x1b", "\x07"):
        assert char not in out, (
            f"expected the reply's control characters shown escaped; the terminal got {out!r}"
        )


def _dag_session(location: Path, poisoned: str) -> None:
    """A stored session whose message 6 holds ``poisoned``, summarized by the DAG engine."""
    clock = FakeClock()
    messages = [
        ContextMessage(
            message_id=f"m{i}",
            seq=i,
            role="tool" if i == 6 else ("user" if i % 2 == 0 else "assistant"),
            content=(poisoned if i == 6 else "") + f" message {i} " + "z " * 150,
        )
        for i in range(60)
    ]
    with store_module.open(location, clock=clock) as store:  # type: ignore[attr-defined]
        store.append(
            "session:s9",
            [
                MessageAppended(message_id=m.message_id, role=m.role, content=m.content)
                for m in messages
            ],
        )
        engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock)
        result = engine.assemble("s9", messages, 3_000, tenant="acme")
        store.append("context:s9", list(result.events))


def test_context_search_shows_a_snippet_of_tool_output_escaped(tmp_path: Path) -> None:
    # Was: `stalwart context search` prints snippets of tool output raw, ESC and all
    """docs/cli.md: "Human-readable lines show control characters in values escaped".
    A search hit's snippet is a window of a stored message (tool output: untrusted),
    whitespace collapsed but ESC and BEL kept, printed as it is."""
    location = tmp_path / "store"
    _dag_session(location, f"KIWI-77 {_PAINT} fetched page")
    code, out, err = _cli(
        "--store", str(location), "context", "search", "context:s9", "KIWI-77", color=True
    )
    assert code == 0, err
    assert "KIWI-77" in out
    for char in ("\x1b", "\x07"):
        assert char not in out, (
            f"expected the snippet's control characters escaped; the terminal got {out[:200]!r}"
        )


class _Forged(Event, frozen=True, tag="future:x\n       9  2030-01-01T00:00:00.000Z  x  y"):
    """A record of a type this version does not know, its tag holding a line break."""

    clue: str = "a"


def test_tail_keeps_an_unknown_event_type_on_its_own_line(tmp_path: Path) -> None:
    # Was: `tail` escapes field values but not an unknown record's type: a forged line
    """docs/cli.md: control characters are shown escaped "so each event stays one line".
    A record of a type this version cannot decode (a newer writer, another process on the
    same store) is shown with its tag as found: a line break in it prints a second,
    forged event line."""
    location = tmp_path / "store"
    with store_module.open(location, codec=Codec(extra_types=[_Forged])) as store:  # type: ignore[attr-defined]
        store.append("session:z", [SessionCreated(), _Forged()])
    code, out, err = _cli("--store", str(location), "tail")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2, (
        f"expected one line per event (2 events); `stalwart tail` printed {len(lines)}: {lines}"
    )


def test_untrusted_text_in_events_stays_escaped_in_every_view(
    tmp_path: Path, store: EventStore
) -> None:
    """Tool output, a tool's name and a session title with ESC, BEL, CR, NEL and U+2028:
    ``tail``, ``status`` and ``replay`` show each event or value on its one line, no
    escape sequence reaching the terminal."""
    from stalwart.events import ToolCompleted, ToolStarted

    hostile = f"ok{_PAINT}\r\n       9  forged\x85line\u2028more"
    store.append(
        "session:s1",
        [
            SessionCreated(title=hostile),
            ToolStarted(call_id="c1", tool="fetch", arguments=hostile),
            ToolCompleted(call_id="c1", tool="fetch", output=hostile),
        ],
    )
    location = store.location
    store.close()
    for args in (("tail",), ("status",), ("status", "s1"), ("replay", "session:s1")):
        code, out, err = _cli("--store", location, *args, color=True)
        assert code == 0, (args, err)
        for bad in ("\x1b", "\x07", "\r", "\x85", "\u2028"):
            assert bad not in out, (args, bad, out)
        assert not any(line.lstrip().startswith("9  forged") for line in out.splitlines())
    code, out, _ = _cli("--store", location, "tail")
    assert len(out.splitlines()) == 3


def test_a_webhook_secret_never_reaches_the_recorded_config_or_a_repr(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A webhook with its token in a secret header *and* one in its url path: the
    ``runtime:started`` record, the channel's repr and the settings' repr show neither."""
    monkeypatch.setenv("STALWART_REVIEW_HOOK_TOKEN", "xoxb-REVIEW-hook-secret-42")
    path_token = "T0-REVIEW-path-token-99"
    channel = {
        "kind": "webhook",
        "url": f"https://hooks.example/services/{path_token}?sig=REVIEW-sig",
        "secret_header": "X-Token",
        "secret_env": "STALWART_REVIEW_HOOK_TOKEN",
    }
    cfg = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {"default": {"provider": "main", "model": "m1"}},
            "channels": {"hook": channel},
        }
    )
    where = tmp_path / "store"
    with Runtime(cfg, store=str(where), clock=clock) as rt:
        shown = repr(rt.channels["hook"]) + repr(cfg.channels["hook"]) + repr(cfg)
    stored = _bytes_under(where)
    for secret in ("xoxb-REVIEW-hook-secret-42", path_token, "REVIEW-sig"):
        assert secret not in shown, secret
        assert secret.encode() not in stored, secret
    assert os.environ["STALWART_REVIEW_HOOK_TOKEN"]  # read from the variable, as configured
