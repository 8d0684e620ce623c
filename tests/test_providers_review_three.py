"""Review (third pass): the provider layer against a misbehaving provider, over real HTTP.

Every test drives the real ``ProviderClient`` / ``ModelCaller`` (through the runtime's
``ProviderLayer``) against a server on 127.0.0.1: the raw-socket server of the second
review, which writes exactly the bytes a test needs, or the ``FakeProvider``. The log is a
real LMDB store in ``tmp_path``. Nothing of stalwart is mocked; the one sink below is a
real ``StoreSink`` that holds one append back, so a test can take its turn in between.
Tests marked ``# Was: DEFECT:`` failed on the code as reviewed, before their fixes.
"""

from __future__ import annotations

import json
import socket
import traceback
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock, SystemClock
from stalwart.config import ProviderSettings
from stalwart.errors import BreakerOpenError, FencedError, ProviderError
from stalwart.events import (
    BreakerOpened,
    Event,
    PromptActivity,
    PromptCompleted,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    PromptTimeout,
    RecordedEvent,
    SessionCreated,
    ToolCall,
    UserInterrupt,
)
from stalwart.providers import (
    Accumulator,
    Message,
    ModelCaller,
    ProviderClient,
    ProviderRequest,
    ProviderResponse,
    SseFrameTooLarge,
    SseParser,
    parse_retry_after,
)
from stalwart.runtime import Runtime, StoreSink
from stalwart.store import EventStore, Fence, NewEvent
from stalwart.testing import Answer, Fail, FakeProvider, Hang, Stall
from tests import test_providers_review_two as review_two
from tests._runtime_support import (
    RETRYING,
    agent_settings,
    delivered,
    flush,
    has,
    log_until,
    of,
    runtime_config,
)
from tests.test_providers_review_two import (
    GUARD,
    REQUEST,
    SECRET,
    SESSION,
    anthropic_text,
    call,
    config,
    failed_classes,
    frame,
    http,
    openai_text,
    provider_layer,
)

#: the second review's raw-socket HTTP server (a fixture); ``store`` is conftest's
raw = review_two.raw

pytestmark = pytest.mark.anyio

NOW = 1_800_000_000.0
#: JSON nested past msgspec's depth limit (about a thousand levels): valid, but no API's
DEEP = b"[" * 5000


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def session_events(store: EventStore, stream: str = SESSION) -> list[Event]:
    return [r.event for r in store.read_stream(stream)]


async def drain(client: ProviderClient, request: ProviderRequest = REQUEST) -> ProviderResponse:
    """The streamed reply, accumulated as the caller does."""
    accumulator = Accumulator(client.name, "m")
    with anyio.fail_after(GUARD):
        async for event in client.stream("m", request):
            accumulator.add(event)
    return accumulator.response()


# -- Retry-After: an HTTP date no calendar holds, and dates far away -----------------------


@pytest.mark.parametrize(
    "value",
    ["1 Jan 99999999999999999999 00:00 GMT", "Mon, 01 Jan 12345678901234567890 00:00:00 GMT"],
)
def test_a_retry_after_date_with_a_twenty_digit_year_is_unreadable(value: str) -> None:
    # Was: DEFECT: parse_retry_after let the date parser's OverflowError ("Python int too
    # large to convert to C long") out: not a ProviderError, the call ended raw
    assert parse_retry_after(value, NOW) is None


@pytest.mark.parametrize(
    ("retry_after", "retried"),
    [
        # Was: DEFECT: the raw OverflowError ended the call, no prompt:failed, no fallback
        (b"1 Jan 99999999999999999999 00:00 GMT", True),
        (b"Fri, 31 Dec 9999 23:59:59 GMT", False),  # ~8,000 years: bounded, next model
        (b"999999999999999", False),  # fifteen digits of seconds: the same
    ],
    ids=["unreadable-date", "far-date", "huge-number"],
)
async def test_a_retry_after_that_is_odd_or_far_never_holds_the_call(
    retry_after: bytes, retried: bool, raw: Any, store: EventStore
) -> None:
    failing = http(
        b'{"error": {"type": "server_error"}}',
        status=b"503 Service Unavailable",
        content_type=b"application/json",
        extra=b"retry-after: " + retry_after + b"\r\n",
    )
    server = raw([failing, http(openai_text("answered"))])
    cfg = config(server.base_url, fallback_models=("backup:m2",))
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.model == ("m1" if retried else "m2")
    assert failed_classes(store) == ["unavailable"]
    retries = [e for e in session_events(store) if isinstance(e, PromptRetryScheduled)]
    assert len(retries) == int(retried)


# -- JSON nested past the decoder's depth limit --------------------------------------------


@pytest.mark.parametrize(
    ("api", "stream", "good"),
    [
        ("openai", True, http(openai_text("fine"))),
        ("anthropic", True, http(anthropic_text("fine"))),
        (
            "openai",
            False,
            http(
                json.dumps(
                    {"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]}
                ).encode(),
                content_type=b"application/json",
            ),
        ),
    ],
    ids=["openai-stream", "anthropic-stream", "whole-reply"],
)
async def test_json_nested_too_deeply_is_malformed_and_retried(
    api: str, stream: bool, good: bytes, raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: msgspec raises RecursionError (not DecodeError) past ~1000 levels; it
    # left the client and the caller raw: no prompt:failed, no retry
    deep = (
        http(b"data: " + DEEP + b"\n\n") if stream else http(DEEP, content_type=b"application/json")
    )
    server = raw([deep, good])
    outcome = await call(config(server.base_url, api, stream=stream), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.text == "fine"
    assert failed_classes(store) == ["malformed"]


async def test_a_past_tool_call_with_deeply_nested_arguments_can_still_be_sent(
    raw: Any,
) -> None:
    # Was: DEFECT: the Anthropic wire decodes a past call's arguments to send them as
    # ``input``; arguments nested too deeply raised RecursionError building every request
    # of the session from then on (a model's own output wedged its conversation)
    server = raw([http(anthropic_text("still here"))])
    call_ = ToolCall(id="t1", name="lookup", arguments=DEEP.decode())
    request = ProviderRequest(
        messages=(
            Message(role="user", content="hi"),
            Message(role="assistant", tool_calls=(call_,)),
            Message(role="tool", tool_call_id="t1", content="no"),
        )
    )
    client = ProviderClient("p", ProviderSettings(kind="anthropic", base_url=server.base_url))
    try:
        reply = await drain(client, request)
    finally:
        await client.aclose()
    assert reply.text == "still here"


# -- numbers past any real count -------------------------------------------------------------


@pytest.mark.parametrize("count", [10**23, 2**64, 2**63], ids=["10e23", "2e64", "2e63"])
async def test_a_token_count_past_any_real_count_is_malformed(
    count: int, raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: any whole number >= 0 was a token count; one past 2**64 - 1 made the
    # log refuse prompt:completed (an EventError in an ExceptionGroup out of the caller, an
    # attempt nothing ends); 2**63 went into the log and on to every token total
    usage = {"prompt_tokens": count, "completion_tokens": 2}
    bad = frame({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    bad += frame({"choices": [], "usage": usage}) + b"data: [DONE]\n\n"
    server = raw([http(bad), http(openai_text("fine"))])
    outcome = await call(config(server.base_url), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert failed_classes(store) == ["malformed"]
    (completed,) = [e for e in session_events(store) if isinstance(e, PromptCompleted)]
    assert completed.input_tokens < 2**53


# -- errors reported in a reply --------------------------------------------------------------


async def test_error_null_in_every_chunk_is_not_an_error(raw: Any, store: EventStore) -> None:
    # Was: DEFECT: any chunk with an "error" key was an error: Microsoft Foundry Local sends
    # "error": null in every chunk (microsoft/foundry-local#273), so every call failed
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return frame({"object": "chat.completion.chunk", "choices": [choice], "error": None})

    body = chunk({"content": "all"}) + chunk({"content": " good"}) + chunk({}, "stop")
    server = raw([http(body + b"data: [DONE]\n\n")])
    outcome = await call(config(server.base_url), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.text == "all good"
    assert failed_classes(store) == []


@pytest.mark.parametrize(
    ("error", "kind", "retryable"),
    [
        # OpenRouter, when the model behind it is rate limited: a 200 with this body
        ({"message": f"Rate limit exceeded for {SECRET}", "code": 429}, "rate_limited", True),
        ({"message": "Provider returned error", "code": 502}, "bad_gateway", True),
        ({"message": f"bad key {SECRET}", "code": 401}, "auth", False),
        ({"type": "overloaded_error", "message": "Overloaded"}, "stream_error", True),
    ],
    ids=["429", "502", "401", "typed"],
)
async def test_a_whole_reply_that_is_an_error_is_an_error_not_an_empty_answer(
    error: dict[str, Any],
    kind: str,
    retryable: bool,
    raw: Any,
    store: EventStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Was: DEFECT: a non-streamed 200 whose body is {"error": ...} (OpenRouter sends one
    # when the model behind it fails) read as a successful, empty answer "stop"
    body = json.dumps({"error": error, "user_id": "u1"}).encode()
    server = raw([http(body, content_type=b"application/json")])
    monkeypatch.setenv("REVIEW_THREE_KEY", SECRET)
    cfg = config(server.base_url, api_key_env="REVIEW_THREE_KEY", stream=False, max_retries=0)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderError), repr(outcome)
    assert (outcome.kind, outcome.retryable) == (kind, retryable)
    assert failed_classes(store) == [kind]
    shown = repr(outcome) + "".join(traceback.format_exception(outcome))
    assert SECRET not in shown
    assert "Rate limit" not in shown  # the provider's words never reach the error
    assert SECRET not in repr(list(store.read_all()))


async def test_a_whole_reply_without_a_choice_is_malformed(raw: Any, store: EventStore) -> None:
    # Was: DEFECT: {"choices": []} (or none) read as a successful, empty answer
    empty = http(json.dumps({"id": "x", "choices": []}).encode(), content_type=b"application/json")
    good = http(
        json.dumps({"choices": [{"message": {"content": "fine"}}]}).encode(),
        content_type=b"application/json",
    )
    server = raw([empty, good])
    outcome = await call(config(server.base_url, stream=False), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.text == "fine"
    assert failed_classes(store) == ["malformed"]


async def test_an_http_status_as_a_stream_errors_code_classes_it(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: only a string type or code was read: OpenRouter's mid-stream
    # {"error": {"code": 429}} was stream_error, retried with backoff on the same model;
    # the 429 rule (no Retry-After: the next model at once) applies
    error = {"error": {"message": "Rate limit exceeded", "code": 429}}
    bad = frame({"choices": [{"index": 0, "delta": {"content": "a"}}]}) + frame(error)
    server = raw([http(bad), http(openai_text("from the fallback"))])
    cfg = config(server.base_url, fallback_models=("backup:m2",), max_retries=2)
    outcome = await call(cfg, store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.model == "m2"
    assert failed_classes(store) == ["rate_limited"]
    assert not [e for e in session_events(store) if isinstance(e, PromptRetryScheduled)]


async def test_arguments_for_a_block_that_is_not_a_tool_call_are_malformed(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: an input_json_delta for a content block that never started as a
    # tool_use went to call slot 0: a tool call with no id and no name reached the agent
    bad = frame({"type": "message_start", "message": {"usage": {"input_tokens": 3}}})
    delta = {"type": "input_json_delta", "partial_json": '{"path": "/etc"}'}
    bad += frame({"type": "content_block_delta", "index": 3, "delta": delta})
    bad += frame({"type": "message_delta", "delta": {"stop_reason": "tool_use"}})
    bad += frame({"type": "message_stop"})
    server = raw([http(bad), http(anthropic_text("fine"))])
    outcome = await call(config(server.base_url, "anthropic"), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.tool_calls == ()
    assert failed_classes(store) == ["malformed"]


async def test_thinking_and_tool_calls_at_jumping_indexes_stream_whole(raw: Any) -> None:
    """Not a defect: thinking (with its signature), an empty text block, and two tool
    calls at block indexes 2 and 5 whose arguments interleave, usage counted once."""

    def block(index: int, kind: str, **fields: Any) -> bytes:
        start = {"type": "content_block_start", "index": index}
        return frame(start | {"content_block": {"type": kind, **fields}})

    def delta(index: int, **fields: Any) -> bytes:
        return frame({"type": "content_block_delta", "index": index, "delta": fields})

    usage = {"input_tokens": 5, "cache_read_input_tokens": 100, "output_tokens": 1}
    body = frame({"type": "message_start", "message": {"usage": usage}})
    body += block(0, "thinking", thinking="") + delta(0, type="thinking_delta", thinking="hm")
    body += delta(0, type="signature_delta", signature="c2ln")
    body += block(1, "text", text="")
    body += block(2, "tool_use", id="t1", name="a", input={})
    body += delta(2, type="input_json_delta", partial_json='{"x":')
    body += block(5, "tool_use", id="t2", name="b", input={})
    body += delta(2, type="input_json_delta", partial_json="1}")
    body += delta(5, type="input_json_delta", partial_json="{}")
    for _ in range(2):  # a repeated usage is the same count, not twice it
        stop = {"type": "message_delta", "delta": {"stop_reason": "tool_use"}}
        body += frame(stop | {"usage": {"output_tokens": 9}})
    body += frame({"type": "message_stop"})
    server = raw([http(body)])
    client = ProviderClient("p", ProviderSettings(kind="anthropic", base_url=server.base_url))
    try:
        reply = await drain(client)
    finally:
        await client.aclose()
    assert reply.thinking == "hm"
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        ("t1", "a", '{"x":1}'),
        ("t2", "b", "{}"),
    ]
    assert (reply.finish_reason, reply.input_tokens, reply.output_tokens) == ("tool_use", 105, 9)


# -- the SSE parser's bound is a memory bound -----------------------------------------------


def test_a_frame_of_many_short_data_lines_is_held_within_its_bound() -> None:
    # Was: DEFECT: each data line was kept as its own str until the frame ended: a frame
    # of "data:ab" lines under the 16 MiB bound held ~320 MB (under this one: ~2.5 MB)
    bound = 128 * 1024
    parser = SseParser(max_frame_bytes=bound)
    chunk = b"data:ab\n" * 4096

    def feed_until_refused() -> None:
        for _ in range(10 * bound // len(chunk)):
            parser.feed(chunk)

    tracemalloc.start()
    try:
        with pytest.raises(SseFrameTooLarge):
            feed_until_refused()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * bound, peak


# -- the breaker: one probe at a time, however the first one ends --------------------------


class HoldingSink(StoreSink):
    """The runtime's sink, holding back the append of one event type to one stream until
    the test lets it go (the rest goes through at once)."""

    def __init__(self, store: EventStore, stream: str, kind: type) -> None:
        super().__init__(store)
        self._stream, self._kind = stream, kind
        self.held = anyio.Event()
        self.release = anyio.Event()

    async def emit(self, stream: str, events: Sequence[Event], ts: float) -> list[RecordedEvent]:
        if stream == self._stream and any(isinstance(e, self._kind) for e in events):
            self.held.set()
            await self.release.wait()
        return await super().emit(stream, events, ts)


async def until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(GUARD):
        while not predicate():
            await anyio.sleep(0.005)  # real-time: polling what another task does


async def test_half_open_admits_one_probe_while_the_last_one_is_still_settling(
    store: EventStore,
) -> None:
    # Was: DEFECT: the probe slot was freed twice: when the probe's outcome was folded
    # (Breaker.settled) and again when its attempt ended. A probe that failed for a
    # caller's fault (a 400: no answer, still half-open) freed it first; a second caller
    # took it; then the first attempt's end freed it under the second probe, and a third
    # caller probed beside it: two trial calls to a provider that is meant to get one
    with FakeProvider([Fail(status=400)]) as fake:
        fake.set_default(Hang())
        opened = BreakerOpened(provider="main", failures=5, threshold=5, reset_timeout_ms=1000)
        long_ago = SystemClock().now() - 3600
        store.append("provider:main", [NewEvent(event=opened, ts=long_ago)])
        cfg = config(fake.base_url, max_retries=0, prompt_timeout_ms=60_000)
        sink = HoldingSink(store, "session:a", PromptFailed)
        results: dict[str, ProviderResponse | BaseException] = {}
        async with provider_layer(cfg, store) as layer:
            caller = ModelCaller(
                cfg.agent("default"), layer.clients, layer.breakers, sink, SystemClock()
            )

            async def run(name: str) -> None:
                try:
                    results[name] = await caller.call(f"session:{name}", REQUEST)
                except Exception as exc:
                    results[name] = exc

            with anyio.fail_after(GUARD):
                async with anyio.create_task_group() as group:
                    group.start_soon(run, "a")  # the probe: a 400, held as it settles
                    await sink.held.wait()
                    group.start_soon(run, "b")  # while the probe settles
                    await until(lambda: "b" in results or len(fake.requests) == 2)
                    sink.release.set()
                    await until(lambda: "a" in results)
                    sent = len(fake.requests)
                    group.start_soon(run, "c")  # after it settled
                    await until(lambda: "c" in results or len(fake.requests) > sent)
                    in_flight = [r for r in fake.requests if r.outcome == "running"]
                    group.cancel_scope.cancel()
    assert isinstance(results["a"], ProviderError)
    assert results["a"].kind == "bad_request"
    assert len(in_flight) == 1, [(r.index, r.outcome) for r in fake.requests]
    assert isinstance(results.get("b"), BreakerOpenError)  # the probe was still in flight


# -- a lease lost as the call settles ----------------------------------------------------------


async def test_a_lease_lost_as_the_call_settles_is_raised_as_itself(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: the session's outcome and the provider's are appended together in a
    # task group, which wrapped the session append's FencedError (or any store error) in
    # an ExceptionGroup: the Agent, which stands down quietly on a FencedError, logged
    # the call as broken ("agent.model_call_broke", error "internal")
    clock = SystemClock()
    store.append(SESSION, [NewEvent(event=SessionCreated(), ts=clock.now())], fence=Fence(1, True))

    def taken_over_then_answered(conn: socket.socket) -> None:
        takeover = NewEvent(event=UserInterrupt(epoch=2), ts=clock.now())
        store.append(SESSION, [takeover], fence=Fence(2, claim=True))
        conn.sendall(http(openai_text()))  # no delta: the outcome is the next append

    server = raw([taken_over_then_answered])
    async with provider_layer(config(server.base_url), store) as layer:
        layer.sink.hold(SESSION, Fence(1))
        with anyio.fail_after(GUARD), pytest.raises(FencedError):
            await layer.caller().call(SESSION, REQUEST)
    assert [type(e) for e in session_events(store)] == [
        SessionCreated,
        PromptStarted,
        UserInterrupt,
    ]
    outcomes = [type(e).__name__ for e in session_events(store, "provider:main")]
    assert outcomes == ["ProviderCallSucceeded"]  # the provider's part still counts


# -- a stream that stalls mid-answer, at the seed's default budget --------------------------


def test_a_stream_that_stalls_mid_answer_is_cut_at_the_default_budget_and_retried(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Not a defect: a delta, then silence. Seed 000's 180 s stall budget (the
    default) runs from the last recorded activity, on the Clock: nothing is cut before
    it passes; then the socket is closed, the attempt fails as ``timeout_stall``,
    retryable, and the retry's answer (nothing of the cut one) reaches the user."""
    fake.add(Stall(after_deltas=1, text="half an"))
    fake.set_default(Answer(text="the whole answer"))
    agent = agent_settings(180_000, **RETRYING)
    no_turn_limit = {"execution_timeout_ms": 36_000_000}
    cfg = runtime_config(fake.base_url, agents={"default": agent}, supervision=no_turn_limit)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        log_until(store, "session:s1", has(PromptActivity))  # the delta, read: then silence
        clock.advance(179.9)
        flush(rt.portal)
        assert of(PromptTimeout, list(store.read_stream("session:s1"))) == []
        clock.advance(0.2)
        records = log_until(store, "session:s1", has(PromptRetryScheduled))
        (timeout,) = of(PromptTimeout, records)
        assert (timeout.limit, timeout.limit_ms) == ("stall", 180_000)
        (failed,) = of(PromptFailed, records)
        assert (failed.error_class, failed.retryable) == ("timeout_stall", True)
        clock.advance(1)  # past the retry's backoff (a few ms, on the Clock)
        assert [m.text for m in delivered(rt, chat, 1)] == ["the whole answer"]
    assert fake.wait_finished(0).outcome == "client_closed"


async def test_a_whole_reply_whose_strings_are_not_utf8_is_malformed(
    raw: Any, store: EventStore
) -> None:
    # Was: DEFECT: msgspec raises UnicodeDecodeError (not DecodeError) for a JSON body
    # whose strings hold bytes that are not UTF-8: it left the call raw, no outcome
    bad = http(
        b'{"choices": [{"message": {"content": "\xed\xa0\x80"}}]}', content_type=b"application/json"
    )
    good = http(
        json.dumps({"choices": [{"message": {"content": "fine"}}]}).encode(),
        content_type=b"application/json",
    )
    server = raw([bad, good])
    outcome = await call(config(server.base_url, stream=False), store)
    assert isinstance(outcome, ProviderResponse), repr(outcome)
    assert outcome.text == "fine"
    assert failed_classes(store) == ["malformed"]
