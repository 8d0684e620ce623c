"""Channels: a real HTTP receiver on 127.0.0.1 for the webhook, a buffer for the console,
scripting for the memory channel, and the ``[channels.NAME]`` config section.

Budgets are small (per-attempt limits of 0.2 s, backoffs of a few ms) and the margins
generous; nothing sleeps to wait for an outcome.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from stalwart.channels import (
    Channel,
    ConsoleChannel,
    Delivery,
    MemoryChannel,
    OutboundMessage,
    WebhookChannel,
    channel_from_settings,
)
from stalwart.config import ChannelSettings, Config, load_config, parse_config
from stalwart.errors import ChannelError, ConfigError

pytestmark = pytest.mark.anyio

GUARD = 5.0
SECRET = "hook-secret-value-5f3a"
URL_TOKEN = "url-token-9c1d"
TEXT = "the sub-agent task did not complete"
MESSAGE = OutboundMessage(
    conversation="c1", thread="t9", text=TEXT, idempotency_key="k-1", kind="failure_notice"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Step(msgspec.Struct, frozen=True):
    status: int = 200
    headers: dict[str, str] = {}
    hang: bool = False


class Received(msgspec.Struct, frozen=True):
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class Receiver:
    """A webhook receiver that answers scripted statuses (200 once the script runs out),
    can hold a request unanswered, and records what it got."""

    def __init__(self, *steps: Step, listen: bool = True) -> None:
        self.steps = deque(steps)
        self.requests: list[Received] = []
        self.release = threading.Event()
        handler = type("Handler", (_Handler,), {"receiver": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.server_bind()  # a bound port that refuses connections until listen()
        self._thread: threading.Thread | None = None
        if listen:
            self.listen()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/hooks/{URL_TOKEN}?token={URL_TOKEN}"

    def listen(self) -> None:
        self._server.server_activate()
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        if self._thread is not None:
            self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    receiver: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.receiver.requests.append(Received(self.path, headers, body, time.monotonic()))
        step = self.receiver.steps.popleft() if self.receiver.steps else Step()
        if step.hang:
            self.receiver.release.wait(GUARD)
            return
        try:
            self.send_response(step.status)
            for name, value in step.headers.items():
                self.send_header(name, value)
            self.send_header("content-length", "0")
            self.end_headers()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(*steps: Step, listen: bool = True) -> Receiver:
        made.append(Receiver(*steps, listen=listen))
        return made[-1]

    yield make
    for each in made:
        each.close()


def webhook(url: str, transport: httpx.AsyncBaseTransport | None = None, **knobs: Any) -> Channel:
    entry = {"kind": "webhook", "url": url, "retry_base_ms": 5, "retry_cap_ms": 2000, **knobs}
    config = parse_config({"channels": {"hook": entry}})
    return channel_from_settings("hook", config.channels["hook"], transport=transport)


async def send(channel: Channel, message: OutboundMessage = MESSAGE) -> Delivery:
    with anyio.fail_after(GUARD):
        return await channel.send(message)


async def failing(channel: Channel, message: OutboundMessage = MESSAGE) -> ChannelError:
    with pytest.raises(ChannelError) as info:
        await send(channel, message)
    return info.value


def facts(error: ChannelError) -> tuple[str, bool, int | None, int]:
    return (error.kind, error.retryable, error.status, error.attempts)


def refused_url(path: str = "/hook") -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}{path}"


async def test_webhook_delivers_json_with_the_secret_header(
    receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALWART_TEST_HOOK_SECRET", SECRET)
    hook = receiver()
    channel = webhook(
        hook.url, secret_header="X-Hook-Secret", secret_env="STALWART_TEST_HOOK_SECRET"
    )
    delivery = await send(channel)
    await channel.aclose()
    assert delivery == Delivery(channel="hook", attempts=1, status=200)
    [got] = hook.requests
    assert got.path == f"/hooks/{URL_TOKEN}?token={URL_TOKEN}"
    assert json.loads(got.body) == {
        "conversation": "c1",
        "thread": "t9",
        "text": TEXT,
        "kind": "failure_notice",
        "idempotency_key": "k-1",
    }
    assert got.headers["content-type"] == "application/json"
    assert got.headers["idempotency-key"] == "k-1"
    assert got.headers["x-hook-secret"] == SECRET


async def test_retries_503_with_the_same_idempotency_key(
    receiver: Callable[..., Receiver], logs: list[MutableMapping[str, Any]]
) -> None:
    hook = receiver(Step(503), Step(503), Step(200))
    channel = webhook(hook.url, max_attempts=3)
    delivery = await send(channel)
    assert (delivery.attempts, delivery.status) == (3, 200)
    assert [r.headers["idempotency-key"] for r in hook.requests] == ["k-1"] * 3
    assert len({r.body for r in hook.requests}) == 1
    retries = [e for e in logs if e["event"] == "channel.retry_scheduled"]
    assert [(e["attempt"], e["kind"], e["status"]) for e in retries] == [
        (n, "server_error", 503) for n in (1, 2)
    ]


@pytest.mark.parametrize("status", [408, 429, 500, 502, 504])
async def test_retryable_statuses(receiver: Callable[..., Receiver], status: int) -> None:
    hook = receiver(Step(status))
    delivery = await send(webhook(hook.url))
    assert (delivery.attempts, delivery.status, len(hook.requests)) == (2, 200, 2)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 301])
async def test_a_rejection_is_not_retried(receiver: Callable[..., Receiver], status: int) -> None:
    hook = receiver(Step(status))
    error = await failing(webhook(hook.url, max_attempts=5))
    assert facts(error) == ("rejected", False, status, 1)
    assert len(hook.requests) == 1
    assert f"HTTP {status}" in str(error)


async def test_the_attempts_run_out(receiver: Callable[..., Receiver]) -> None:
    hook = receiver(*[Step(503)] * 5)
    error = await failing(webhook(hook.url, max_attempts=3))
    assert facts(error) == ("server_error", True, 503, 3)
    assert len(hook.requests) == 3
    assert "after 3 attempts" in str(error)


class _RefusedOnce(httpx.AsyncBaseTransport):
    """The real transport; the first failed attempt makes the receiver start listening."""

    def __init__(self, on_failure: Callable[[], None]) -> None:
        self._real = httpx.AsyncHTTPTransport()
        self._on_failure: Callable[[], None] | None = on_failure
        self.errors: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._real.handle_async_request(request)
        except httpx.TransportError as exc:
            self.errors.append(type(exc).__name__)
            if self._on_failure is not None:
                self._on_failure()
                self._on_failure = None
            raise

    async def aclose(self) -> None:
        await self._real.aclose()


async def test_connect_refused_then_success(receiver: Callable[..., Receiver]) -> None:
    hook = receiver(listen=False)
    transport = _RefusedOnce(hook.listen)
    channel = webhook(hook.url, transport=transport)
    delivery = await send(channel)
    await channel.aclose()
    assert transport.errors == ["ConnectError"]
    assert delivery.attempts == 2
    assert [r.headers["idempotency-key"] for r in hook.requests] == ["k-1"]


async def test_connect_refused_every_time() -> None:
    error = await failing(webhook(refused_url(), max_attempts=2))
    assert facts(error) == ("connect", True, None, 2)


async def test_retry_after_is_honoured(receiver: Callable[..., Receiver]) -> None:
    hook = receiver(Step(429, {"Retry-After": "0.3"}), Step(503, {"Retry-After": "0.2"}))
    delivery = await send(webhook(hook.url, retry_base_ms=1, retry_cap_ms=1000))
    assert delivery.attempts == 3
    first, second, third = (r.at for r in hook.requests)
    assert second - first >= 0.3
    assert third - second >= 0.2


async def test_a_retry_after_over_the_cap_is_left_to_the_caller(
    receiver: Callable[..., Receiver],
) -> None:
    hook = receiver(Step(429, {"Retry-After": "60"}))
    error = await failing(webhook(hook.url, retry_cap_ms=1000, max_attempts=5))
    assert facts(error) == ("rate_limited", True, 429, 1)
    assert error.retry_after == 60.0
    assert "over the 1000 ms cap" in str(error)
    assert len(hook.requests) == 1


async def test_each_attempt_has_its_own_time_limit(receiver: Callable[..., Receiver]) -> None:
    hook = receiver(Step(hang=True), Step(hang=True), Step(hang=True))
    channel = webhook(hook.url, timeout_ms=200, max_attempts=2, retry_base_ms=1)
    started = time.monotonic()
    error = await failing(channel)
    elapsed = time.monotonic() - started
    assert facts(error) == ("timeout", True, None, 2)
    assert 0.35 <= elapsed < 2.0
    assert [r.headers["idempotency-key"] for r in hook.requests] == ["k-1", "k-1"]


async def test_a_hung_attempt_is_followed_by_a_good_one(receiver: Callable[..., Receiver]) -> None:
    hook = receiver(Step(hang=True))
    delivery = await send(webhook(hook.url, timeout_ms=200, retry_base_ms=1))
    assert delivery.attempts == 2
    assert len(hook.requests) == 2


async def test_secrets_and_text_never_leak(
    receiver: Callable[..., Receiver],
    monkeypatch: pytest.MonkeyPatch,
    logs: list[MutableMapping[str, Any]],
) -> None:
    monkeypatch.setenv("STALWART_TEST_HOOK_SECRET", SECRET)
    hook = receiver(*[Step(500)] * 2, Step(403))
    knobs = {"secret_header": "X-Hook-Secret", "secret_env": "STALWART_TEST_HOOK_SECRET"}
    channel = webhook(hook.url, **knobs)
    config = parse_config({"channels": {"hook": {"kind": "webhook", "url": hook.url, **knobs}}})
    errors = [await failing(channel)]
    refused = refused_url(f"/h/{URL_TOKEN}?token={URL_TOKEN}")
    errors.append(await failing(webhook(refused, max_attempts=1, **knobs)))
    assert hook.requests[0].headers["x-hook-secret"] == SECRET
    texts = [repr(channel), repr(config), repr(config.channels["hook"]), repr(logs)]
    texts += ["".join(traceback.format_exception(e)) + repr(e) for e in errors]
    for text in texts:
        for secret in (SECRET, URL_TOKEN, TEXT):
            assert secret not in text
    assert "127.0.0.1" in repr(channel)


async def test_a_missing_secret_env_var_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STALWART_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        webhook("http://127.0.0.1:1/", secret_header="X-S", secret_env="STALWART_TEST_UNSET")
    assert info.value.key == "channels.hook.secret_env"
    assert "STALWART_TEST_UNSET" in str(info.value)


@pytest.mark.parametrize("make", [lambda: ConsoleChannel(stream=io.StringIO()), MemoryChannel])
async def test_a_closed_channel_refuses(make: Callable[[], Channel]) -> None:
    channel = make()
    await channel.aclose()
    error = await failing(channel)
    assert (error.kind, error.retryable) == ("closed", False)


async def test_a_closed_webhook_refuses(receiver: Callable[..., Receiver]) -> None:
    hook = receiver()
    channel = webhook(hook.url)
    await channel.aclose()
    assert (await failing(channel)).kind == "closed"
    assert hook.requests == []


async def test_closing_ends_a_send_that_waits_out_a_backoff(
    receiver: Callable[..., Receiver],
) -> None:
    """A send told to come back in a minute fails as ``closed`` as soon as the channel
    closes, not a minute later (the runtime's close used to be the only way out)."""
    hook = receiver(Step(status=503, headers={"retry-after": "60"}))
    channel = webhook(hook.url, retry_cap_ms=120_000, max_attempts=3)
    errors: list[ChannelError] = []

    async def sending() -> None:
        errors.append(await failing(channel))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(sending)
        with anyio.fail_after(GUARD):
            while not hook.requests:
                await anyio.sleep(0.01)  # real-time: polls for the first request
        await channel.aclose()
    assert [facts(e)[:2] for e in errors] == [("closed", False)]
    assert len(hook.requests) == 1


async def test_console_writes_prefixed_lines() -> None:
    out = io.StringIO()
    channel = ConsoleChannel("term", stream=out)
    delivery = await send(channel)
    await send(channel, OutboundMessage(conversation="c2", text="one\ntwo", idempotency_key="k"))
    assert delivery == Delivery(channel="term", attempts=1, status=None)
    assert out.getvalue() == f"[c1] {TEXT}\n[c2] one\n[c2] two\n"


async def test_console_defaults_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    await send(ConsoleChannel())
    assert capsys.readouterr().out == f"[c1] {TEXT}\n"


def test_console_is_thread_safe() -> None:
    out = io.StringIO()
    channel = ConsoleChannel(stream=out)
    text = "\n".join(f"line {i}" for i in range(20))

    def writer(n: int) -> None:
        for i in range(25):
            anyio.run(
                channel.send,
                OutboundMessage(conversation=f"w{n}", text=text, idempotency_key=str(i)),
            )

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 * 25 * 20
    for start in range(0, len(lines), 20):  # each message's lines stay together, in order
        block = lines[start : start + 20]
        prefix = block[0].split(" ", 1)[0]
        assert block == [f"{prefix} line {i}" for i in range(20)]


async def test_memory_channel_records_and_fails_on_demand() -> None:
    channel = MemoryChannel("mem")
    channel.fail_next(2, kind="timeout")
    channel.fail_next(kind="rejected", retryable=False, status=400)
    kinds = [((e := await failing(channel)).kind, e.retryable, e.status) for _ in range(3)]
    assert kinds == [("timeout", True, None), ("timeout", True, None), ("rejected", False, 400)]
    second = OutboundMessage(conversation="c1", text="b", idempotency_key="k-2")
    assert await send(channel) == Delivery(channel="mem", attempts=1)
    await send(channel, second)
    assert channel.messages == [MESSAGE, second]
    assert channel.attempted == [MESSAGE] * 4 + [second]


async def test_memory_channel_hangs_until_cancelled() -> None:
    channel = MemoryChannel()
    channel.hang_next()
    with anyio.move_on_after(0.1) as scope:
        await channel.send(MESSAGE)
    assert scope.cancelled_caught
    assert (channel.messages, channel.attempted) == ([], [MESSAGE])
    assert (await send(channel)).attempts == 1


async def test_memory_channel_wait_for() -> None:
    channel = MemoryChannel()
    channel.hang_next()
    seen: list[list[OutboundMessage]] = []
    with anyio.fail_after(GUARD):
        async with anyio.create_task_group() as group:

            async def waiter() -> None:
                seen.append(await channel.wait_for(1, attempted=True))
                seen.append(await channel.wait_for(1))
                group.cancel_scope.cancel()

            group.start_soon(waiter)
            group.start_soon(channel.send, MESSAGE)  # hangs
            group.start_soon(channel.send, MESSAGE)
    assert seen[0][0] == MESSAGE  # the hung send counts as attempted, not as delivered
    assert seen[1] == [MESSAGE]
    assert channel.attempted == [MESSAGE, MESSAGE]


def test_factory_builds_each_kind() -> None:
    hook = {"kind": "webhook", "url": "https://example.invalid/h"}
    entries = {"term": {"kind": "console"}, "mem": {"kind": "memory"}, "hook": hook}
    config = parse_config({"channels": entries})
    built = {name: channel_from_settings(name, s) for name, s in config.channels.items()}
    kinds = {name: type(channel) for name, channel in built.items()}
    assert kinds == {"term": ConsoleChannel, "mem": MemoryChannel, "hook": WebhookChannel}
    assert all(isinstance(c, Channel) and c.name == n for n, c in built.items())


def test_channel_defaults_and_an_empty_section() -> None:
    assert parse_config({}).channels == {}
    assert Config().channels == {}
    hook = parse_config({"channels": {"h": {"kind": "webhook", "url": "http://x"}}}).channels["h"]
    assert hook == ChannelSettings(
        kind="webhook", url="http://x", timeout_ms=10_000, max_attempts=3, retry_base_ms=500,
        retry_cap_ms=5_000, secret_header=None, secret_env=None,
    )  # fmt: skip


def test_channels_load_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[channels.ops]\nkind = "webhook"\nurl = "https://hooks.example/x"\n'
        'secret_header = "X-Token"\nsecret_env = "OPS_TOKEN"\ntimeout_ms = 2000\n\n'
        '[channels.term]\nkind = "console"\n'
    )
    channels = load_config(path).channels
    assert channels["ops"] == ChannelSettings(
        kind="webhook", url="https://hooks.example/x", secret_header="X-Token",
        secret_env="OPS_TOKEN", timeout_ms=2000,
    )  # fmt: skip
    assert channels["term"] == ChannelSettings(kind="console")


HOOK = {"kind": "webhook", "url": "https://hooks.example/x"}


@pytest.mark.parametrize(
    ("entry", "key", "words"),
    [
        ({"kind": "pager"}, "kind", ["'console'", "'webhook'", "found 'pager'"]),
        ({**HOOK, "timeout": 5}, "timeout", ["unknown key"]),
        ({**HOOK, "timeout_ms": 0}, "timeout_ms", [">= 1", "found 0"]),
        ({**HOOK, "max_attempts": "3"}, "max_attempts", ["int", "found '3'"]),
        ({**HOOK, "max_attempts": 0}, "max_attempts", [">= 1"]),
        ({**HOOK, "retry_base_ms": 9000}, "retry_cap_ms", ["retry_base_ms"]),
        ({"kind": "webhook"}, "url", ["needs a url"]),
        ({"kind": "webhook", "url": "ftp://h/x"}, "url", ["http://"]),
        ({"kind": "console", "url": "http://h"}, "url", ["only a webhook"]),
        ({**HOOK, "secret_header": "X-T"}, "secret_env", ["both or neither"]),
        ({**HOOK, "secret_env": "T"}, "secret_header", ["both or neither"]),
        ({**HOOK, "secret_header": "X T", "secret_env": "T"}, "secret_header", ["header name"]),
        ("console", "", ["object"]),
    ],
)
def test_bad_channel_config_names_the_key(entry: object, key: str, words: list[str]) -> None:
    """``key`` is relative to ``channels.ops``."""
    with pytest.raises(ConfigError) as info:
        parse_config({"channels": {"ops": entry}}, source="app.toml")
    key = f"channels.ops.{key}".rstrip(".")
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith("app.toml: ")
    assert key in message
    for word in words:
        assert word in message


def test_a_bad_url_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"channels": {"ops": {"kind": "webhook", "url": f"ftp://h/{URL_TOKEN}"}}})
    assert URL_TOKEN not in str(info.value)
