"""Review of the channels and of how the runtime uses them: defects, each proven by a test.

Real parts only: a real HTTP receiver on 127.0.0.1, real LMDB stores in tmp_path, the
loopback fake provider, MemoryChannels, a FakeClock for every deadline.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import pytest

from stalwart.actors import FAILED_TEXT, GAVE_UP_TEXT, RunReport
from stalwart.channels import (
    ConsoleChannel,
    MemoryChannel,
    OutboundMessage,
    WebhookChannel,
    channel_from_settings,
)
from stalwart.clock import FakeClock
from stalwart.config import ChannelSettings, parse_config
from stalwart.errors import ChannelError, ConfigError
from stalwart.events import AnnouncementDeadLettered, SupervisorGaveUp, SupervisorRestarted
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Fail, FakeProvider
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
)

URL_TOKEN = "url-token-7e2b"
PASSWORD = "pw-4d9c"


# -- a real webhook receiver on 127.0.0.1 ----------------------------------------------------


class _Accept(BaseHTTPRequestHandler):
    received: list[dict[str, str]]

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.received.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class Receiver:
    """Answers every POST with 200 and records its headers."""

    def __init__(self) -> None:
        self.received: list[dict[str, str]] = []
        handler = type("Handler", (_Accept,), {"received": self.received})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hook() -> Iterator[Receiver]:
    receiver = Receiver()
    try:
        yield receiver
    finally:
        receiver.close()


def message(**fields: Any) -> OutboundMessage:
    return OutboundMessage(
        **{"conversation": "c1", "text": "hello", "idempotency_key": "k-1", **fields}
    )


async def outcome(build: Any, sent: OutboundMessage) -> BaseException | None:
    """Build the channel and send once: the exception either step raised, None if delivered."""
    try:
        channel = build()
    except Exception as exc:
        return exc
    try:
        with anyio.fail_after(GUARD):
            await channel.send(sent)
    except Exception as exc:
        return exc
    finally:
        await channel.aclose()
    return None


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example:8o8o/hooks/x",  # a typo in the port
        "https://hooks.example:99999/hooks/x",  # a port out of range
        "https:///hooks/x",  # no host at all
        "https://[hooks.example/hooks/x",  # an unclosed IPv6 bracket
    ],
)
def test_a_malformed_webhook_url_is_a_config_error_naming_the_key(url: str) -> None:
    """A webhook url that is not a url passes the config check (it only looks at the
    ``http(s)://`` prefix), the runtime starts, and then every send fails: as a raw
    ``httpx.InvalidURL`` for a bad port, or as a *retryable* ``connect``/``transport``
    error that the channel and the dead-letter queue retry for an hour. A malformed config
    should be refused at load as a ConfigError naming ``channels.ops.url``."""
    with pytest.raises(ConfigError) as info:
        parse_config({"channels": {"ops": {"kind": "webhook", "url": url}}})
    assert info.value.key == "channels.ops.url"


# -- the webhook's send contract: a Delivery or a typed ChannelError ---------------------------


@pytest.mark.anyio
async def test_a_webhook_url_httpx_cannot_parse_fails_as_a_typed_error(hook: Receiver) -> None:
    """``WebhookChannel`` (public, built from a ``ChannelSettings``) lets ``httpx.InvalidURL``
    escape ``send``: ``_attempt`` catches only ``httpx.TransportError``. The protocol (and
    docs/channels.md) promise a Delivery or a ChannelError, and the runtime records the
    raw exception's class name (``InvalidURL``) as the failure. Expected: a ConfigError
    when the channel is built, or a ChannelError from the send."""
    settings = ChannelSettings(kind="webhook", url=f"http://127.0.0.1:{hook.port}x/{URL_TOKEN}")
    error = await outcome(lambda: WebhookChannel("hook", settings), message())
    assert isinstance(error, ConfigError | ChannelError), repr(error)
    assert URL_TOKEN not in str(error)


@pytest.mark.anyio
async def test_an_idempotency_key_that_cannot_be_a_header_fails_as_a_typed_error(
    hook: Receiver,
) -> None:
    """The idempotency key goes into a header as it is; a key with a non-ASCII character
    (a host's own message id, say) makes ``send`` raise a raw ``UnicodeEncodeError``
    instead of the ChannelError the protocol promises. The header carries it
    percent-encoded; the body carries it as it is."""
    entry = {"kind": "webhook", "url": f"http://127.0.0.1:{hook.port}/h"}
    settings = parse_config({"channels": {"hook": entry}}).channels["hook"]
    error = await outcome(
        lambda: channel_from_settings("hook", settings), message(idempotency_key="clé-1")
    )
    assert error is None, repr(error)
    assert [h["idempotency-key"] for h in hook.received] == ["cl%C3%A9-1"]


def _secret_hook(port: int, monkeypatch: pytest.MonkeyPatch, value: str) -> ChannelSettings:
    monkeypatch.setenv("STALWART_REVIEW_HOOK_SECRET", value)
    entry = {
        "kind": "webhook",
        "url": f"http://127.0.0.1:{port}/h",
        "secret_header": "X-Hook-Secret",
        "secret_env": "STALWART_REVIEW_HOOK_SECRET",
        "retry_base_ms": 1,
        "retry_cap_ms": 5,
    }
    return parse_config({"channels": {"hook": entry}}).channels["hook"]


@pytest.mark.anyio
async def test_a_secret_read_from_a_file_with_its_line_break_is_sent_without_it(
    hook: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret env var filled from a file ends with a line break. It was taken as it
    is, and every send failed as a *retryable* ``transport`` error ("the connection
    broke") after all its attempts, which the dead-letter queue then retried until the
    entry expired. The value is the secret without the line break."""
    settings = _secret_hook(hook.port, monkeypatch, "hook-secret\n")
    assert await outcome(lambda: channel_from_settings("hook", settings), message()) is None
    assert [h["x-hook-secret"] for h in hook.received] == ["hook-secret"]


@pytest.mark.anyio
async def test_a_secret_that_cannot_be_a_header_value_is_a_config_error(
    hook: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret with a non-ASCII character cannot go into an HTTP header: every send
    raised a raw UnicodeEncodeError. It is a ConfigError for ``channels.hook.secret_env``
    when the channel is built (as for an unset variable), and the value never shows."""
    settings = _secret_hook(hook.port, monkeypatch, "höök-secret")
    error = await outcome(lambda: channel_from_settings("hook", settings), message())
    assert isinstance(error, ConfigError), repr(error)
    assert error.key == "channels.hook.secret_env"
    assert "höök" not in str(error)
    assert hook.received == []


@pytest.mark.anyio
async def test_the_webhook_urls_token_and_password_never_reach_a_log_line(
    hook: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/channels.md takes care that a webhook url (chat webhooks put their token in
    the path; user info holds a password) is never recorded or shown in full: errors and
    reprs give its origin only, ``runtime:started`` too. But the channel's httpx client
    logs every request at INFO on the ``httpx`` logger with the full url, so a host that
    runs ``logging.basicConfig(level=logging.INFO)`` writes the token and the password
    into its logs on every message. Expected: no log line holds them."""
    caplog.set_level(logging.INFO)
    url = f"http://hook:{PASSWORD}@127.0.0.1:{hook.port}/hooks/{URL_TOKEN}?token={URL_TOKEN}"
    settings = parse_config({"channels": {"hook": {"kind": "webhook", "url": url}}})
    channel = channel_from_settings("hook", settings.channels["hook"])
    try:
        with anyio.fail_after(GUARD):
            delivery = await channel.send(message())
    finally:
        await channel.aclose()
    assert delivery.status == 200
    logged = caplog.text
    assert URL_TOKEN not in logged
    assert PASSWORD not in logged


# -- the console ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_console_does_not_write_terminal_escapes_from_the_text() -> None:
    """The console channel writes a reply's text (model output: untrusted) raw to the
    terminal. An ESC sequence in it moves the cursor and erases lines, so a reply can
    wipe the ``[conversation]`` prefix and forge a line that seems to come from another
    conversation, or hide what was said; the promised "one prefixed line per line of
    text" no longer holds on screen. Expected: control characters other than the line
    breaks (ESC above all) are not written as they are (escaped or replaced)."""
    out = io.StringIO()
    channel = ConsoleChannel("term", stream=out)
    forged = "All done.\x1b[1G\x1b[2K[c-admin] your session expired: re-enter your password"
    await channel.send(message(text=forged))
    written = out.getvalue()
    assert written.startswith("[c1] ")
    assert "\x1b" not in written


# -- how the runtime addresses and re-sends --------------------------------------------------


def test_a_dead_lettered_failure_notice_is_resent_as_a_failure_notice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A failure notice whose send failed goes to the dead-letter queue, which keeps its
    text, conversation and thread but not its kind: the retry goes out with the default
    ``kind="reply"`` (``DeadLetterActor._send`` builds the OutboundMessage without it). A
    webhook receiver that shows failure notices apart (the ``kind`` field of the JSON it
    gets) shows the notice as an ordinary reply. Expected: the re-send carries the kind
    of the message that was dead-lettered."""
    fake.set_default(Fail(status=503))
    cfg = runtime_config(
        fake.base_url, dead_letters={"retry_base_ms": 1_000, "retry_cap_ms": 1_000}
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        chat.fail_next(1)
        rt.session("s1", channel="chat").send("hello")
        [first] = delivered(rt, chat, 1, attempted=True)
        assert (first.text, first.kind) == (FAILED_TEXT, "failure_notice")
        log_until(store, "deadletter", has(AnnouncementDeadLettered))
        advance_until(clock, lambda: list(chat.messages), step_s=0.5)
        [again] = delivered(rt, chat, 1)
        assert again.idempotency_key == first.idempotency_key
        assert again.text == FAILED_TEXT
        assert again.kind == "failure_notice"


def test_a_gave_up_notice_reaches_the_thread_the_session_talks_in(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A session started with ``conversation="room", thread="t1"`` gets every reply in
    that thread. When its agent keeps crashing and supervision gives up, the notice
    telling the user goes to the conversation with no thread: ``Crashed`` carries the
    conversation only and ``_restarts._send`` builds the message without a thread. In a
    threaded chat the user waiting in the thread never sees it. Expected: the notice goes
    to the session's conversation and thread."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat", conversation="room", thread="t1")
        for crash, backoff_ms in enumerate([100, 200, 400], 1):
            session.ref.tell(object())  # not understood: an unhandled exception
            log_until(store, "runtime", has(SupervisorRestarted, crash))
            rt.runs()  # the supervisor has armed the restart
            clock.advance(backoff_ms / 1000 + 0.005)
            assert session.status(timeout=GUARD).idle
        session.ref.tell(object())
        [gave_up] = of(SupervisorGaveUp, log_until(store, "runtime", has(SupervisorGaveUp)))
        assert gave_up.session == "s1"
        [notice] = delivered(rt, chat, 1)
        assert notice.text == GAVE_UP_TEXT
        assert (notice.conversation, notice.thread) == ("room", "t1")


def test_a_sub_agent_completion_is_announced_in_the_parents_thread(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A spawn's announcement goes to the parent session's channel and conversation
    (docs/embedding.md: they default to the parent's), but not to its thread: the
    announcer's OutboundMessage has no thread and a spawn does not carry one. The user of
    a session bound to ``thread="t1"`` gets the sub-agent's result outside the thread
    they asked in. Expected: the completion is announced in the parent's thread."""

    async def work(report: RunReport) -> str:
        return "the answer"

    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rt.session("p1", channel="chat", conversation="room", thread="t1")
        handle = rt.spawn("p1", "find the answer", task_class="research", work=work)
        assert handle.result(GUARD).outcome == "succeeded"
        clock.advance(rt.config.subagents.announce_debounce_ms / 1000 + 0.01)
        [announced] = delivered(rt, chat, 1)
        assert announced.text == "Sub-agent task completed:\nthe answer"
        assert (announced.conversation, announced.thread) == ("room", "t1")
