"""The fault-injecting fake provider itself, over real loopback HTTP.

Seen from plain httpx (the bytes on the wire) and from ProviderClient (the typed view):
both APIs streamed and whole, the script's selection rules, script files, the API key,
every fault step, and what the fake records about each request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from stalwart.config import ProviderSettings
from stalwart.errors import ConfigError, ContextOverflowError, ProviderError
from stalwart.providers import (
    Accumulator,
    Done,
    Message,
    ProviderClient,
    ProviderRequest,
    ProviderResponse,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    Usage,
)
from stalwart.testing import (
    Answer,
    Cut,
    ErrorEvent,
    Fail,
    FakeProvider,
    FakeToolCall,
    Hang,
    Malformed,
    RecordedRequest,
    Reset,
    Script,
    Stall,
    Step,
    Trickle,
    Truncated,
    WrongContentType,
    load_script,
    parse_script,
)

APIS = ["openai", "anthropic"]
PATHS = {"openai": "/chat/completions", "anthropic": "/messages"}
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
RICH = Answer(
    text="Hello brave new world",
    thinking="let me think",
    tool_calls=(
        FakeToolCall(name="lookup", arguments={"q": "x"}),
        FakeToolCall(name="clock", id="call_custom"),
    ),
    input_tokens=7,
)
RICH_OUTPUT_TOKENS = 7  # one per word of text and thinking


# -- helpers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module: making one costs tens of milliseconds."""
    with httpx.Client(timeout=5) as client:
        yield client


def post(
    http: httpx.Client,
    fake: FakeProvider,
    api: str,
    *,
    stream: bool = False,
    model: str = "m",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    return http.post(fake.base_url + PATHS[api], json=body, headers=headers)


def sse(body: bytes) -> list[tuple[str | None, str]]:
    """(event, data) of each frame of an event-stream body."""
    frames = []
    for block in body.split(b"\n\n"):
        event, data = None, []
        for line in block.decode().splitlines():
            name, _, value = line.partition(": ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
        if data:
            frames.append((event, "\n".join(data)))
    return frames


def client_for(fake: FakeProvider, api: str, *, key_env: str | None = None) -> ProviderClient:
    settings = ProviderSettings(
        kind=api,  # type: ignore[arg-type]
        base_url=fake.base_url,
        api_key_env=key_env,
    )
    return ProviderClient("fake", settings)


Outcome = tuple[list[StreamEvent], ProviderError | None]


def stream_via_client(fake: FakeProvider, api: str, *, within: float = 5.0) -> Outcome:
    """What ProviderClient.stream yields, and the error it ends with (None: cancelled)."""

    async def main() -> Outcome:
        client = client_for(fake, api)
        events: list[StreamEvent] = []
        try:
            with anyio.move_on_after(within):
                async for event in client.stream("m", REQUEST):
                    events.append(event)
                return events, None
        except ProviderError as exc:
            return events, exc
        finally:
            await client.aclose()
        return events, None

    return anyio.run(main)


def complete_via_client(
    fake: FakeProvider, api: str, *, within: float = 5.0
) -> ProviderResponse | ProviderError | None:
    async def main() -> ProviderResponse | ProviderError | None:
        client = client_for(fake, api)
        try:
            with anyio.move_on_after(within):
                return await client.complete("m", REQUEST)
        except ProviderError as exc:
            return exc
        finally:
            await client.aclose()
        return None

    return anyio.run(main)


def settled(fake: FakeProvider) -> list[RecordedRequest]:
    """Every request so far, once each has ended (a reply is read before it is recorded)."""
    return fake.wait_for(lambda rs: all(r.outcome != "running" for r in rs))


def accumulate(events: list[StreamEvent]) -> ProviderResponse:
    accumulator = Accumulator("fake", "m")
    for event in events:
        accumulator.add(event)
    return accumulator.response()


def call_prefix(api: str) -> str:
    return "call" if api == "openai" else "toolu"


# -- well-formed replies ------------------------------------------------------------------


def test_openai_stream_over_plain_httpx(http: httpx.Client) -> None:
    with FakeProvider([RICH]) as fake:
        response = post(http, fake, "openai", stream=True, model="gpt-x")
        record = fake.wait_finished(0)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    frames = sse(response.content)
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "let me think"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello brave new world"
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", ()):
            entry = calls.setdefault(part["index"], ["", "", ""])
            entry[0] = part.get("id", entry[0])
            entry[1] = part.get("function", {}).get("name", entry[1])
            entry[2] += part["function"]["arguments"]
    assert calls == {0: ["call_0000", "lookup", '{"q":"x"}'], 1: ["call_custom", "clock", "{}"]}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["tool_calls"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": RICH_OUTPUT_TOKENS,
        "total_tokens": 7 + RICH_OUTPUT_TOKENS,
    }
    assert (record.api, record.model, record.stream, record.action) == (
        "openai",
        "gpt-x",
        True,
        "answer",
    )
    assert (record.outcome, record.status, record.deltas_sent) == ("completed", 200, 7)
    assert record.body["messages"] == [{"role": "user", "content": "hi"}]
    assert record.finished_at is not None
    assert record.finished_at >= record.started_at


def test_anthropic_stream_over_plain_httpx(http: httpx.Client) -> None:
    with FakeProvider([RICH]) as fake:
        response = post(http, fake, "anthropic", stream=True, model="claude-x")
        record = fake.wait_finished(0)
    assert response.headers["content-type"] == "text/event-stream"
    frames = [(event, json.loads(data)) for event, data in sse(response.content)]
    assert all(event == data["type"] for event, data in frames)
    types = [event for event, _ in frames]
    assert types[:2] == ["message_start", "ping"]
    assert types[-2:] == ["message_delta", "message_stop"]
    assert frames[0][1]["message"]["usage"]["input_tokens"] == 7
    assert frames[0][1]["message"]["model"] == "claude-x"
    blocks: dict[int, dict[str, Any]] = {}
    for event, data in frames:
        if event == "content_block_start":
            blocks[data["index"]] = {**data["content_block"], "parts": "", "stopped": False}
        elif event == "content_block_delta":
            delta = data["delta"]
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
            blocks[data["index"]]["parts"] += text
        elif event == "content_block_stop":
            blocks[data["index"]]["stopped"] = True
    assert [b["type"] for b in blocks.values()] == ["thinking", "text", "tool_use", "tool_use"]
    assert all(b["stopped"] for b in blocks.values())
    assert [b["parts"] for b in blocks.values()] == [
        "let me think",
        "Hello brave new world",
        '{"q":"x"}',
        "{}",
    ]
    assert [b.get("id") for b in blocks.values()][2:] == ["toolu_0000", "call_custom"]
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert frames[-2][1]["usage"] == {"output_tokens": RICH_OUTPUT_TOKENS}
    assert (record.api, record.outcome, record.deltas_sent) == ("anthropic", "completed", 7)


@pytest.mark.parametrize("api", APIS)
def test_whole_replies_over_plain_httpx(http: httpx.Client, api: str) -> None:
    with FakeProvider([RICH]) as fake:
        response = post(http, fake, api, model="mx")
        record = fake.wait_finished(0)
    assert response.headers["content-type"] == "application/json"
    data = response.json()
    if api == "openai":
        [choice] = data["choices"]
        message = choice["message"]
        assert (message["content"], message["reasoning_content"]) == (
            "Hello brave new world",
            "let me think",
        )
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["lookup", "clock"]
        assert choice["finish_reason"] == "tool_calls"
        assert data["usage"]["prompt_tokens"] == 7
        assert data["usage"]["completion_tokens"] == RICH_OUTPUT_TOKENS
    else:
        assert [b["type"] for b in data["content"]] == ["thinking", "text", "tool_use", "tool_use"]
        assert data["content"][2]["input"] == {"q": "x"}
        assert data["stop_reason"] == "tool_use"
        assert data["usage"] == {"input_tokens": 7, "output_tokens": RICH_OUTPUT_TOKENS}
    assert (record.stream, record.outcome, record.deltas_sent) == (False, "completed", 0)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", APIS)
def test_provider_client_reads_every_part_of_a_reply(api: str, stream: bool) -> None:
    with FakeProvider([RICH]) as fake:
        if stream:
            events, error = stream_via_client(fake, api)
            assert error is None
            assert events[-1] == Done("tool_calls" if api == "openai" else "tool_use")
            kinds = {type(event) for event in events}
            assert {TextDelta, ThinkingDelta, ToolCallDelta, Usage} <= kinds
            reply = accumulate(events)
        else:
            result = complete_via_client(fake, api)
            assert isinstance(result, ProviderResponse)
            reply = result
    assert (reply.text, reply.thinking) == ("Hello brave new world", "let me think")
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        (f"{call_prefix(api)}_0000", "lookup", '{"q":"x"}'),
        ("call_custom", "clock", "{}"),
    ]
    assert reply.finish_reason == ("tool_calls" if api == "openai" else "tool_use")
    assert (reply.input_tokens, reply.output_tokens) == (7, RICH_OUTPUT_TOKENS)


@pytest.mark.parametrize("api", APIS)
def test_chunks_and_explicit_usage_and_finish(api: str) -> None:
    step = Answer(text="abcdefgh", chunks=4, output_tokens=99, finish_reason="length")
    with FakeProvider([step]) as fake:
        events, error = stream_via_client(fake, api)
        record = fake.wait_finished(0)
    assert error is None
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["ab", "cd", "ef", "gh"]
    reply = accumulate(events)
    assert (reply.output_tokens, reply.finish_reason) == (99, "length")
    assert record.deltas_sent == 4


# -- the script ---------------------------------------------------------------------------


def test_first_matching_step_with_uses_left_else_the_default(http: httpx.Client) -> None:
    script = Script(
        steps=(
            Fail(status=500, model="b"),
            Fail(status=502, api="anthropic"),
            Fail(status=503, times=2),
        ),
        default=Answer(text="the default"),
    )
    asked = [
        ("openai", "a"),  # skips the model- and api-filtered steps: 503 (one use left)
        ("openai", "b"),  # the model filter matches: 500 (used up)
        ("anthropic", "a"),  # the api filter matches: 502 (used up)
        ("openai", "b"),  # the last use of the 503
        ("openai", "a"),  # nothing left: the default
        ("anthropic", "b"),
    ]
    with FakeProvider(script) as fake:
        responses = [post(http, fake, api, model=model) for api, model in asked]
        records = settled(fake)
    assert [r.status_code for r in responses] == [503, 500, 502, 503, 200, 200]
    assert [r.action for r in records] == ["fail"] * 4 + ["answer"] * 2
    assert [r.outcome for r in records] == ["rejected"] * 4 + ["completed"] * 2
    assert [r.status for r in records] == [503, 500, 502, 503, 200, 200]
    assert responses[-1].json()["content"] == [{"type": "text", "text": "the default"}]
    assert [(r.api, r.model) for r in records] == asked


def test_times_zero_plays_for_ever_and_later_steps_never_play(http: httpx.Client) -> None:
    with FakeProvider([Fail(status=529, times=0), Answer(text="never")]) as fake:
        statuses = [post(http, fake, "anthropic").status_code for _ in range(6)]
    assert statuses == [529] * 6


def test_steps_added_later_and_a_new_default(http: httpx.Client) -> None:
    with FakeProvider([Fail(status=500)]) as fake:
        fake.add(Fail(status=404, times=2))
        fake.set_default(Fail(status=418))
        statuses = [post(http, fake, "openai").status_code for _ in range(5)]
    assert statuses == [500, 404, 404, 418, 418]


SCRIPT_TOML = """
[default]
action = "answer"
text = "Hello from a file."

[[steps]]
action = "stall"
after_deltas = 2

[[steps]]
action = "fail"
status = 429
retry_after = "3"
model = "gpt-4o"
times = 3

[[steps]]
action = "answer"
api = "anthropic"
tool_calls = [{ name = "lookup", arguments = { q = "x" } }]
"""
SCRIPT_DATA: dict[str, Any] = {
    "default": {"action": "answer", "text": "Hello from a file."},
    "steps": [
        {"action": "stall", "after_deltas": 2},
        {"action": "fail", "status": 429, "retry_after": "3", "model": "gpt-4o", "times": 3},
        {
            "action": "answer",
            "api": "anthropic",
            "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}],
        },
    ],
}
SCRIPT = Script(
    steps=(
        Stall(after_deltas=2),
        Fail(status=429, retry_after="3", model="gpt-4o", times=3),
        Answer(api="anthropic", tool_calls=(FakeToolCall(name="lookup", arguments={"q": "x"}),)),
    ),
    default=Answer(text="Hello from a file."),
)


def _yaml(data: Any, indent: str = "") -> str:
    """Just enough YAML for SCRIPT_DATA (block style), so the test needs no YAML writer."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(_yaml(value, indent + "  "))
        elif isinstance(value, list):
            lines.append(f"{indent}{key}:")
            for item in value:
                first, *rest = _yaml(item, indent + "  ").splitlines()
                lines.append(f"{indent}- {first.strip()}")
                lines.extend(rest)
        else:
            lines.append(f"{indent}{key}: {json.dumps(value)}")
    return "\n".join(lines)


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".yml", ".json"])
def test_load_script_from_files(tmp_path: Path, suffix: str) -> None:
    text = {
        ".toml": SCRIPT_TOML,
        ".yaml": _yaml(SCRIPT_DATA),
        ".yml": _yaml(SCRIPT_DATA),
        ".json": json.dumps(SCRIPT_DATA),
    }[suffix]
    path = tmp_path / f"script{suffix}"
    path.write_text(text)
    assert load_script(path) == SCRIPT


def test_a_bare_list_is_the_steps(tmp_path: Path) -> None:
    path = tmp_path / "steps.json"
    path.write_text(json.dumps([{"action": "hang", "times": 0}, {"action": "reset"}]))
    assert load_script(path) == Script(steps=(Hang(times=0), Reset()))
    assert parse_script(None) == Script()


def test_a_loaded_script_plays(http: httpx.Client, tmp_path: Path) -> None:
    path = tmp_path / "script.toml"
    path.write_text(SCRIPT_TOML.replace('stall"\nafter_deltas = 2', 'fail"\nstatus = 500'))
    with FakeProvider(load_script(path)) as fake:
        statuses = [post(http, fake, "openai", model="gpt-4o").status_code for _ in range(5)]
        anthropic = post(http, fake, "anthropic").json()
    assert statuses == [500, 429, 429, 429, 200]
    assert anthropic["content"][-1]["name"] == "lookup"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[[steps]]\naction = "explode"', ["'explode'", "$.steps[0].action", "actions: answer"]),
        ('[[steps]]\naction = "fail"\nstatuss = 500', ["unknown field `statuss`"]),
        ('[[steps]]\naction = "fail"\nstatus = 600', ["<= 599", "$.steps[0].status"]),
        ('[[steps]]\naction = "fail"\nstatus = 200', [">= 400", "$.steps[0].status"]),
        ('[default]\naction = "stall"\ntimes = -1', [">= 0", "$.default.times"]),
        ("[[steps]]\nstatus = 500", ["missing required field `action`"]),
        ("[[steps]\n", ["is not valid TOML/YAML/JSON"]),
    ],
)
def test_bad_scripts_are_config_errors(tmp_path: Path, text: str, expected: list[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_script(path)
    message = str(info.value)
    assert "bad.toml" in message
    for part in expected:
        assert part in message
    if "explode" in text:  # the error lists every action there is
        for action in ["answer", "cut", "error_event", "fail", "hang", "malformed", "reset"]:
            assert action in message
        for action in ["stall", "trickle", "truncated", "wrong_content_type"]:
            assert action in message


def test_missing_script_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read script"):
        load_script(tmp_path / "nope.yaml")


# -- the API key --------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_api_key_is_enforced(http: httpx.Client, api: str) -> None:
    key = "fake-key-0123456789"
    right = {"authorization": f"Bearer {key}"} if api == "openai" else {"x-api-key": key}
    wrong = {name: value.replace(key, "other") for name, value in right.items()}
    with FakeProvider(api_key=key) as fake:
        responses = [
            post(http, fake, api),
            post(http, fake, api, headers=wrong),
            post(http, fake, api, headers=right),
        ]
        records = settled(fake)
    assert [r.status_code for r in responses] == [401, 401, 200]
    assert [r.authorized for r in records] == [False, False, True]
    assert [r.outcome for r in records] == ["rejected", "rejected", "completed"]
    error = responses[0].json()["error"]
    assert error["type"] == ("invalid_api_key" if api == "openai" else "authentication_error")


@pytest.mark.parametrize("api", APIS)
def test_provider_client_sends_the_key_from_its_env_var(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "fake-key-abcdef0123"
    monkeypatch.setenv("FAKE_PROVIDER_TEST_KEY", key)

    async def main(key_env: str | None) -> ProviderResponse | ProviderError:
        client = client_for(fake, api, key_env=key_env)
        try:
            return await client.complete("m", REQUEST)
        except ProviderError as exc:
            return exc
        finally:
            await client.aclose()

    with FakeProvider(api_key=key) as fake:
        ok = anyio.run(main, "FAKE_PROVIDER_TEST_KEY")
        refused = anyio.run(main, None)
        records = settled(fake)
    assert isinstance(ok, ProviderResponse)
    assert isinstance(refused, ProviderError)
    assert (refused.kind, refused.status, refused.retryable) == ("auth", 401, False)
    assert key not in str(refused) + repr(refused)
    assert [r.authorized for r in records] == [True, False]


# -- faults, streamed ---------------------------------------------------------------------


def test_fail_sends_its_status_retry_after_and_the_api_error_body(http: httpx.Client) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=90), usegmt=True)
    steps = [
        Fail(status=429, retry_after="7"),
        Fail(status=503, retry_after=when, api="anthropic"),
        Fail(status=500, body="upstream exploded"),
    ]
    with FakeProvider(steps) as fake:
        limited = post(http, fake, "openai", stream=True)
        unavailable = post(http, fake, "anthropic", stream=True)
        verbatim = post(http, fake, "openai")
        records = settled(fake)
    assert (limited.status_code, limited.headers["retry-after"]) == (429, "7")
    assert limited.json()["error"]["type"] == "rate_limit_exceeded"
    assert (unavailable.status_code, unavailable.headers["retry-after"]) == (503, when)
    assert unavailable.json()["type"] == "error"
    assert verbatim.content == b"upstream exploded"
    assert "retry-after" not in verbatim.headers
    assert [(r.status, r.outcome, r.deltas_sent) for r in records] == [
        (429, "rejected", 0),
        (503, "rejected", 0),
        (500, "rejected", 0),
    ]


@pytest.mark.parametrize("api", APIS)
def test_fail_seen_by_provider_client(api: str) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=90), usegmt=True)
    steps: list[Step] = [
        Fail(status=429, retry_after="7"),
        Fail(status=529, retry_after=when),
        Fail(status=400, error_type="context_length_exceeded"),
        Fail(status=403),
    ]
    with FakeProvider(steps) as fake:
        outcomes = [stream_via_client(fake, api)[1] for _ in steps]
    limited, overloaded, overflow, forbidden = outcomes
    assert limited is not None
    assert (limited.kind, limited.status, limited.retryable) == ("rate_limited", 429, True)
    assert limited.retry_after == 7.0
    assert overloaded is not None
    assert (overloaded.kind, overloaded.retryable) == ("overloaded", True)
    assert overloaded.retry_after is not None
    assert 80 < overloaded.retry_after <= 90
    assert isinstance(overflow, ContextOverflowError)
    assert forbidden is not None
    assert (forbidden.kind, forbidden.retryable) == ("forbidden", False)


@pytest.mark.parametrize("api", APIS)
def test_reset_is_a_connection_reset(http: httpx.Client, api: str) -> None:
    with FakeProvider([Reset(after_deltas=2), Reset(after_deltas=2)]) as fake:
        received = bytearray()

        def read() -> None:
            url = fake.base_url + PATHS[api]
            with http.stream("POST", url, json={"model": "m", "stream": True}, timeout=5) as r:
                for chunk in r.iter_raw():
                    received.extend(chunk)

        with pytest.raises(httpx.ReadError, match="reset"):
            read()
        events, error = stream_via_client(fake, api)
        first, second = fake.wait_finished(0), fake.wait_finished(1)
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hello ", "from "]
    assert error is not None
    assert (error.kind, error.retryable) == ("connection_reset", True)
    assert b"from " in bytes(received)
    for record in (first, second):
        assert (record.action, record.outcome, record.deltas_sent) == ("reset", "reset", 2)


STREAM_BREAKS: list[tuple[Step, str, str]] = [
    (Cut(after_deltas=2), "stream_cut", "ended before its final event"),
    (Cut(after_deltas=1, mid_frame=True), "stream_cut", "cut mid-way"),
    (Malformed(after_deltas=1), "malformed", "not valid JSON"),
    (Truncated(after_deltas=1), "malformed", "not valid JSON"),
]


@pytest.mark.parametrize(("step", "kind", "detail"), STREAM_BREAKS, ids=lambda v: str(v)[:24])
@pytest.mark.parametrize("api", APIS)
def test_broken_streams(http: httpx.Client, api: str, step: Cut, kind: str, detail: str) -> None:
    with FakeProvider([step, step]) as fake:
        raw = post(http, fake, api, stream=True)
        events, error = stream_via_client(fake, api)
        records = [fake.wait_finished(0), fake.wait_finished(1)]
    frames = sse(raw.content)
    if isinstance(step, Cut) and step.mid_frame:
        assert raw.content.endswith(b'data: {"partial":')
    elif isinstance(step, Cut):
        assert frames[-1][1] not in ("[DONE]", '{"type":"message_stop"}')
        assert "from " in frames[-1][1]
    elif isinstance(step, Malformed):
        assert frames[-1][1] == "this is not json at all"
    else:
        with pytest.raises(json.JSONDecodeError):
            json.loads(frames[-1][1])
    assert raw.status_code == 200
    assert len([e for e in events if isinstance(e, TextDelta)]) == step.after_deltas
    assert error is not None
    assert (error.kind, error.retryable) == (kind, True)
    assert detail in str(error)
    for record in records:
        assert (record.outcome, record.deltas_sent) == ("completed", step.after_deltas)


@pytest.mark.parametrize("api", APIS)
def test_wrong_content_type(http: httpx.Client, api: str) -> None:
    with FakeProvider([WrongContentType(), WrongContentType(content_type="text/plain")]) as fake:
        raw = post(http, fake, api, stream=True)
        _, error = stream_via_client(fake, api)
    assert (raw.status_code, raw.headers["content-type"]) == (200, "text/html; charset=utf-8")
    assert raw.content.startswith(b"<html>")
    assert error is not None
    assert error.kind == "malformed"
    assert "text/plain" in str(error)


@pytest.mark.parametrize(
    ("api", "error_type", "kind", "retryable"),
    [
        ("openai", "server_error", "stream_error", True),
        ("anthropic", "overloaded_error", "overloaded", True),
        ("anthropic", "invalid_request_error", "bad_request", False),
    ],
)
def test_error_event_inside_the_stream(
    http: httpx.Client, api: str, error_type: str, kind: str, retryable: bool
) -> None:
    step = ErrorEvent(after_deltas=1, error_type=error_type)
    with FakeProvider([step, step]) as fake:
        raw = post(http, fake, api, stream=True)
        events, error = stream_via_client(fake, api)
        record = fake.wait_finished(1)
    last = json.loads(sse(raw.content)[-1][1])
    assert last["error"]["type"] == error_type
    assert [e for e in events if isinstance(e, TextDelta)] == [TextDelta("Hello ")]
    assert error is not None
    assert (error.kind, error.retryable) == (kind, retryable)
    assert (record.outcome, record.deltas_sent) == ("completed", 1)


@pytest.mark.parametrize("api", APIS)
def test_hang_sends_nothing_until_the_client_leaves(http: httpx.Client, api: str) -> None:
    with FakeProvider([Hang(), Hang()]) as fake:
        with pytest.raises(httpx.ReadTimeout):
            http.post(fake.base_url + PATHS[api], json={"model": "m", "stream": True}, timeout=0.2)
        plain = fake.wait_finished(0)
        events, error = stream_via_client(fake, api, within=0.2)
        typed = fake.wait_finished(1)
    assert (events, error) == ([], None)
    for record in (plain, typed):
        assert (record.action, record.outcome, record.deltas_sent) == ("hang", "client_closed", 0)
        assert record.finished_at is not None
        assert record.finished_at - record.started_at < 2.0


def _read_until(response: httpx.Response, enough: Callable[[bytes], bool]) -> bytes:
    received = b""
    for chunk in response.iter_raw():
        received += chunk
        if enough(received):
            break
    return received


@pytest.mark.parametrize("api", APIS)
def test_stall_goes_silent_after_its_deltas(http: httpx.Client, api: str) -> None:
    with FakeProvider([Stall(after_deltas=2), Stall(after_deltas=3)]) as fake:
        body = {"model": "m", "stream": True}
        timeout = httpx.Timeout(5, read=0.2)
        with (
            http.stream("POST", fake.base_url + PATHS[api], json=body, timeout=timeout) as response,
            pytest.raises(httpx.ReadTimeout),
        ):
            _read_until(response, lambda _: False)
        plain = fake.wait_finished(0)
        events, error = stream_via_client(fake, api, within=0.3)
        typed = fake.wait_finished(1)
    assert error is None
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hello ", "from ", "the "]
    assert (plain.outcome, plain.deltas_sent) == ("client_closed", 2)
    assert (typed.outcome, typed.deltas_sent) == ("client_closed", 3)


@pytest.mark.parametrize("api", APIS)
def test_trickle_stops_when_the_client_closes(http: httpx.Client, api: str) -> None:
    with FakeProvider([Trickle(interval_ms=10, text="z")]) as fake:
        body = {"model": "m", "stream": True}
        with http.stream("POST", fake.base_url + PATHS[api], json=body, timeout=5) as response:
            received = _read_until(response, lambda got: got.count(b'"z"') >= 5)
        record = fake.wait_finished(0)
        assert record.outcome == "client_closed"
        assert record.deltas_sent >= 5
        with pytest.raises(TimeoutError):  # nothing more is sent once the client has gone
            fake.wait_for(lambda rs: rs[0].deltas_sent > record.deltas_sent, timeout=0.2)
    assert received.count(b'"z"') >= 5


# -- faults, whole replies ----------------------------------------------------------------


WHOLE_FAULTS: list[tuple[Step, str, str]] = [
    (Reset(), "connection_reset", "reset"),
    (Cut(), "stream_cut", "completed"),  # the body ends before its promised length
    (Truncated(), "malformed", "completed"),
    (Malformed(), "malformed", "completed"),
    (WrongContentType(), "malformed", "completed"),
    (Fail(status=502), "bad_gateway", "rejected"),
]


@pytest.mark.parametrize(("step", "kind", "outcome"), WHOLE_FAULTS, ids=lambda v: str(v)[:20])
@pytest.mark.parametrize("api", APIS)
def test_whole_reply_faults(api: str, step: Step, kind: str, outcome: str) -> None:
    with FakeProvider([step]) as fake:
        result = complete_via_client(fake, api)
        record = fake.wait_finished(0)
    assert isinstance(result, ProviderError)
    assert (result.kind, result.retryable) == (kind, True)
    assert (record.stream, record.outcome) == (False, outcome)


@pytest.mark.parametrize("api", APIS)
def test_error_event_without_streaming_is_an_error_status(api: str) -> None:
    with FakeProvider([ErrorEvent()]) as fake:
        result = complete_via_client(fake, api)
    assert isinstance(result, ProviderError)
    expected = ("server_error", 500) if api == "openai" else ("overloaded", 529)
    assert (result.kind, result.status) == expected


@pytest.mark.parametrize("step", [Hang(), Stall(), Trickle()], ids=["hang", "stall", "trickle"])
def test_silent_whole_replies_until_the_client_leaves(step: Step) -> None:
    with FakeProvider([step]) as fake:
        assert complete_via_client(fake, "openai", within=0.2) is None
        record = fake.wait_finished(0)
    assert (record.outcome, record.deltas_sent) == ("client_closed", 0)


@pytest.mark.parametrize("api", APIS)
def test_slow_first_token(api: str) -> None:
    with FakeProvider([Answer(first_delay_ms=300)]) as fake:
        events, error = stream_via_client(fake, api, within=0.1)
        record = fake.wait_finished(0)
        assert error is None
        assert not any(isinstance(e, TextDelta) for e in events)
        assert record.outcome == "client_closed"
        fake.add(Answer(first_delay_ms=100, text="late"))
        events, error = stream_via_client(fake, api)
    assert error is None
    assert accumulate(events).text == "late"


# -- stopping and the record --------------------------------------------------------------


def test_stop_ends_hung_requests_as_server_stopped(http: httpx.Client) -> None:
    steps = [Hang(api="openai"), Stall(api="anthropic", after_deltas=2)]
    fake = FakeProvider(steps).start()

    def plain(api: str) -> BaseException | None:
        try:
            with http.stream(
                "POST", fake.base_url + PATHS[api], json={"model": "m", "stream": True}, timeout=5
            ) as response:
                for _ in response.iter_raw():
                    pass
        except httpx.HTTPError as exc:
            return exc
        return None

    with ThreadPoolExecutor(2) as pool:
        hung = pool.submit(plain, "openai")
        stalled = pool.submit(plain, "anthropic")
        fake.wait_for(lambda rs: len(rs) == 2 and sum(r.deltas_sent for r in rs) == 2)
        fake.stop()
        records = [fake.wait_finished(0), fake.wait_finished(1)]
        errors = [hung.result(timeout=5), stalled.result(timeout=5)]
    by_api = {r.api: r for r in records}
    assert (by_api["openai"].outcome, by_api["openai"].deltas_sent) == ("server_stopped", 0)
    assert (by_api["anthropic"].outcome, by_api["anthropic"].deltas_sent) == ("server_stopped", 2)
    assert isinstance(errors[0], httpx.RemoteProtocolError)  # not even a status line
    assert isinstance(errors[1], httpx.HTTPError)  # the chunked body never ended


def test_housekeeping(http: httpx.Client) -> None:
    fake = FakeProvider()
    assert fake.url == "(not started)"
    with pytest.raises(RuntimeError, match="not started"):
        _ = fake.port
    with fake:
        assert fake.base_url == f"http://127.0.0.1:{fake.port}/v1"
        assert "127.0.0.1" in repr(fake)
        assert http.get(fake.url + "/health", timeout=5).json() == {"status": "ok"}
        assert http.post(fake.url + "/v1/embeddings", json={}, timeout=5).status_code == 404
        bad = http.post(fake.base_url + "/chat/completions", content=b"{nope", timeout=5)
        assert bad.status_code == 400
        assert fake.requests == []  # neither reached the script
        with pytest.raises(TimeoutError):
            fake.wait_for(lambda rs: len(rs) > 0, timeout=0.05)
        post(http, fake, "openai")
        [record] = settled(fake)
    assert isinstance(record, RecordedRequest)
    record.deltas_sent = 99  # a copy: the fake's own record is untouched
    assert fake.requests[0].deltas_sent == 0


# -- regressions ----------------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_a_refused_request_does_not_use_up_a_step(http: httpx.Client, api: str) -> None:
    key = "sk-fake-regression-0001"
    header = {"authorization": f"Bearer {key}"} if api == "openai" else {"x-api-key": key}
    with FakeProvider([Fail(status=503)], api_key=key) as fake:
        assert post(http, fake, api).status_code == 401
        assert post(http, fake, api, headers=header).status_code == 503
        first, second = fake.wait_for(lambda rs: len(rs) == 2 and rs[1].outcome != "running")
    assert first.action == "unauthorized"
    assert second.action == "fail"


def test_malformed_tool_arguments_still_make_a_whole_anthropic_reply(http: httpx.Client) -> None:
    step = Answer(text="", tool_calls=(FakeToolCall(name="t", arguments='{"cut'),))
    with FakeProvider(script=Script(default=step)) as fake:
        reply = post(http, fake, "anthropic")
        record = fake.wait_finished(0)
    assert reply.status_code == 200
    assert reply.json()["content"][0]["input"] == {"_raw": '{"cut'}
    assert record.outcome == "completed"


def test_a_stopped_fake_can_start_again(http: httpx.Client) -> None:
    fake = FakeProvider()
    fake.start()
    fake.stop()
    with fake:
        assert post(http, fake, "openai").status_code == 200
        assert fake.wait_finished(0).outcome == "completed"
