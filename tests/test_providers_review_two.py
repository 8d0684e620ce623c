"""Review (second pass): the provider layer against a misbehaving provider.

Every test drives the real ``ProviderClient`` / ``ModelCaller`` (through the runtime's
``ProviderLayer``) over real loopback HTTP: a tiny raw-socket server on 127.0.0.1 writes
exactly the bytes a test needs, and the log is a real LMDB store in ``tmp_path``. Nothing
of stalwart is mocked. Tests marked ``# Was: DEFECT:`` failed on the code as reviewed,
before their fixes.
"""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from stalwart import store as store_module
from stalwart.clock import SystemClock
from stalwart.config import Config, ProviderSettings, parse_config
from stalwart.errors import ContextOverflowError, PromptTimeoutError, ProviderError
from stalwart.events import PromptFailed, PromptRetryScheduled, PromptStarted
from stalwart.providers import (
    Accumulator,
    Message,
    ProviderClient,
    ProviderRequest,
    ProviderResponse,
    SseEvent,
    SseParser,
)
from stalwart.runtime import ProviderLayer
from stalwart.store import EventStore

pytestmark = pytest.mark.anyio

REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
SESSION = "session:review-two"
SECRET = "sk-review-two-0123456789abcdefSECRET"
#: far more than any test needs: a test that hangs fails here, not at the global timeout
GUARD = 8.0

Handler = bytes | Callable[[socket.socket], None]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a raw HTTP/1.1 server: one request per connection, the bytes each handler writes -----


class RawServer:
    """Answers the n-th request with the n-th handler (the last one repeats)."""

    def __init__(self, handlers: list[Handler]) -> None:
        self.handlers = list(handlers)
        self.heads: list[bytes] = []
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
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
            match = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            length = int(match.group(1)) if match else 0
            while len(body) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                body += chunk
            with self._lock:
                self.heads.append(head)
                handler = self.handlers.pop(0) if len(self.handlers) > 1 else self.handlers[0]
            try:
                if isinstance(handler, bytes):
                    conn.sendall(handler)
                else:
                    handler(conn)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
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


def http(
    body: bytes,
    *,
    status: bytes = b"200 OK",
    content_type: bytes = b"text/event-stream",
    extra: bytes = b"",
) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type + b"\r\n"
        b"connection: close\r\n" + extra + b"content-length: %d\r\n\r\n" % len(body) + body
    )


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def frame(data: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def openai_text(*words: str) -> bytes:
    body = b"".join(frame({"choices": [{"index": 0, "delta": {"content": w}}]}) for w in words)
    body += frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return body + b"data: [DONE]\n\n"


def anthropic_text(*words: str) -> bytes:
    body = frame({"type": "message_start", "message": {"usage": {"input_tokens": 3}}})
    body += frame({"type": "content_block_start", "index": 0, "content_block": {"type": "text"}})
    for w in words:
        delta = {"type": "text_delta", "text": w}
        body += frame({"type": "content_block_delta", "index": 0, "delta": delta})
    body += frame({"type": "message_delta", "delta": {"stop_reason": "end_turn"}})
    return body + frame({"type": "message_stop"})


def repeating(head: bytes, piece: bytes, every: float, seconds: float = 4.0) -> Handler:
    """Headers, then ``piece`` every ``every`` s until the client leaves (at most ``seconds``)."""

    def handle(conn: socket.socket) -> None:
        conn.sendall(head)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(piece)
            time.sleep(every)  # real-time: the stall budget is measured against this pacing

    return handle


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EventStore]:
    opened = store_module.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


def config(
    base_url: str, api: str = "openai", *, api_key_env: str | None = None, **agent: Any
) -> Config:
    main: dict[str, Any] = {"kind": api, "base_url": base_url, "connect_timeout_ms": 1000}
    if api_key_env:
        main["api_key_env"] = api_key_env
    knobs = {
        "provider": "main",
        "model": "m1",
        "prompt_timeout_ms": 2000,
        "retry_prompt_timeout_ms": 2000,
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


async def call(cfg: Config, store: EventStore) -> ProviderResponse | BaseException:
    """The caller's reply, or whatever it raised (a raw exception included)."""
    async with provider_layer(cfg, store) as layer:
        with anyio.fail_after(GUARD):
            try:
                return await layer.caller().call(SESSION, REQUEST)
            except Exception as exc:  # a raw dependency error is itself the finding
                return exc


def failed_classes(store: EventStore) -> list[str]:
    return [
        r.event.error_class for r in store.read_stream(SESSION) if isinstance(r.event, PromptFailed)
    ]


# -- valid JSON of the wrong shape: scalars where strings and numbers go ------------------


@pytest.mark.parametrize(
    ("api", "bad"),
    [
        # Mistral's reasoning models stream ``delta.content`` as a list of parts
        (
            "openai",
            frame({"choices": [{"index": 0, "delta": {"content": [{"type": "text"}]}}]})
            + b"data: [DONE]\n\n",
        ),
        (
            "openai",
            frame({"choices": [{"index": 0, "delta": {"content": "a"}}]})
            + frame({"choices": [], "usage": {"prompt_tokens": "11", "completion_tokens": 2}})
            + b"data: [DONE]\n\n",
        ),
        (
            "anthropic",
            frame(
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
            ).replace(b'"text_delta"}', b'"text_delta", "text": 42}')
            + frame({"type": "message_stop"}),
        ),
    ],
    ids=["openai-content-list", "openai-usage-string", "anthropic-text-number"],
)
async def test_a_streamed_value_of_the_wrong_type_is_malformed_and_retried(
    api: str, bad: bytes, raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: the wire decoders pass a non-string text / non-int usage on unchecked; the
    # Accumulator's join/max raises a raw TypeError (no prompt:failed, no retry). Be malformed.
    good = openai_text("recovered") if api == "openai" else anthropic_text("recovered")
    server = raw([http(bad), http(good)])
    outcome = await call(config(server.base_url, api), store)
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.text == "recovered"
    assert failed_classes(store) == ["malformed"]


async def test_a_whole_reply_with_a_token_count_that_is_a_string_is_malformed(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: OpenAIWire.response copies usage values unchecked into ProviderResponse; the
    # store refuses the prompt:completed built from it and the caller gets a raw
    # ExceptionGroup(EventError), leaving a prompt:started that nothing ends. Be malformed.
    bad = json.dumps(
        {
            "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": "11", "completion_tokens": 2},
        }
    ).encode()
    good = json.dumps(
        {"choices": [{"message": {"content": "recovered"}, "finish_reason": "stop"}]}
    ).encode()
    json_type = b"application/json"
    server = raw([http(bad, content_type=json_type), http(good, content_type=json_type)])
    outcome = await call(config(server.base_url, stream=False), store)
    assert not isinstance(outcome, BaseException), repr(outcome)
    assert outcome.text == "recovered"
    assert failed_classes(store) == ["malformed"]


# -- tool calls ---------------------------------------------------------------------------


async def test_parallel_tool_calls_that_all_say_index_zero_stay_separate(raw: Any) -> None:
    # Was: DEFECT: OpenAIStream._slot trusts ``index`` over a new call ``id``: Ollama (and LiteLLM's
    # ollama_chat) stream every parallel call as index 0, so two calls merge into one with
    # the last id/name and arguments '{"city": "A"}{"city": "B"}'. A new id must open a slot.
    def call_delta(call_id: str | None, name: str | None, arguments: str) -> bytes:
        function: dict[str, Any] = {"arguments": arguments}
        if name:
            function["name"] = name
        tool: dict[str, Any] = {"index": 0, "function": function}
        if call_id:
            tool["id"] = call_id
        return frame({"choices": [{"index": 0, "delta": {"tool_calls": [tool]}}]})

    body = (
        call_delta("call_a", "weather", '{"city": ')
        + call_delta(None, None, '"A"}')
        + call_delta("call_b", "weather", '{"city": ')
        + call_delta(None, None, '"B"}')
        + frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        + b"data: [DONE]\n\n"
    )
    server = raw([http(body)])
    client = ProviderClient("p", ProviderSettings(kind="openai", base_url=server.base_url))
    accumulator = Accumulator("p", "m")
    try:
        with anyio.fail_after(GUARD):
            async for event in client.stream("m", REQUEST):
                accumulator.add(event)
    finally:
        await client.aclose()
    calls = [(c.id, c.name, c.arguments) for c in accumulator.response().tool_calls]
    assert calls == [
        ("call_a", "weather", '{"city": "A"}'),
        ("call_b", "weather", '{"city": "B"}'),
    ]


# -- classification -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "body"),
    [
        (
            "anthropic",
            b'{"type":"error","error":{"type":"invalid_request_error","message":"input length'
            b" and `max_tokens` exceed context limit: 197000 + 8192 > 200000, decrease input"
            b' length or `max_tokens` and try again"}}',
        ),
        (
            "openai",  # llama.cpp server
            b'{"error":{"code":400,"message":"the request exceeds the available context size,'
            b' try increasing it","type":"exceed_context_size_error"}}',
        ),
        (
            "openai",  # Gemini
            b'{"error":{"code":400,"message":"The input token count (1048577) exceeds the'
            b' maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}',
        ),
    ],
    ids=["anthropic-context-limit", "llama-cpp-context-size", "gemini-token-count"],
)
async def test_each_vendors_context_overflow_wording_is_a_context_overflow(
    api: str, body: bytes, raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: _classify._OVERFLOW_MARKERS misses these vendors' words ("exceed context limit",
    # "context size", "input token count ... exceeds"): a 400 bad_request, so the chain
    # falls back (same prompt, same failure) instead of ContextOverflowError to shrink it.
    server = raw([http(body, status=b"400 Bad Request", content_type=b"application/json")])
    cfg = config(server.base_url, api, fallback_models=("backup:m2",))
    outcome = await call(cfg, store)
    assert isinstance(outcome, ContextOverflowError), repr(outcome)
    assert len(server.heads) == 1  # neither retried nor fallen back


async def test_a_rate_limit_error_inside_an_openai_stream_is_rate_limited(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: OpenAIStream._error drops the error's code: an in-stream
    # {"error":{"code":"rate_limit_exceeded"}} (gateways send these) is stream_error, retried
    # with plain backoff; docs: rate_limited, the 429 rule (no Retry-After: next model).
    error = {"error": {"message": "Rate limit reached", "type": "requests"}}
    error["error"]["code"] = "rate_limit_exceeded"
    bad = frame({"choices": [{"index": 0, "delta": {"content": "a"}}]}) + frame(error)
    server = raw([http(bad), http(openai_text("from the fallback"))])
    cfg = config(server.base_url, fallback_models=("backup:m2",), max_retries=2)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert failed_classes(store) == ["rate_limited"]
    assert not [r for r in store.read_stream(SESSION) if isinstance(r.event, PromptRetryScheduled)]


async def test_a_redirect_is_not_followed_nor_retried_and_the_key_stays_home(
    raw: Any, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = raw([http(openai_text("stolen"))])
    location = elsewhere.base_url.encode() + b"/v1/chat/completions"
    server = raw([http(b"", status=b"307 Temporary Redirect", extra=b"location: " + location)])
    monkeypatch.setenv("REVIEW_TWO_KEY", SECRET)
    outcome = await call(config(server.base_url, api_key_env="REVIEW_TWO_KEY"), store)
    assert isinstance(outcome, ProviderError)
    assert not outcome.retryable
    assert SECRET not in str(outcome)
    assert len(server.heads) == 1
    assert elsewhere.heads == []  # the key was not carried to the Location's host


@pytest.mark.parametrize(
    ("retry_after", "retried"),
    # 1e400 is not delta-seconds (digits): unreadable, so ignored (it read as "inf s")
    [(b"soon", True), (b"nan", True), (b"-5", True), (b"1e400", True), (b"999999999", False)],
    ids=["garbage", "nan", "negative", "infinite", "longer-than-the-limit"],
)
async def test_odd_retry_after_values_on_a_503(
    retry_after: bytes, retried: bool, raw: Any, store: EventStore
) -> None:
    """docs/providers.md: a retryable status retries with backoff (at least Retry-After);
    an unreadable Retry-After is ignored, one longer than the limit moves on at once."""
    page = b"<html><body><h1>503 Service Temporarily Unavailable</h1></body></html>"
    failing = http(
        page,
        status=b"503 Service Unavailable",
        content_type=b"text/html",
        extra=b"retry-after: " + retry_after + b"\r\n",
    )
    server = raw([failing, http(openai_text("recovered"))])
    cfg = config(server.base_url, fallback_models=("backup:m2",), max_retries=1)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.model == ("m1" if retried else "m2")
    assert failed_classes(store) == ["unavailable"]
    retries = [r.event for r in store.read_stream(SESSION)]
    retries = [e for e in retries if isinstance(e, PromptRetryScheduled)]
    assert len(retries) == int(retried)
    assert all(0 <= e.delay_ms <= 50 for e in retries)  # retry_cap_ms


async def test_an_anthropic_error_event_is_classified_as_the_docs_say(raw: Any) -> None:
    # Was: DEFECT: AnthropicStream._error names every type outside its map "stream_error" but
    # makes all but four final; docs' table: stream_error is retryable. Give final ones a
    # final class (invalid_request_error -> bad_request) or document the split.
    error = {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}
    body = frame({"type": "message_start", "message": {"usage": {}}}) + frame(error, "error")
    server = raw([http(body)])
    client = ProviderClient("p", ProviderSettings(kind="anthropic", base_url=server.base_url))

    async def drain() -> None:
        with anyio.fail_after(GUARD):
            async for _ in client.stream("m", REQUEST):
                pass

    try:
        with pytest.raises(ProviderError) as info:
            await drain()
    finally:
        await client.aclose()
    final = {"bad_request", "auth", "forbidden", "not_found", "client_error"}
    assert (info.value.kind, info.value.retryable) == ("stream_error", True) or (
        info.value.kind in final and not info.value.retryable
    ), (info.value.kind, info.value.retryable)


# -- secrets ------------------------------------------------------------------------------


async def test_the_error_for_a_wrong_content_type_does_not_quote_the_servers_header(
    raw: Any, store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: DEFECT: ProviderClient.stream puts the server's raw Content-Type value in the error
    # text; a proxy reflecting request headers there puts the API key in an exception
    # message (docs: never). Name the bare media type (before ";"), or nothing.
    monkeypatch.setenv("REVIEW_TWO_KEY", SECRET)
    reflected = b"text/html; authorization=Bearer " + SECRET.encode()
    server = raw([http(b"<html>login</html>", content_type=reflected)])
    cfg = config(server.base_url, api_key_env="REVIEW_TWO_KEY", max_retries=0)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderError)
    assert outcome.kind == "malformed"
    assert SECRET.encode() in server.heads[0]  # the key was sent, in its header
    assert SECRET not in str(outcome)
    assert "Bearer" not in str(outcome)


# -- stalls: what counts as activity ------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "piece"),
    [
        ("openai", b": keep-alive\n\n"),
        ("openai", b": OPENROUTER PROCESSING\r\n\r\n"),
        ("openai", frame({"choices": [{"index": 0, "delta": {"content": ""}}]})),
        ("openai", frame({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})),
        ("anthropic", frame({"type": "ping"}, event="ping")),
        ("openai", b"d"),  # one byte of a frame that never completes
    ],
    ids=["comment", "comment-crlf", "empty-content", "role-only", "anthropic-ping", "bytes"],
)
async def test_bytes_without_tokens_do_not_hold_off_the_stall_budget(
    api: str, piece: bytes, raw: Any, store: EventStore
) -> None:
    """Seed 000: the stall budget resets on text/thinking deltas and tool completions; a
    provider that keeps the socket warm with keep-alives but sends no token is cut by the
    stall budget, not carried to the makespan ceiling."""
    server = raw([repeating(SSE_HEAD, piece, every=0.04)])
    cfg = config(
        server.base_url, api, prompt_timeout_ms=300, stall_ceiling_multiplier=10, max_retries=0
    )
    began = time.monotonic()
    outcome = await call(cfg, store)
    assert isinstance(outcome, PromptTimeoutError), repr(outcome)
    assert outcome.limit == "stall"
    assert time.monotonic() - began < 2.5  # the makespan ceiling is 3 s


@pytest.mark.parametrize(
    "delta",
    [{"type": "text_delta", "text": ""}, {"type": "thinking_delta", "thinking": ""}],
    ids=["text", "thinking"],
)
async def test_empty_anthropic_deltas_do_not_hold_off_the_stall_budget(
    delta: dict[str, str], raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: AnthropicStream._delta yields TextDelta("")/ThinkingDelta("") and the caller
    # counts them as activity, so empty deltas keep a tokenless call alive to the makespan
    # ceiling (the OpenAI wire drops empty content). Yield nothing for an empty delta.
    head = SSE_HEAD + frame({"type": "message_start", "message": {"usage": {}}})
    piece = frame({"type": "content_block_delta", "index": 0, "delta": delta})
    server = raw([repeating(head, piece, every=0.04)])
    cfg = config(
        server.base_url,
        "anthropic",
        prompt_timeout_ms=300,
        stall_ceiling_multiplier=5,
        max_retries=0,
    )
    outcome = await call(cfg, store)
    assert isinstance(outcome, PromptTimeoutError), repr(outcome)
    assert outcome.limit == "stall"


# -- a body larger than any answer --------------------------------------------------------


async def test_a_whole_reply_that_never_ends_is_refused_not_buffered(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: ProviderClient.complete reads response.content whole, without bound: a gateway
    # pouring bytes is buffered until the prompt deadline (memory grows at network speed);
    # the streamed path refuses past MAX_FRAME_BYTES. Refuse as malformed past a bound.
    def pour(conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        block = b" " * (1 << 20)
        piece = b"%x\r\n" % len(block) + block + b"\r\n"
        for _ in range(48):  # 48 MiB: three times the streamed path's bound
            conn.sendall(piece)
        time.sleep(3)  # real-time: then hold the body open (a gateway that never ends)

    server = raw([pour])
    cfg = config(server.base_url, stream=False, prompt_timeout_ms=1500, max_retries=0)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderError), repr(outcome)
    assert outcome.kind == "malformed", outcome.kind


# -- the stream's end ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("openai", openai_text("once") + b"data: [DONE]\n\ndata: {not json\n\n"),
        ("anthropic", anthropic_text("once") + frame({"type": "message_stop"}) + b"junk"),
    ],
    ids=["openai", "anthropic"],
)
async def test_what_follows_the_final_event_is_ignored(
    api: str, body: bytes, raw: Any, store: EventStore
) -> None:
    server = raw([http(body)])
    outcome = await call(config(server.base_url, api), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.text == "once"
    started = [r for r in store.read_stream(SESSION) if isinstance(r.event, PromptStarted)]
    assert len(started) == 1


# -- the SSE parser against a reference reading of the WHATWG rules ------------------------


def reference(data: bytes) -> list[SseEvent]:
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    parts = re.split(r"(\r\n|\r|\n)", data.decode("utf-8", errors="replace"))
    events: list[SseEvent] = []
    name, lines = "", []
    for line in parts[:-1:2]:  # complete lines only; the last part is unfinished
        if not line:
            if lines:
                events.append(SseEvent(event=name or "message", data="\n".join(lines)))
            name, lines = "", []
        elif not line.startswith(":"):
            field, colon, value = line.partition(":")
            value = value.removeprefix(" ") if colon else ""
            if field == "data":
                lines.append(value)
            elif field == "event":
                name = value
    return events


def test_the_parser_agrees_with_the_rules_on_random_streams_and_splits() -> None:
    rng = random.Random(20240601)
    pieces = [
        "data: a",
        "data:b",
        "data:  two spaces",
        "data",
        "event: x",
        "event:",
        ": ping",
        ":",
        "id: 7",
        "retry: 10",
        "data: é€😀",
        "no-colon",
        'data: {"k": 1}',
        "",
    ]
    for _ in range(1500):
        text = "".join(
            rng.choice(pieces) + rng.choice(["\n", "\r", "\r\n"]) for _ in range(rng.randint(1, 10))
        )
        data = (b"\xef\xbb\xbf" if rng.random() < 0.1 else b"") + text.encode()
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 9))))
        parser, got, previous = SseParser(), [], 0
        for cut in [*cuts, len(data)]:
            got += parser.feed(data[previous:cut])
            previous = cut
        assert got == reference(data), (data, cuts)
