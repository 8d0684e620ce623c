"""Review: defects in the provider layer, proven over real loopback HTTP.

Each test drives the real ``ProviderClient`` / ``ModelCaller`` against a tiny raw-socket
HTTP server on 127.0.0.1 that writes exactly the bytes a test needs (a BOM, a broken
gzip body, an odd chunk shape ...), and a real LMDB store. Nothing of stalwart is mocked.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from stalwart import store as store_module
from stalwart.actors import PollHealth, ProviderHealthActor, Scheduler
from stalwart.clock import FakeClock, SystemClock
from stalwart.config import Config, HealthSettings, ProviderSettings, parse_config
from stalwart.errors import ProviderError
from stalwart.events import (
    PromptFailed,
    PromptStarted,
    ProviderCallFailed,
    ProviderCallSucceeded,
)
from stalwart.providers import (
    MAX_FRAME_BYTES,
    Accumulator,
    Message,
    ProviderClient,
    ProviderRequest,
    ProviderResponse,
)
from stalwart.runtime import ProviderLayer
from stalwart.store import EventStore
from stalwart.testing import Answer, ErrorEvent, FakeProvider

pytestmark = pytest.mark.anyio

REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
SESSION = "session:review"
GUARD = 5.0

Handler = bytes | Callable[[socket.socket], None]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a raw HTTP/1.1 server: reads one request per connection, writes the bytes given ------


class RawServer:
    """Answers every request with the next handler (the last one repeats)."""

    def __init__(self, handlers: list[Handler]) -> None:
        self.handlers = list(handlers)
        self.requests: list[tuple[bytes, bytes]] = []
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                key, _, value = line.partition(b":")
                if key.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            with self._lock:
                self.requests.append((head, body))
                handler = self.handlers.pop(0) if len(self.handlers) > 1 else self.handlers[0]
            try:
                if isinstance(handler, bytes):
                    conn.sendall(handler)
                else:
                    handler(conn)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def raw() -> Iterator[Callable[[list[Handler]], RawServer]]:
    servers: list[RawServer] = []

    def make(handlers: list[Handler]) -> RawServer:
        server = RawServer(handlers)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def http(body: bytes, content_type: bytes = b"text/event-stream", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + content_type
        + b"\r\nconnection: close\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def frame(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def openai_text(*words: str) -> bytes:
    body = b"".join(frame({"choices": [{"index": 0, "delta": {"content": w}}]}) for w in words)
    body += frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return body + b"data: [DONE]\n\n"


def client(kind: str, base_url: str, **settings: Any) -> ProviderClient:
    return ProviderClient(
        "p",
        ProviderSettings(kind=kind, base_url=base_url, **settings),  # type: ignore[arg-type]
    )


async def collect(kind: str, base_url: str, **settings: Any) -> ProviderResponse:
    """The whole streamed reply through the real client."""
    c = client(kind, base_url, **settings)
    accumulator = Accumulator("p", "m")
    try:
        with anyio.fail_after(GUARD):
            async for event in c.stream("m", REQUEST):
                accumulator.add(event)
    finally:
        await c.aclose()
    return accumulator.response()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EventStore]:
    opened = store_module.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


def config(base_url: str, api: str = "openai", **agent: Any) -> Config:
    main = {"kind": api, "base_url": base_url, "connect_timeout_ms": 1000}
    knobs = {
        "provider": "main",
        "model": "m1",
        "prompt_timeout_ms": 1000,
        "retry_prompt_timeout_ms": 1000,
        "activity_interval_ms": 20,
        "retry_base_ms": 10,
        "retry_cap_ms": 50,
        "max_retries": 1,
    }
    every = {"main": main, "backup": dict(main)}
    return parse_config({"providers": every, "agents": {"default": knobs | agent}})


@asynccontextmanager
async def provider_layer(cfg: Config, store: EventStore) -> AsyncIterator[ProviderLayer]:
    layer = ProviderLayer(cfg, store, clock=SystemClock(), rng=random.Random(7))
    try:
        yield layer
    finally:
        await layer.aclose()


def tags(store: EventStore, stream: str = SESSION) -> list[str]:
    return [record.type for record in store.read_stream(stream)]


# -- SSE ----------------------------------------------------------------------------------


async def test_a_leading_utf8_bom_does_not_swallow_the_first_frame(raw: Any) -> None:
    """The parser claims the WHATWG event-stream rules, which strip one leading U+FEFF
    (BOM) from the stream. ``SseParser`` keeps it, so the first line reads as the field
    ``\\ufeffdata`` and is ignored: the first frame (here the first word of the answer)
    silently disappears and a truncated reply is returned as complete.

    Expected: the BOM is dropped and the whole text "Hello world" comes back."""
    server = raw([http(b"\xef\xbb\xbf" + openai_text("Hello", " world"))])
    reply = await collect("openai", server.base_url)
    assert reply.text == "Hello world"


# -- every failure is a typed ProviderError -----------------------------------------------


async def test_a_broken_compressed_body_is_a_typed_retryable_error(
    raw: Any, store: EventStore
) -> None:
    """A reply with ``Content-Encoding: gzip`` whose bytes are not gzip (a misbehaving
    proxy, or a body cut inside the compressed data) makes httpx raise
    ``httpx.DecodingError``, which is not an ``httpx.TransportError``: ``ProviderClient.stream``
    lets it escape raw, and ``ModelCaller`` neither records ``prompt:failed`` /
    ``provider:call_failed`` nor retries. The session log is left with a ``prompt:started``
    that never ends and the caller gets a dependency's exception.

    Expected: a ``ProviderError`` (``malformed``/``transport``, retryable); the retry (here a
    good answer) is tried and its reply returned."""
    server = raw(
        [
            http(b"this is not gzip at all", extra=b"content-encoding: gzip\r\n"),
            http(openai_text("recovered")),
        ]
    )
    async with provider_layer(config(server.base_url), store) as layer:
        with anyio.fail_after(GUARD):
            try:
                reply = await layer.caller().call(SESSION, REQUEST)
            except ProviderError:
                reply = None
    assert tags(store)[:2] == ["prompt:started", "prompt:failed"]
    assert reply is not None
    assert reply.text == "recovered"


@pytest.mark.parametrize(
    ("api", "odd_frame"),
    [
        ("openai", frame({"choices": [None]})),
        ("openai", frame({"choices": [{"delta": "oops"}]})),
        ("anthropic", frame({"type": "content_block_delta", "index": 0, "delta": "oops"})),
        ("anthropic", frame({"type": "message_start", "message": {"usage": "n/a"}})),
    ],
    ids=[
        "openai-null-choice",
        "openai-string-delta",
        "anthropic-string-delta",
        "anthropic-string-usage",
    ],
)
async def test_a_frame_of_an_unexpected_shape_is_a_typed_error(
    api: str, odd_frame: bytes, raw: Any, store: EventStore
) -> None:
    """The stream decoders (``OpenAIStream.feed``/``_choice``, ``AnthropicStream.feed``/
    ``_delta``) assume every nested JSON value is an object and call ``.get`` on it. A
    frame that is valid JSON of another shape (a gateway bug, a newer wire version) raises
    ``AttributeError`` out of the provider layer: no ``prompt:failed``, no retry, no
    fallback, a raw exception for the agent.

    Expected: such a frame is ``malformed`` (a retryable ``ProviderError``) like a frame
    that is not JSON, and the retry's answer is returned."""
    if api == "openai":
        good = openai_text("recovered")
        bad = odd_frame + good
    else:
        good = (
            frame({"type": "message_start", "message": {"usage": {"input_tokens": 3}}})
            + frame({"type": "content_block_start", "index": 0, "content_block": {"type": "text"}})
            + frame(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "recovered"},
                }
            )
            + frame({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})
            + frame({"type": "message_stop"})
        )
        bad = odd_frame + good
    server = raw([http(bad), http(good)])
    async with provider_layer(config(server.base_url, api), store) as layer:
        with anyio.fail_after(GUARD):
            try:
                reply = await layer.caller().call(SESSION, REQUEST)
            except ProviderError:
                reply = None
    failed = [r.event for r in store.read_stream(SESSION) if isinstance(r.event, PromptFailed)]
    assert [f.error_class for f in failed] == ["malformed"]
    assert reply is not None
    assert reply.text == "recovered"


async def test_a_frame_that_never_ends_is_refused_not_buffered(raw: Any) -> None:
    """A gateway that streams one line without end (a runaway proxy, a body that is not an
    event stream under the right content type) used to grow the parser's buffer until
    memory ran out: bytes kept coming, so no stall fired. Past ``MAX_FRAME_BYTES`` the
    stream is ``malformed``, a typed retryable error, and the connection is closed."""
    sent: list[int] = []

    def endless(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: ")
        block = b"x" * 65536
        for _ in range(4 * MAX_FRAME_BYTES // len(block)):
            conn.sendall(block)
            sent.append(len(block))

    server = raw([endless])
    with pytest.raises(ProviderError) as caught:
        await collect("openai", server.base_url)
    assert caught.value.kind == "malformed"
    assert str(MAX_FRAME_BYTES) in str(caught.value)
    assert sum(sent) < 4 * MAX_FRAME_BYTES  # the client went away; the server stopped


# -- the API key --------------------------------------------------------------------------

SECRET = "sk-review-0123456789abcdef"


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
async def test_a_key_with_a_trailing_newline_is_sent_without_it(
    tail: str, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key read from a file-backed secret (a Kubernetes secret made from a file, a
    ``.env`` saved with CRLF) often ends in a line break. h11 refused the header with
    ``LocalProtocolError("Illegal header value b'Bearer sk-...\\n'")``, which quoted the
    key, and the ``ProviderError`` chained it (any traceback printed the key).

    Expected: the line break is not part of the key; the call goes out and succeeds."""
    monkeypatch.setenv("REVIEW_KEY", SECRET + tail)
    server = raw([http(openai_text("hi"))])
    response = await collect("openai", server.base_url, api_key_env="REVIEW_KEY")
    assert response.text == "hi"
    [(head, _)] = server.requests
    assert f"Bearer {SECRET}\r\n".encode() in head + b"\r\n"  # the key, and nothing after it


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_key_that_cannot_be_sent_never_reaches_an_error(
    api: str, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key with a line break inside it cannot be a header value: httpx's error quotes
    the key. Expected: no part of the error's formatted traceback (cause included)
    holds any part of the key."""
    monkeypatch.setenv("REVIEW_KEY", SECRET + "\nsecond-line")
    server = raw([http(openai_text("hi"))])
    c = client(api, server.base_url, api_key_env="REVIEW_KEY")
    try:
        with anyio.fail_after(GUARD), pytest.raises(ProviderError) as caught:
            async for _ in c.stream("m", REQUEST):
                pass
    finally:
        await c.aclose()
    shown = "".join(traceback.format_exception(caught.value))
    assert SECRET not in shown
    assert "second-line" not in shown
    assert (caught.value.kind, caught.value.retryable) == ("client_error", False)


async def test_a_header_that_can_never_be_sent_is_not_retried_as_a_transport_blip(
    raw: Any, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unsendable key (a line break inside it) was classified by
    ``classify_transport`` as ``transport``, *retryable*: every call was retried
    ``max_retries`` times and each failure counted towards the breaker and the health
    monitor, although no retry can ever succeed: the request is refused locally, before a
    byte reaches the provider (nothing arrives at the server).

    Expected: a local protocol error (an invalid header we built) is a final, non-retryable
    failure (``client_error``), not a transport blip."""
    monkeypatch.setenv("REVIEW_KEY", SECRET + "\rmore")
    server = raw([http(openai_text("hi"))])
    cfg = parse_config(
        {
            "providers": {
                "main": {"kind": "openai", "base_url": server.base_url, "api_key_env": "REVIEW_KEY"}
            },
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "m1",
                    "max_retries": 2,
                    "retry_base_ms": 1,
                    "retry_cap_ms": 5,
                }
            },
        }
    )
    async with provider_layer(cfg, store) as layer:
        with anyio.fail_after(GUARD), pytest.raises(ProviderError) as caught:
            await layer.caller().call(SESSION, REQUEST)
    assert server.requests == []  # it never left the process
    assert caught.value.retryable is False
    assert len([r for r in store.read_stream(SESSION) if isinstance(r.event, PromptStarted)]) == 1


def test_the_client_repr_hides_credentials_in_the_base_url() -> None:
    """``Config.to_record`` strips user info and the query from a provider's ``base_url``
    because they may carry secrets (gateways with ``?key=...``, ``https://user:pass@...``),
    and a webhook's repr shows only its origin. ``ProviderClient.__repr__`` prints the full
    request url, credentials and all.

    Expected: the repr shows no user info and no query string."""
    c = client("openai", "https://user:s3cr3t-pw@gateway.example/v1?key=s3cr3t-q")
    try:
        shown = repr(c)
    finally:
        anyio.run(c.aclose)
    assert "s3cr3t" not in shown


# -- tool calls and usage -----------------------------------------------------------------


async def test_parallel_tool_calls_without_an_index_stay_separate(raw: Any) -> None:
    """Some OpenAI-compatible servers (Gemini's compatibility endpoint, some gateways) send
    each streamed tool call whole, with its ``id`` but without ``index``. ``OpenAIStream``
    defaults a missing index to 0, so two parallel calls merge into one: the second name
    and id win and the arguments are concatenated into invalid JSON
    (``{"x": 1}{"y": 2}``), which the agent would run as one broken call.

    Expected: a delta with a new ``id`` and no index starts a new call: two tool calls,
    each with its own arguments."""
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"y": 2}'}},
    ]
    body = frame({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": calls}}]})
    body += frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    body += b"data: [DONE]\n\n"
    server = raw([http(body)])
    reply = await collect("openai", server.base_url + "/v1")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("call_a", "f", {"x": 1}),
        ("call_b", "g", {"y": 2}),
    ]


ANTHROPIC_USAGE = {
    "input_tokens": 12,
    "cache_creation_input_tokens": 1000,
    "cache_read_input_tokens": 40000,
    "output_tokens": 1,
}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_anthropic_input_tokens_include_the_cached_prompt(stream: bool, raw: Any) -> None:
    """Anthropic's ``usage.input_tokens`` counts only the prompt after the last cache
    breakpoint; the cached prefix is in ``cache_read_input_tokens`` and
    ``cache_creation_input_tokens``. stalwart sets those breakpoints itself
    (``Message.cache``), yet ``AnthropicStream`` / ``AnthropicWire.response`` report only
    ``input_tokens``: a 41 012-token prompt is reported as 12. OpenAI's ``prompt_tokens``
    (cached included) is what the neutral ``input_tokens`` means elsewhere, and
    ``call_through_context`` feeds it to the token estimator's calibration, which then
    drifts towards its minimum factor and under-counts every later prompt.

    Expected: ``input_tokens`` is the whole prompt: 12 + 1000 + 40000."""
    if stream:
        body = (
            frame(
                {
                    "type": "message_start",
                    "message": {"id": "msg", "role": "assistant", "usage": ANTHROPIC_USAGE},
                },
                "message_start",
            )
            + frame(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
                "content_block_start",
            )
            + frame(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "ok"},
                },
                "content_block_delta",
            )
            + frame({"type": "content_block_stop", "index": 0}, "content_block_stop")
            + frame(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn"},
                    "usage": {"output_tokens": 2},
                },
                "message_delta",
            )
            + frame({"type": "message_stop"}, "message_stop")
        )
        server = raw([http(body)])
        reply = await collect("anthropic", server.base_url)
    else:
        data = {
            "id": "msg",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn",
            "usage": ANTHROPIC_USAGE | {"output_tokens": 2},
        }
        server = raw([http(json.dumps(data).encode(), b"application/json")])
        c = client("anthropic", server.base_url)
        try:
            with anyio.fail_after(GUARD):
                reply = await c.complete("m", REQUEST)
        finally:
            await c.aclose()
    assert reply.text == "ok"
    assert reply.input_tokens == 12 + 1000 + 40000


async def test_a_rate_limit_inside_the_stream_follows_the_429_rule(store: EventStore) -> None:
    """docs/providers.md: ``rate_limited`` is "429, or a rate-limit error inside the
    stream", retryable "(see the 429 rule)": the same model is retried once, and only when
    a Retry-After says it is soon; otherwise the chain moves on at once (keep the agent
    moving, do not hammer a rate-limited model). An Anthropic ``rate_limit_error`` event is
    classified ``rate_limited`` but with ``status=None``, and ``retry_delay`` applies the
    429 rule only to ``status == 429``: the limited model is retried ``max_retries`` times
    with plain backoff before the fallback is tried.

    Expected: no Retry-After, so the same model is not retried: m1 once, then the fallback
    m2 answers."""
    with FakeProvider() as fake:
        fake.set_default(Answer(text="from the fallback"))
        fake.add(ErrorEvent(after_deltas=1, error_type="rate_limit_error", model="m1", times=0))
        cfg = config(fake.base_url, "anthropic", fallback_models=("backup:m2",), max_retries=3)
        async with provider_layer(cfg, store) as layer:
            with anyio.fail_after(GUARD):
                reply = await layer.caller().call(SESSION, REQUEST)
        requested = [r.model for r in fake.requests]
    failed = [r.event for r in store.read_stream(SESSION) if isinstance(r.event, PromptFailed)]
    assert failed[0].error_class == "rate_limited"
    assert reply.text == "from the fallback"
    assert requested == ["m1", "m2"]


# -- provider health ----------------------------------------------------------------------


def _health_failed(agent: str) -> ProviderCallFailed:
    return ProviderCallFailed(provider="p", model="m", agent=agent, error_class="server_error")


def test_failures_after_the_recovering_success_are_not_forgotten(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """While degraded, one lucky success followed by fresh failures from two agents (all
    folded in one catch-up, as happens whenever the follower coalesces wake-ups under
    load) ends with the provider *healthy*: ``decide_health`` recovers on the success
    (``recovering_agent``), and ``apply_health`` for ``provider:recovered`` then clears
    *every* failure, including the four recorded after that success. Had the actor
    looked after each event it would have recovered and at once degraded again (two
    agents failing within the window), so the outcome depends on batching, and a
    provider that is still failing is reported healthy to every agent (LLM calls resume,
    the dead-letter queue drains into a dead provider).

    Expected: the failures that came after the recovering success still count: the
    provider ends degraded."""
    with Scheduler(clock) as scheduler:
        ref = ProviderHealthActor.start(
            lmdb_store, clock, scheduler, "p", HealthSettings(), (), None, follow=False
        )
        try:
            lmdb_store.append("provider:p", [_health_failed("a"), _health_failed("b")])
            report = ref.ask(PollHealth(), timeout=GUARD)
            assert report.degraded
            clock.advance(1)
            lmdb_store.append(
                "provider:p",
                [
                    ProviderCallSucceeded(provider="p", model="m", agent="a"),
                    _health_failed("a"),
                    _health_failed("b"),
                    _health_failed("a"),
                    _health_failed("b"),
                ],
            )
            report = ref.ask(PollHealth(), timeout=GUARD)
        finally:
            ref.stop(timeout=GUARD)
    assert report.status == "degraded"
