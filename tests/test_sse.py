"""SSE parsing and both wire formats over httpx MockTransport: the edge cases."""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import httpx
import pytest

from stalwart.config import ProviderSettings
from stalwart.errors import ContextOverflowError, ProviderError
from stalwart.providers import (
    Accumulator,
    Done,
    Message,
    ProviderClient,
    ProviderRequest,
    SseEvent,
    SseFrameTooLarge,
    SseParser,
    StreamEvent,
    ThinkingDelta,
    Usage,
)


def parse(*chunks: bytes) -> list[SseEvent]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_frames_split_across_chunks_at_every_byte() -> None:
    stream = b'event: a\ndata: {"x": 1}\n\ndata: two\n\n'
    whole = parse(stream)
    assert whole == [SseEvent("a", '{"x": 1}'), SseEvent("message", "two")]
    for cut in range(1, len(stream)):
        assert parse(stream[:cut], stream[cut:]) == whole
    assert parse(*[stream[i : i + 1] for i in range(len(stream))]) == whole


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending(newline: bytes) -> None:
    stream = newline.join([b"data: one", b"", b"data: two", b"", b""])
    assert [e.data for e in parse(stream)] == ["one", "two"]
    if newline == b"\r\n":  # a CRLF split between chunks is one line end, not two
        for cut in range(1, len(stream)):
            assert [e.data for e in parse(stream[:cut], stream[cut:])] == ["one", "two"]


def test_comments_multiline_data_and_fields() -> None:
    stream = b": keep-alive\ndata: line1\ndata: line2\nid: 7\nretry: 100\ndata:nospace\n\n"
    assert parse(stream) == [SseEvent("message", "line1\nline2\nnospace")]


def test_blank_lines_without_data_dispatch_nothing() -> None:
    assert parse(b"\n\n\nevent: x\n\n") == []


def test_utf8_split_inside_a_character() -> None:
    data = "data: caf\u00e9 \u2603\n\n".encode()
    cut = data.index(b"\xc3") + 1
    assert parse(data[:cut], data[cut:]) == [SseEvent("message", "caf\u00e9 \u2603")]


def test_pending_reports_a_half_frame() -> None:
    parser = SseParser()
    list(parser.feed(b'data: {"a":'))
    assert parser.pending
    list(parser.feed(b"1}\n\n"))
    assert not parser.pending


def test_a_long_line_in_small_chunks_is_scanned_once() -> None:
    """4 MiB of one data line in 64-byte chunks: linear work. Rejoining the unfinished
    line at every chunk took ~10 s here; scanning each byte once takes ~0.1 s."""
    line = b"data: " + b"x" * (4 * 1024 * 1024) + b"\r\n\r\n"
    parser = SseParser()
    began = time.perf_counter()
    events = [event for i in range(0, len(line), 64) for event in parser.feed(line[i : i + 64])]
    elapsed = time.perf_counter() - began
    assert [len(event.data) for event in events] == [4 * 1024 * 1024]
    assert not parser.pending
    assert elapsed < 3.0


def test_a_frame_past_the_bound_is_refused() -> None:
    parser = SseParser(max_frame_bytes=1024)
    assert parser.feed(b"data: " + b"x" * 1000 + b"\n\n") == [SseEvent("message", "x" * 1000)]
    with pytest.raises(SseFrameTooLarge, match="exceeds 1024 bytes"):
        parser.feed(b"data: " + b"y" * 1100)  # one unfinished line


def test_many_data_lines_count_towards_the_bound() -> None:
    parser = SseParser(max_frame_bytes=1024)
    for _ in range(10):  # 1,000 of 1,024 bytes
        assert parser.feed(b"data: " + b"z" * 99 + b"\n") == []
    with pytest.raises(SseFrameTooLarge):
        parser.feed(b"data: " + b"z" * 99 + b"\n")


def test_the_bound_is_per_frame() -> None:
    parser = SseParser(max_frame_bytes=1024)
    frame = b"data: " + b"w" * 900 + b"\n\n"
    events = [event for _ in range(50) for event in parser.feed(frame)]
    assert len(events) == 50


def test_a_crlf_split_across_chunks_and_an_empty_chunk_between() -> None:
    assert parse(b"data: a\r", b"", b"\ndata: b\r", b"\n\r", b"\n") == [SseEvent("message", "a\nb")]


# -- the wires over MockTransport -------------------------------------------------------------

REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))


def _client(kind: str, handler: httpx.MockTransport) -> ProviderClient:
    base = "http://fake/v1" if kind == "openai" else "http://fake"
    settings = ProviderSettings(kind=kind, base_url=base)  # type: ignore[arg-type]
    return ProviderClient("p", settings, transport=handler)


def _sse(
    body: bytes, status: int = 200, content_type: str = "text/event-stream"
) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": content_type})

    return httpx.MockTransport(handle)


def _collect(kind: str, transport: httpx.MockTransport) -> list[StreamEvent]:
    async def main() -> list[StreamEvent]:
        client = _client(kind, transport)
        try:
            return [event async for event in client.stream("m", REQUEST)]
        finally:
            await client.aclose()

    return anyio.run(main)


def _openai_frames(*chunks: str, done: bool = True) -> bytes:
    body = b"".join(b"data: " + c.encode() + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def test_openai_text_thinking_tools_usage() -> None:
    body = _openai_frames(
        '{"choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"hmm"}}]}',
        '{"choices":[{"index":0,"delta":{"content":"Hel"}}]}',
        '{"choices":[{"index":0,"delta":{"content":"lo"}}]}',
        '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":"{\\"a\\""}}]}}]}',
        '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c2","function":{"name":"g","arguments":"{}"}}]}}]}',
        '{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":": 1}"}}]}}]}',
        '{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}',
        '{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}',
    )
    events = _collect("openai", _sse(body))
    assert events[0] == ThinkingDelta("hmm")
    assert events[-1] == Done("tool_calls")
    accumulator = Accumulator("p", "m")
    for event in events:
        accumulator.add(event)
    reply = accumulator.response()
    assert (reply.text, reply.thinking, reply.finish_reason) == ("Hello", "hmm", "tool_calls")
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        ("c1", "f", '{"a": 1}'),
        ("c2", "g", "{}"),
    ]
    assert (reply.input_tokens, reply.output_tokens) == (11, 7)


def test_anthropic_event_types() -> None:
    frames = [
        ("message_start", '{"type":"message_start","message":{"usage":{"input_tokens":9}}}'),
        (
            "content_block_start",
            '{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"let me see"}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"x"}}',
        ),
        ("ping", '{"type":"ping"}'),
        (
            "content_block_start",
            '{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Hi"}}',
        ),
        (
            "content_block_start",
            '{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"t1","name":"lookup","input":{}}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\\"q\\":"}}',
        ),
        (
            "content_block_delta",
            '{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":" 3}"}}',
        ),
        ("content_block_stop", '{"type":"content_block_stop","index":2}'),
        (
            "message_delta",
            '{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":5}}',
        ),
        ("message_stop", '{"type":"message_stop"}'),
    ]
    body = b"".join(f"event: {e}\ndata: {d}\n\n".encode() for e, d in frames)
    events = _collect("anthropic", _sse(body))
    accumulator = Accumulator("p", "m")
    for event in events:
        accumulator.add(event)
    reply = accumulator.response()
    assert (reply.text, reply.thinking, reply.finish_reason) == ("Hi", "let me see", "tool_use")
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [("t1", "lookup", '{"q": 3}')]
    assert (reply.input_tokens, reply.output_tokens) == (9, 5)
    assert Usage(input_tokens=9) in events


def _error(kind: str, body: bytes, **kw: object) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        _collect(kind, _sse(body, **kw))  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_stream_without_terminal_event_is_a_cut(kind: str) -> None:
    if kind == "openai":
        body = _openai_frames('{"choices":[{"delta":{"content":"a"}}]}', done=False)
    else:
        body = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
    error = _error(kind, body)
    assert (error.kind, error.retryable) == ("stream_cut", True)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_truncated_json_mid_frame(kind: str) -> None:
    error = _error(kind, b'data: {"choices":[{"delta":{"content":"a"')
    assert error.kind == "stream_cut"
    assert "cut mid-way" in str(error)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_malformed_frame(kind: str) -> None:
    error = _error(kind, b'data: {"choices": [}\n\n')
    assert (error.kind, error.retryable) == ("malformed", True)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_wrong_content_type(kind: str) -> None:
    error = _error(kind, b"<html>oops</html>", content_type="text/html")
    assert error.kind == "malformed"
    assert "text/html" in str(error)


def test_anthropic_overloaded_error_event_is_retryable() -> None:
    body = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"secret detail"}}\n\n'
    error = _error("anthropic", body)
    assert (error.kind, error.retryable) == ("overloaded", True)
    assert "secret detail" not in str(error)


@pytest.mark.parametrize(
    ("status", "body", "kind", "retryable"),
    [
        (429, b'{"error":{"type":"rate_limit"}}', "rate_limited", True),
        (408, b"", "request_timeout", True),
        (500, b"", "server_error", True),
        (503, b"", "unavailable", True),
        (529, b'{"type":"error","error":{"type":"overloaded_error"}}', "overloaded", True),
        (400, b'{"error":{"message":"bad"}}', "bad_request", False),
        (401, b"", "auth", False),
        (403, b"", "forbidden", False),
        (404, b"", "not_found", False),
        (422, b"", "bad_request", False),
        (400, b'{"error":{"code":"content_policy_violation"}}', "content_policy", False),
    ],
)
def test_status_classification(status: int, body: bytes, kind: str, retryable: bool) -> None:
    error = _error("openai", body, status=status, content_type="application/json")
    assert (error.kind, error.retryable, error.status) == (kind, retryable, status)
    assert body.decode() not in str(error) or not body


@pytest.mark.parametrize(
    "body",
    [
        b'{"error":{"code":"context_length_exceeded","message":"maximum context length is 8192"}}',
        b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 300000 tokens"}}',
    ],
)
def test_context_overflow_is_its_own_class(body: bytes) -> None:
    with pytest.raises(ContextOverflowError) as info:
        _collect("openai", _sse(body, status=400, content_type="application/json"))
    assert info.value.kind == "context_overflow"
    assert not info.value.retryable


def test_api_key_is_sent_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(401, content=b"{}", headers={"content-type": "application/json"})

    monkeypatch.setenv("TEST_SECRET_KEY", "sk-test-0123456789abcdef")
    settings = ProviderSettings(
        kind="anthropic", base_url="http://fake", api_key_env="TEST_SECRET_KEY"
    )
    client = ProviderClient("p", settings, transport=httpx.MockTransport(handle))

    async def main() -> ProviderError:
        try:
            async for _ in client.stream("m", REQUEST):
                pass
        except ProviderError as exc:
            return exc
        finally:
            await client.aclose()
        raise AssertionError("no error")

    error = anyio.run(main)
    assert seen[0].headers["x-api-key"] == "sk-test-0123456789abcdef"
    assert seen[0].url.path == "/v1/messages"
    assert "sk-test" not in str(error) + repr(error) + repr(client)


def test_non_streaming_replies() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("chat/completions"):
            body = b'{"choices":[{"message":{"content":"ok","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
        else:
            body = b'{"content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"c","name":"f","input":{"a":1}}],"stop_reason":"tool_use","usage":{"input_tokens":3,"output_tokens":2}}'
        return httpx.Response(200, content=body, headers={"content-type": "application/json"})

    async def main(kind: str) -> tuple[str, str, str]:
        client = _client(kind, httpx.MockTransport(handle))
        try:
            reply = await client.complete("m", REQUEST)
        finally:
            await client.aclose()
        [call] = reply.tool_calls
        return reply.text, call.arguments, reply.finish_reason

    assert anyio.run(main, "openai") == ("ok", "{}", "tool_calls")
    assert anyio.run(main, "anthropic") == ("ok", '{"a":1}', "tool_use")


def test_request_bodies_convert_the_neutral_shape() -> None:
    from stalwart.events import ToolCall
    from stalwart.providers import ToolSpec

    bodies: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(
            200, content=b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
        )

    request = ProviderRequest(
        messages=(
            Message(role="system", content="be brief"),
            Message(role="user", content="look", images=("data:image/png;base64,AAAA",)),
            Message(
                role="assistant", tool_calls=(ToolCall(id="c1", name="f", arguments='{"x": 1}'),)
            ),
            Message(role="tool", tool_call_id="c1", content="result"),
        ),
        tools=(ToolSpec(name="f", description="d", parameters={"type": "object"}),),
    )

    async def main() -> None:
        client = _client("openai", httpx.MockTransport(handle))
        async for _ in client.stream("m", request):
            pass
        await client.aclose()

    anyio.run(main)
    import json

    body = json.loads(bodies[0])
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][1]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,AAAA"},
    }
    assert body["messages"][2]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": '{"x": 1}',
    }
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "result"}
    from stalwart.providers._anthropic import AnthropicWire

    anthropic = AnthropicWire().body("m", request, stream=True)
    assert anthropic["system"] == "be brief"
    assert [t["role"] for t in anthropic["messages"]] == ["user", "assistant", "user"]
    assert anthropic["messages"][0]["content"][1]["source"] == {
        "type": "base64",
        "media_type": "image/png",
        "data": "AAAA",
    }
    assert anthropic["messages"][1]["content"][0] == {
        "type": "tool_use",
        "id": "c1",
        "name": "f",
        "input": {"x": 1},
    }
    assert anthropic["messages"][2]["content"][0]["type"] == "tool_result"


def _chunks(body: bytes) -> Iterator[bytes]:
    yield body
