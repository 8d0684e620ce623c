"""The model caller end to end: real loopback HTTP to the fake provider, a real LMDB log.

Every fault class against both wires, with small budgets (a 250 ms stall budget, a 300 ms
whole-call limit): classification, retries and backoff, Retry-After, the prompt deadline
(stall, makespan, retry deadline) and the socket it really closes, the fallback chain,
the per-provider breaker, and the API key that never leaves its header. Assertions are on
the events in the store, on what the fake recorded, and on the errors raised.
"""

from __future__ import annotations

import itertools
import math
import random
import socket
import traceback
from collections.abc import AsyncIterator, Iterator, MutableMapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
import pytest

from stalwart import store as store_module
from stalwart.clock import Clock, FakeClock, SystemClock
from stalwart.config import Config, parse_config
from stalwart.errors import (
    BreakerOpenError,
    ContextOverflowError,
    PromptTimeoutError,
    ProviderError,
)
from stalwart.events import (
    BreakerOpened,
    Event,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    PromptActivity,
    PromptCompleted,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    PromptTimeout,
    ProviderCallFailed,
    ProviderCallSucceeded,
    RecordedEvent,
)
from stalwart.providers import (
    Done,
    Message,
    ProviderRequest,
    ProviderResponse,
    StreamEvent,
    backoff_delay,
)
from stalwart.runtime import ProviderLayer
from stalwart.state import BREAKER
from stalwart.store import EventStore, load_state
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
    Stall,
    Step,
    Trickle,
    Truncated,
    WrongContentType,
)

pytestmark = pytest.mark.anyio

APIS = ["openai", "anthropic"]
SESSION = "session:s1"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
VISION = ProviderRequest(
    messages=(Message(role="user", content="what is this?", images=("data:image/png;base64,AA",)),)
)
AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 250,
    "retry_prompt_timeout_ms": 300,
    "stall_ceiling_multiplier": 2,
    "activity_interval_ms": 20,
    "retry_base_ms": 10,
    "retry_cap_ms": 50,
    "max_retries": 1,
    "rate_limit_same_model_max_retry_after_ms": 1000,
}
#: Far more than any single test needs: a test that hangs fails here, not at the global timeout.
GUARD = 5.0
E = TypeVar("E", bound=Event)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EventStore]:
    opened = store_module.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        provider.set_default(Answer(text="recovered"))
        yield provider


def config(
    base_url: str,
    api: str = "openai",
    *,
    providers: dict[str, dict[str, Any]] | None = None,
    settings: dict[str, Any] | None = None,
    **agent: Any,
) -> Config:
    """``main`` and ``backup`` both on the fake, and the agent ``default`` with AGENT's knobs."""
    main = {
        "kind": api,
        "base_url": base_url,
        "connect_timeout_ms": 1000,
        "breaker_failure_threshold": 50,
        "breaker_reset_timeout_ms": 60_000,
        **(settings or {}),
    }
    every = {"main": main, "backup": dict(main), **(providers or {})}
    return parse_config({"providers": every, "agents": {"default": AGENT | agent}})


@asynccontextmanager
async def provider_layer(
    cfg: Config, store: EventStore, clock: Clock | None = None
) -> AsyncIterator[ProviderLayer]:
    layer = ProviderLayer(cfg, store, clock=clock or SystemClock(), rng=random.Random(7))
    try:
        yield layer
    finally:
        await layer.aclose()


async def call(layer: ProviderLayer, request: ProviderRequest = REQUEST) -> ProviderResponse:
    with anyio.fail_after(GUARD):
        return await layer.caller().call(SESSION, request)


async def failing(layer: ProviderLayer, request: ProviderRequest = REQUEST) -> ProviderError:
    try:
        await call(layer, request)
    except ProviderError as exc:
        return exc
    raise AssertionError("the call succeeded")


def records(store: EventStore, stream: str = SESSION) -> list[RecordedEvent]:
    return list(store.read_stream(stream))


def tags(store: EventStore, stream: str = SESSION) -> list[str]:
    return [record.type for record in store.read_stream(stream)]


def of(store: EventStore, kind: type[E], stream: str = SESSION) -> list[E]:
    return [r.event for r in store.read_stream(stream) if isinstance(r.event, kind)]


async def finished(fake: FakeProvider, index: int) -> RecordedRequest:
    """The fake's record of a request once it ended (waited for off the event loop)."""
    return await anyio.to_thread.run_sync(fake.wait_finished, index, GUARD)


async def wait_requests(fake: FakeProvider, count: int) -> None:
    def arrived(requests: list[RecordedRequest]) -> bool:
        return len(requests) >= count

    await anyio.to_thread.run_sync(fake.wait_for, arrived, GUARD)


def models(fake: FakeProvider) -> list[str]:
    return [r.model for r in fake.requests]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- every step is an event ---------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
async def test_a_streamed_reply_is_recorded_step_by_step(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(
        Answer(
            text="one two three",
            thinking="hm",
            tool_calls=(FakeToolCall(name="f", arguments={"a": 1}),),
            input_tokens=5,
        )
    )
    seen: list[StreamEvent | PromptStarted] = []
    async with provider_layer(config(fake.base_url, api), store) as layer:
        with anyio.fail_after(GUARD):
            reply = await layer.caller().call(SESSION, REQUEST, on_event=seen.append)
    assert (reply.provider, reply.model, reply.text, reply.thinking) == (
        "main",
        "m1",
        "one two three",
        "hm",
    )
    assert [(c.name, msgspec.json.decode(c.arguments)) for c in reply.tool_calls] == [
        ("f", {"a": 1})
    ]
    found = tags(store)
    assert found[0] == "prompt:started"
    assert found[-1] == "prompt:completed"
    assert set(found[1:-1]) == {"prompt:activity"}
    [started] = of(store, PromptStarted)
    assert (started.provider, started.model, started.attempt) == ("main", "m1", 1)
    assert (started.deadline_kind, started.timeout_ms, started.makespan_ms) == ("stall", 250, 500)
    [completed] = of(store, PromptCompleted)
    assert completed.call_id == started.call_id
    assert (completed.input_tokens, completed.output_tokens) == (5, 4)
    assert completed.finish_reason == ("tool_calls" if api == "openai" else "tool_use")
    assert {a.call_id for a in of(store, PromptActivity)} == {started.call_id}
    [succeeded] = of(store, ProviderCallSucceeded, "provider:main")
    assert (succeeded.model, succeeded.agent) == ("m1", "default")
    assert 0 <= succeeded.latency_ms < 2000
    assert seen[0] == started
    assert isinstance(seen[-1], Done)
    [request] = fake.requests
    assert (request.api, request.model, request.stream, request.authorized) == (
        api,
        "m1",
        True,
        True,
    )


@pytest.mark.parametrize("api", APIS)
async def test_a_whole_reply_without_streaming(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    async with provider_layer(config(fake.base_url, api, stream=False), store) as layer:
        reply = await call(layer)
    assert reply.text == "recovered"
    assert tags(store) == ["prompt:started", "prompt:completed"]
    assert fake.requests[0].stream is False


# -- classification -----------------------------------------------------------------------

#: (the fault, the class it gets, its status); None: the class depends on the wire
RETRYABLE: list[tuple[Step, str | None, int | None]] = [
    (Fail(status=408), "request_timeout", 408),
    (Fail(status=500), "server_error", 500),
    (Fail(status=502), "bad_gateway", 502),
    (Fail(status=503), "unavailable", 503),
    (Fail(status=504), "gateway_timeout", 504),
    (Fail(status=529, error_type="overloaded_error"), "overloaded", 529),
    (Reset(after_deltas=1), "connection_reset", None),
    (Cut(after_deltas=2), "stream_cut", None),
    (Cut(after_deltas=1, mid_frame=True), "stream_cut", None),
    (Malformed(after_deltas=1), "malformed", None),
    (Truncated(after_deltas=1), "malformed", None),
    (WrongContentType(), "malformed", None),
    (ErrorEvent(after_deltas=1, error_type="overloaded_error"), None, None),
]


def _id(step: Step) -> str:
    if isinstance(step, Fail):
        return f"fail{step.status}"
    if isinstance(step, Cut) and step.mid_frame:
        return "cut_mid_frame"
    return str(step.__struct_config__.tag)


@pytest.mark.parametrize(("step", "kind", "status"), RETRYABLE, ids=[_id(r[0]) for r in RETRYABLE])
@pytest.mark.parametrize("api", APIS)
async def test_retryable_failures_retry_the_same_model(
    api: str,
    step: Step,
    kind: str | None,
    status: int | None,
    fake: FakeProvider,
    store: EventStore,
) -> None:
    if kind is None:  # OpenAI's error frame has no class; Anthropic's says overloaded_error
        kind = "stream_error" if api == "openai" else "overloaded"
    fake.add(step)
    async with provider_layer(config(fake.base_url, api), store) as layer:
        reply = await call(layer)
    assert reply.text == "recovered"  # nothing of the broken attempt leaks into the reply
    assert models(fake) == ["m1", "m1"]
    assert [t for t in tags(store) if t != "prompt:activity"] == [
        "prompt:started",
        "prompt:failed",
        "prompt:retry_scheduled",
        "prompt:started",
        "prompt:completed",
    ]
    first, second = of(store, PromptStarted)
    [failed] = of(store, PromptFailed)
    assert (failed.call_id, failed.error_class, failed.status) == (first.call_id, kind, status)
    assert failed.retryable
    [retry] = of(store, PromptRetryScheduled)
    assert (retry.call_id, retry.attempt, retry.reason) == (first.call_id, 2, kind)
    assert 0 <= retry.delay_ms <= 10  # full jitter under retry_base_ms
    assert (second.attempt, second.deadline_kind, second.timeout_ms) == (2, "whole_call", 300)
    assert second.makespan_ms == 0
    assert tags(store, "provider:main") == ["provider:call_failed", "provider:call_succeeded"]
    [call_failed] = of(store, ProviderCallFailed, "provider:main")
    assert (call_failed.model, call_failed.error_class, call_failed.status) == ("m1", kind, status)


WHOLE_REPLY_FAULTS: list[tuple[Step, str]] = [
    (Reset(), "connection_reset"),
    (Cut(), "stream_cut"),  # the body ends before its promised length
    (Truncated(), "malformed"),
    (Malformed(), "malformed"),
    (WrongContentType(), "malformed"),
]


@pytest.mark.parametrize(
    ("step", "kind"), WHOLE_REPLY_FAULTS, ids=[_id(step) for step, _ in WHOLE_REPLY_FAULTS]
)
@pytest.mark.parametrize("api", APIS)
async def test_broken_whole_replies_are_typed_and_retried(
    api: str, step: Step, kind: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(step)
    async with provider_layer(config(fake.base_url, api, stream=False), store) as layer:
        reply = await call(layer)
    assert reply.text == "recovered"
    assert models(fake) == ["m1", "m1"]
    assert [f.error_class for f in of(store, PromptFailed)] == [kind]
    assert of(store, PromptRetryScheduled)[0].reason == kind


@pytest.mark.parametrize("api", APIS)
async def test_a_refused_connection_is_retried_then_falls_back(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    dead = {"kind": api, "base_url": f"http://127.0.0.1:{closed_port()}/v1"}
    cfg = config(
        fake.base_url,
        api,
        providers={"dead": dead},
        provider="dead",
        fallback_models=("main:m2",),
    )
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert (reply.provider, reply.model) == ("main", "m2")
    assert models(fake) == ["m2"]
    failures = of(store, ProviderCallFailed, "provider:dead")
    assert [(f.model, f.error_class) for f in failures] == [("m1", "connect")] * 2
    [fallback] = of(store, ModelFallbackAttempt)
    assert (fallback.from_model, fallback.to_model, fallback.reason) == (
        "dead:m1",
        "main:m2",
        "connect",
    )
    assert of(store, ProviderCallSucceeded, "provider:main")[0].model == "m2"


NON_RETRYABLE: list[tuple[Fail, str]] = [
    (Fail(status=400), "bad_request"),
    (Fail(status=401), "auth"),
    (Fail(status=403), "forbidden"),
    (Fail(status=404), "not_found"),
    (Fail(status=422), "bad_request"),
    (Fail(status=400, error_type="content_policy_violation"), "content_policy"),
]


@pytest.mark.parametrize(("step", "kind"), NON_RETRYABLE, ids=[k for _, k in NON_RETRYABLE])
@pytest.mark.parametrize("api", APIS)
async def test_final_failures_are_not_retried_but_fall_back(
    api: str, step: Fail, kind: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(msgspec.structs.replace(step, model="m1", times=0))
    cfg = config(fake.base_url, api, fallback_models=("backup:m2",), max_retries=3)
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert (reply.provider, reply.model) == ("backup", "m2")
    assert models(fake) == ["m1", "m2"]
    assert "prompt:retry_scheduled" not in tags(store)
    [failed] = of(store, PromptFailed)
    assert (failed.error_class, failed.status, failed.retryable) == (kind, step.status, False)
    [fallback] = of(store, ModelFallbackAttempt)
    assert (fallback.from_model, fallback.to_model, fallback.attempt, fallback.reason) == (
        "main:m1",
        "backup:m2",
        1,
        kind,
    )
    # each outcome is in the stream of the provider that had it, naming its model
    assert [(e.model, e.error_class) for e in of(store, ProviderCallFailed, "provider:main")] == [
        ("m1", kind)
    ]
    assert tags(store, "provider:backup") == ["provider:call_succeeded"]


OVERFLOWS: dict[str, Fail] = {
    "openai": Fail(status=400, error_type="context_length_exceeded"),
    "anthropic": Fail(
        status=400,
        body='{"type":"error","error":{"type":"invalid_request_error",'
        '"message":"prompt is too long: 210000 tokens > 200000 maximum"}}',
    ),
}


@pytest.mark.parametrize("too_large", [False, True], ids=["400", "413"])
@pytest.mark.parametrize("api", APIS)
async def test_context_overflow_is_neither_retried_nor_fallen_back(
    api: str, too_large: bool, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=413) if too_large else OVERFLOWS[api])
    cfg = config(fake.base_url, api, fallback_models=("backup:m2",), max_retries=3)
    async with provider_layer(cfg, store) as layer:
        error = await failing(layer)
    assert isinstance(error, ContextOverflowError)
    assert (error.kind, error.retryable, error.provider, error.model) == (
        "context_overflow",
        False,
        "main",
        "m1",
    )
    assert models(fake) == ["m1"]
    assert tags(store) == ["prompt:started", "prompt:failed"]
    assert of(store, PromptFailed)[0].error_class == "context_overflow"


# -- retries ------------------------------------------------------------------------------


async def test_backoff_is_capped_full_jitter(fake: FakeProvider, store: EventStore) -> None:
    fake.add(Fail(status=500, times=0))
    async with provider_layer(config(fake.base_url, max_retries=4), store) as layer:
        error = await failing(layer)
    assert (error.kind, error.status) == ("server_error", 500)
    assert models(fake) == ["m1"] * 5
    retries = of(store, PromptRetryScheduled)
    assert [r.attempt for r in retries] == [2, 3, 4, 5]
    for retry, ceiling in zip(retries, [10, 20, 40, 50], strict=True):
        assert 0 <= retry.delay_ms <= ceiling
    requests = [await finished(fake, index) for index in range(5)]
    for (before, after), retry in zip(itertools.pairwise(requests), retries, strict=True):
        assert before.finished_at is not None
        assert after.started_at - before.finished_at >= retry.delay_ms / 1000 - 0.01
    [exhausted] = of(store, ModelFallbackExhausted)
    assert (exhausted.models, exhausted.reason) == (("main:m1",), "server_error")


def test_backoff_delay_distribution() -> None:
    rng = random.Random(3)
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (9, 8.0)]:
        samples = [backoff_delay(attempt, 500, 8_000, rng) for _ in range(400)]
        assert all(0 <= s <= ceiling for s in samples)
        assert max(samples) > 0.9 * ceiling
        assert min(samples) < 0.1 * ceiling


async def test_retry_after_seconds_is_honoured(fake: FakeProvider, store: EventStore) -> None:
    fake.add(Fail(status=503, retry_after="0.3"))
    async with provider_layer(config(fake.base_url), store) as layer:
        await call(layer)
    [retry] = of(store, PromptRetryScheduled)
    assert retry.delay_ms == 300  # the server's wait, longer than any backoff here
    first, second = await finished(fake, 0), await finished(fake, 1)
    assert first.finished_at is not None
    assert second.started_at - first.finished_at >= 0.29


async def test_429_with_a_short_retry_after_retries_the_same_model_once(
    fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=429, retry_after="0.05", model="m1", times=0))
    cfg = config(fake.base_url, fallback_models=("backup:m2",), max_retries=3)
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert reply.model == "m2"
    assert models(fake) == ["m1", "m1", "m2"]
    [retry] = of(store, PromptRetryScheduled)
    assert (retry.delay_ms, retry.reason) == (50, "rate_limited")
    [fallback] = of(store, ModelFallbackAttempt)
    assert fallback.reason == "rate_limited"


async def test_429_then_success_on_the_same_model(fake: FakeProvider, store: EventStore) -> None:
    past = format_datetime(datetime.fromtimestamp(1_600_000_000, UTC), usegmt=True)
    fake.add(Fail(status=429, retry_after=past))  # an HTTP date already gone: wait 0 s
    cfg = config(fake.base_url, fallback_models=("backup:m2",))
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert (reply.model, models(fake)) == ("m1", ["m1", "m1"])
    [retry] = of(store, PromptRetryScheduled)
    assert retry.delay_ms == 0


def _in_an_hour() -> str:
    return format_datetime(
        datetime.fromtimestamp(math.ceil(SystemClock().now()) + 3600, UTC), usegmt=True
    )


@pytest.mark.parametrize(
    ("status", "retry_after"),
    [(429, "30"), (429, None), (429, "an hour"), (503, "30"), (503, "an hour")],
    ids=["429-30s", "429-none", "429-date", "503-30s", "503-date"],
)
async def test_a_long_or_missing_retry_after_moves_down_the_chain_at_once(
    status: int, retry_after: str | None, fake: FakeProvider, store: EventStore
) -> None:
    if retry_after == "an hour":
        retry_after = _in_an_hour()
    fake.add(Fail(status=status, retry_after=retry_after, model="m1", times=0))
    cfg = config(fake.base_url, fallback_models=("backup:m2",), max_retries=3)
    started = anyio.current_time()
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert anyio.current_time() - started < 2.0
    assert reply.model == "m2"
    assert models(fake) == ["m1", "m2"]
    assert of(store, PromptRetryScheduled) == []
    assert of(store, ModelFallbackAttempt)[0].reason == of(store, PromptFailed)[0].error_class


# -- the prompt deadline ------------------------------------------------------------------


def _timeout_record(store: EventStore, index: int = 0) -> RecordedEvent:
    return [r for r in records(store) if isinstance(r.event, PromptTimeout)][index]


async def _assert_closed_promptly(
    fake: FakeProvider, store: EventStore, index: int, timeout_index: int
) -> RecordedRequest:
    """The aborted request's socket was closed by the client, right at the abort."""
    request = await finished(fake, index)
    assert request.outcome == "client_closed"
    assert request.finished_at is not None
    aborted_at = _timeout_record(store, timeout_index).ts
    assert abs(request.finished_at - aborted_at) < 0.5  # the fake notices within its poll
    return request


@pytest.mark.parametrize("api", APIS)
async def test_a_stall_aborts_then_retries_with_the_whole_call_limit(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Stall(after_deltas=2))
    seen: list[StreamEvent | PromptStarted] = []
    async with provider_layer(config(fake.base_url, api), store) as layer:
        with anyio.fail_after(GUARD):
            reply = await layer.caller().call(SESSION, REQUEST, on_event=seen.append)
    assert reply.text == "recovered"
    starts = [e for e in seen if isinstance(e, PromptStarted)]
    assert starts == of(store, PromptStarted)  # the listener hears each attempt begin
    assert isinstance(seen[-1], Done)
    [timeout] = of(store, PromptTimeout)
    first, second = of(store, PromptStarted)
    assert (timeout.call_id, timeout.limit, timeout.knob, timeout.limit_ms) == (
        first.call_id,
        "stall",
        "prompt_timeout_ms",
        250,
    )
    assert 250 <= timeout.elapsed_ms < 2000
    request = await _assert_closed_promptly(fake, store, 0, 0)
    assert request.deltas_sent == 2
    assert request.finished_at - request.started_at < 2.0  # type: ignore[operator]
    [failed] = of(store, PromptFailed)
    assert (failed.error_class, failed.retryable) == ("timeout_stall", True)
    [retry] = of(store, PromptRetryScheduled)
    assert retry.reason == "timeout_stall"
    assert (second.deadline_kind, second.timeout_ms) == ("whole_call", 300)
    order = tags(store)
    assert order.index("execution:prompt_timeout") < order.index("prompt:failed")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", APIS)
async def test_a_hang_before_the_status_line_is_a_stall(
    api: str, stream: bool, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Hang())
    async with provider_layer(config(fake.base_url, api, stream=stream), store) as layer:
        reply = await call(layer)
    assert reply.text == "recovered"
    [timeout] = of(store, PromptTimeout)
    assert (timeout.limit, timeout.limit_ms) == ("stall", 250)
    assert 250 <= timeout.elapsed_ms < 2000
    first = of(store, PromptStarted)[0]
    assert [a for a in of(store, PromptActivity) if a.call_id == first.call_id] == []
    request = await _assert_closed_promptly(fake, store, 0, 0)
    assert request.deltas_sent == 0


@pytest.mark.parametrize("api", APIS)
async def test_a_steady_stream_outlives_the_stall_budget(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Answer(text="a b c d e f", delay_ms=80))  # ~0.4 s in all, gaps of 80 ms
    cfg = config(fake.base_url, api, stall_ceiling_multiplier=20)
    started = anyio.current_time()
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert anyio.current_time() - started >= 0.25  # longer than the stall budget
    assert reply.text == "a b c d e f"
    assert models(fake) == ["m1"]
    assert "execution:prompt_timeout" not in tags(store)
    assert len(of(store, PromptActivity)) >= 3


@pytest.mark.parametrize("api", APIS)
async def test_the_makespan_ceiling_bounds_a_trickle(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Trickle(interval_ms=30))
    async with provider_layer(config(fake.base_url, api), store) as layer:
        reply = await call(layer)
    assert reply.text == "recovered"
    [timeout] = of(store, PromptTimeout)
    assert (timeout.limit, timeout.knob, timeout.limit_ms) == (
        "makespan",
        "prompt_timeout_ms x stall_ceiling_multiplier",
        500,
    )
    assert 500 <= timeout.elapsed_ms < 2000
    first = of(store, PromptStarted)[0]
    alive = [a for a in of(store, PromptActivity) if a.call_id == first.call_id]
    assert len(alive) >= 5  # it kept streaming, and was still cut at the ceiling
    request = await _assert_closed_promptly(fake, store, 0, 0)
    assert request.deltas_sent >= 5
    with pytest.raises(TimeoutError):  # and nothing more was sent after the abort
        await anyio.to_thread.run_sync(
            lambda: fake.wait_for(lambda rs: rs[0].deltas_sent > request.deltas_sent, 0.1)
        )


@pytest.mark.parametrize("api", APIS)
async def test_the_retry_deadline_does_not_reset_on_activity(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Stall(after_deltas=1), Trickle(interval_ms=30))
    cfg = config(fake.base_url, api, fallback_models=("backup:m2",))
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
    assert (reply.model, reply.text) == ("m2", "recovered")
    assert models(fake) == ["m1", "m1", "m2"]
    stall, retry_deadline = of(store, PromptTimeout)
    assert stall.limit == "stall"
    assert (retry_deadline.limit, retry_deadline.knob, retry_deadline.limit_ms) == (
        "retry_deadline",
        "retry_prompt_timeout_ms",
        300,
    )
    assert 300 <= retry_deadline.elapsed_ms < 2000
    second = of(store, PromptStarted)[1]
    assert retry_deadline.call_id == second.call_id
    assert len([a for a in of(store, PromptActivity) if a.call_id == second.call_id]) >= 3
    await _assert_closed_promptly(fake, store, 1, 1)
    fallback = of(store, PromptStarted)[2]
    assert (fallback.model, fallback.attempt, fallback.deadline_kind) == ("m2", 1, "whole_call")
    assert fallback.timeout_ms == 300
    [attempt] = of(store, ModelFallbackAttempt)
    assert attempt.reason == "timeout_retry_deadline"


async def test_fallback_calls_time_out_as_whole_calls_until_the_chain_is_exhausted(
    fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=400, model="m1"), Trickle(interval_ms=30, model="m2", times=0))
    cfg = config(fake.base_url, fallback_models=("backup:m2",))
    async with provider_layer(cfg, store) as layer:
        error = await failing(layer)
    assert isinstance(error, PromptTimeoutError)
    assert (error.limit, error.kind, error.provider, error.model) == (
        "retry_deadline",
        "timeout_retry_deadline",
        "backup",
        "m2",
    )
    assert models(fake) == ["m1", "m2", "m2"]
    assert [t.limit for t in of(store, PromptTimeout)] == ["retry_deadline"] * 2
    for index in (1, 2):
        request = await _assert_closed_promptly(fake, store, index, index - 1)
        assert request.finished_at - request.started_at < 2.0  # type: ignore[operator]
    # the limit runs from prompt:started (before the request is even sent), so the server
    # sees a little less of it than the caller does: judge the caller's own record
    assert all(300 <= t.elapsed_ms < 2000 for t in of(store, PromptTimeout))
    [exhausted] = of(store, ModelFallbackExhausted)
    assert (exhausted.models, exhausted.reason) == (
        ("main:m1", "backup:m2"),
        "timeout_retry_deadline",
    )
    assert tags(store)[-1] == "model:fallback_exhausted"
    failures = of(store, ProviderCallFailed, "provider:backup")
    assert [(f.model, f.error_class) for f in failures] == [("m2", "timeout_retry_deadline")] * 2


@pytest.mark.parametrize("api", APIS)
async def test_activity_is_recorded_at_most_once_per_interval(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Answer(text=" ".join(["w"] * 40), delay_ms=5))
    cfg = config(fake.base_url, api, activity_interval_ms=50, stall_ceiling_multiplier=20)
    async with provider_layer(cfg, store) as layer:
        await call(layer)
    stamps = [r.ts for r in records(store) if isinstance(r.event, PromptActivity)]
    assert len(stamps) >= 2
    assert all(later - earlier >= 0.05 for earlier, later in itertools.pairwise(stamps))
    assert len(stamps) < fake.requests[0].deltas_sent


@pytest.mark.parametrize("api", APIS)
async def test_thinking_and_tool_call_deltas_are_activity(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(
        Answer(text="", thinking="hmm"),
        Answer(text="", tool_calls=(FakeToolCall(name="f"),)),
        Answer(text="words"),
    )
    async with provider_layer(config(fake.base_url, api), store) as layer:
        for _ in range(3):
            await call(layer)
    starts = [s.call_id for s in of(store, PromptStarted)]
    first_kinds = [
        next(a.kind for a in of(store, PromptActivity) if a.call_id == call_id)
        for call_id in starts
    ]
    assert first_kinds == ["thinking", "tool_call", "text"]


# -- the fallback chain -------------------------------------------------------------------


async def test_the_chain_is_tried_in_order_then_exhausted(
    fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=503, times=0))
    cfg = config(fake.base_url, fallback_models=("backup:m2", "main:m3"), max_retries=0)
    async with provider_layer(cfg, store) as layer:
        error = await failing(layer)
    assert (type(error), error.kind, error.provider, error.model) == (
        ProviderError,
        "unavailable",
        "main",
        "m3",
    )
    assert models(fake) == ["m1", "m2", "m3"]
    attempts = of(store, ModelFallbackAttempt)
    assert [(a.from_model, a.to_model, a.attempt) for a in attempts] == [
        ("main:m1", "backup:m2", 1),
        ("backup:m2", "main:m3", 2),
    ]
    [exhausted] = of(store, ModelFallbackExhausted)
    assert exhausted.models == ("main:m1", "backup:m2", "main:m3")
    assert [e.model for e in of(store, ProviderCallFailed, "provider:main")] == ["m1", "m3"]
    assert [e.model for e in of(store, ProviderCallFailed, "provider:backup")] == ["m2"]


async def test_a_fallback_success_keeps_the_primarys_failures(
    fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=500, model="m1", times=0))
    cfg = config(fake.base_url, fallback_models=("backup:m2",), max_retries=2)
    async with provider_layer(cfg, store) as layer:
        reply = await call(layer)
        assert (reply.provider, reply.model) == ("backup", "m2")
        assert layer.breakers["main"].state.consecutive_failures == 1  # one call: 3 attempts
        assert layer.breakers["backup"].state.consecutive_failures == 0
    rebuilt = load_state(store, "provider:main", BREAKER)
    assert rebuilt.consecutive_failures == 1
    failed = of(store, ProviderCallFailed, "provider:main")
    started = [e.call_id for e in of(store, PromptStarted) if e.model == "m1"]
    assert [f.call_id for f in failed] == started  # each attempt's failure ...
    assert [f.retry_of for f in failed] == ["", *started[:2]]  # ... stands for the one before
    assert tags(store, "provider:main") == ["provider:call_failed"] * 3
    assert tags(store, "provider:backup") == ["provider:call_succeeded"]


@pytest.mark.parametrize("api", APIS)
async def test_vision_requests_use_the_vision_chain(
    api: str, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Fail(status=400, model="m1", times=0))
    cfg = config(
        fake.base_url,
        api,
        fallback_models=("backup:text-model",),
        vision_fallback_models=("backup:vision-model",),
    )
    async with provider_layer(cfg, store) as layer:
        seeing = await call(layer, VISION)
        reading = await call(layer)
    assert (seeing.model, reading.model) == ("vision-model", "text-model")
    assert models(fake) == ["m1", "vision-model", "m1", "text-model"]
    attempts = of(store, ModelFallbackAttempt)
    assert [a.to_model for a in attempts] == ["backup:vision-model", "backup:text-model"]
    sent = msgspec.json.encode(fake.requests[1].body["messages"])
    assert b"AA" in sent
    assert (b"image_url" if api == "openai" else b'"type":"image"') in sent


async def test_a_vision_request_without_a_vision_chain_uses_the_fallbacks(
    fake: FakeProvider, store: EventStore
) -> None:
    cfg = config(fake.base_url, fallback_models=("backup:m2",))
    async with provider_layer(cfg, store) as layer:
        assert layer.caller().chain(VISION) == [("main", "m1"), ("backup", "m2")]


# -- the circuit breaker ------------------------------------------------------------------

BREAKER_SETTINGS = {"breaker_failure_threshold": 3, "breaker_reset_timeout_ms": 60_000}


def breaker_config(fake: FakeProvider, **agent: Any) -> Config:
    return config(
        fake.base_url, settings=BREAKER_SETTINGS, max_retries=0, prompt_timeout_ms=1000, **agent
    )


async def _open_the_breaker(layer: ProviderLayer, fake: FakeProvider) -> None:
    fake.add(Fail(status=500, model="m1", times=3))
    for _ in range(3):
        await failing(layer)
    assert layer.breakers["main"].state.status == "open"


async def test_the_breaker_opens_after_consecutive_failures(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    fake.add(Fail(status=500, model="m1", times=0))
    cfg = breaker_config(fake, fallback_models=("backup:m2",))
    async with provider_layer(cfg, store, clock) as layer:
        for _ in range(4):
            reply = await call(layer)
            assert reply.model == "m2"  # the fallback answers; the primary's count goes on
        state = layer.breakers["main"].state
    assert models(fake) == ["m1", "m2", "m1", "m2", "m1", "m2", "m2"]  # the 4th: no m1
    assert tags(store, "provider:main") == ["provider:call_failed"] * 3 + ["breaker:opened"]
    [opened] = of(store, BreakerOpened, "provider:main")
    assert (opened.failures, opened.threshold, opened.reset_timeout_ms) == (3, 3, 60_000)
    assert (state.status, state.consecutive_failures) == ("open", 3)  # rejections do not count
    assert of(store, ModelFallbackAttempt)[-1].reason == "breaker_open"
    assert len(of(store, PromptStarted)) == 7  # a rejected call never started


async def test_a_rejected_call_raises_at_once_and_does_not_count(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        await _open_the_breaker(layer, fake)
        before = tags(store, "provider:main")
        for _ in range(5):
            error = await failing(layer)
            assert isinstance(error, BreakerOpenError)
            assert (error.kind, error.retryable, error.provider) == ("breaker_open", False, "main")
        assert tags(store, "provider:main") == before
        assert layer.breakers["main"].state.consecutive_failures == 3
    assert len(fake.requests) == 3
    assert of(store, ModelFallbackExhausted)[-1].reason == "breaker_open"


async def test_half_open_admits_one_probe_and_rejects_the_others_at_once(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        await _open_the_breaker(layer, fake)
        clock.advance(60)
        fake.add(Answer(text="probe", first_delay_ms=300, model="m1"))
        outcomes: list[str] = []

        async def other() -> None:
            error = await failing(layer)
            assert isinstance(error, BreakerOpenError)
            assert "half-open" in str(error)
            probe = fake.requests[3]
            outcomes.append(probe.outcome)  # the probe is still in flight: not queued

        async with anyio.create_task_group() as group:
            group.start_soon(call, layer)
            await wait_requests(fake, 4)
            for _ in range(3):
                group.start_soon(other)
        assert outcomes == ["running"] * 3
        assert layer.breakers["main"].state.status == "closed"
        assert (await call(layer)).text == "recovered"
    assert len(fake.requests) == 5
    assert tags(store, "provider:main")[3:] == [
        "breaker:opened",
        "breaker:half_opened",
        "provider:call_succeeded",
        "breaker:closed",
        "provider:call_succeeded",
    ]


async def test_callers_arriving_together_after_the_reset_share_one_probe(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        await _open_the_breaker(layer, fake)
        clock.advance(60)
        fake.add(Answer(text="probe", first_delay_ms=100, model="m1"))
        results: list[str] = []

        async def one() -> None:
            try:
                results.append((await call(layer)).text)
            except BreakerOpenError:
                results.append("rejected")

        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(one)
    assert sorted(results) == ["probe", "rejected", "rejected", "rejected"]
    assert len(fake.requests) == 4
    assert tags(store, "provider:main")[4:] == [
        "breaker:half_opened",
        "provider:call_succeeded",
        "breaker:closed",
    ]


async def test_failures_arriving_together_open_the_breaker_once(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    fake.add(Fail(status=500, times=0))
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        async with anyio.create_task_group() as group:
            for _ in range(6):
                group.start_soon(failing, layer)
        assert layer.breakers["main"].state.status == "open"
    found = tags(store, "provider:main")
    assert found.count("breaker:opened") == 1
    assert found.index("breaker:opened") >= 3


async def test_a_failed_probe_opens_it_again(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        await _open_the_breaker(layer, fake)
        clock.advance(60)
        fake.add(Fail(status=503, model="m1"))
        assert (await failing(layer)).kind == "unavailable"
        state = layer.breakers["main"].state
        assert (state.status, state.opened_at) == ("open", clock.now())
        assert isinstance(await failing(layer), BreakerOpenError)
    assert len(fake.requests) == 4
    assert tags(store, "provider:main")[4:] == [
        "breaker:half_opened",
        "provider:call_failed",
        "breaker:opened",
    ]


async def test_a_cancelled_probe_frees_the_probe_slot(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    async with provider_layer(breaker_config(fake), store, clock) as layer:
        await _open_the_breaker(layer, fake)
        clock.advance(60)
        fake.add(Hang(model="m1"))
        with anyio.move_on_after(0.1):  # the caller gives up (an interrupt, a turn deadline)
            await call(layer)
        assert (await finished(fake, 3)).outcome == "client_closed"
        reply = await call(layer)  # the next caller is the probe; it is not refused
        assert reply.text == "recovered"
        assert layer.breakers["main"].state.status == "closed"


async def test_a_call_from_before_the_breaker_opened_is_no_answer_to_the_probe(
    fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    """A slow answer admitted while the breaker was closed arrives while it is half-open:
    it is not the probe, so the breaker stays half-open until the probe's own outcome."""
    # the stall budget (100 s, from the call's start: its first delta comes after the
    # move) outlasts the reset timeout the clock is moved by
    cfg = config(fake.base_url, settings=BREAKER_SETTINGS, max_retries=0, prompt_timeout_ms=100_000)
    fake.add(Answer(text="late", first_delay_ms=1500, model="m1"))  # past the probe's start
    early_done = anyio.Event()
    probe_scope = anyio.CancelScope()

    async def early() -> None:
        assert (await call(layer)).text == "late"
        early_done.set()

    async def probe() -> None:
        with probe_scope:
            await call(layer)

    async with provider_layer(cfg, store, clock) as layer:
        async with anyio.create_task_group() as group:
            group.start_soon(early)
            await wait_requests(fake, 1)
            await _open_the_breaker(layer, fake)
            clock.advance(60)
            fake.add(Hang(model="m1"))
            group.start_soon(probe)
            await wait_requests(fake, 5)
            with anyio.fail_after(GUARD):
                await early_done.wait()
            assert layer.breakers["main"].state.status == "half_open"
            probe_scope.cancel()  # the probe never answers: its slot is freed
        assert (await call(layer)).text == "recovered"  # the next call is the probe
        assert layer.breakers["main"].state.status == "closed"
    assert tags(store, "provider:main")[3:] == [
        "breaker:opened",
        "breaker:half_opened",
        "provider:call_succeeded",
        "provider:call_succeeded",
        "breaker:closed",
    ]
    assert [e.probe for e in of(store, ProviderCallSucceeded, "provider:main")] == [False, True]


async def test_the_breaker_is_rebuilt_from_the_log(
    fake: FakeProvider, tmp_path: Path, clock: FakeClock
) -> None:
    cfg = breaker_config(fake)
    location = tmp_path / "restart"
    with store_module.open(location) as first:  # type: ignore[attr-defined]
        async with provider_layer(cfg, first, clock) as layer:
            await _open_the_breaker(layer, fake)
        async with provider_layer(cfg, first, clock) as again:  # a new layer, same store
            assert again.breakers["main"].state.status == "open"
            assert isinstance(await failing(again), BreakerOpenError)
    with store_module.open(location) as second:  # type: ignore[attr-defined]
        async with provider_layer(cfg, second, clock) as restarted:  # after a restart
            assert restarted.breakers["main"].state.status == "open"
            assert isinstance(await failing(restarted), BreakerOpenError)
            assert len(fake.requests) == 3
            clock.advance(60)  # the reset timeout counts from the recorded opening
            assert (await call(restarted)).text == "recovered"
            assert restarted.breakers["main"].state.status == "closed"


# -- the API key --------------------------------------------------------------------------

SECRET = "fake-secret-7f3a9c1e5b2d"


@pytest.mark.parametrize("api", APIS)
async def test_the_api_key_is_sent_and_never_leaks(
    api: str,
    store: EventStore,
    monkeypatch: pytest.MonkeyPatch,
    logs: list[MutableMapping[str, Any]],
) -> None:
    monkeypatch.setenv("STALWART_LOOPBACK_KEY", SECRET)
    errors: list[ProviderError] = []
    with FakeProvider(api_key=SECRET) as fake:
        fake.add(Fail(status=401, model="m2"), Reset(model="m2"))  # a revoked key, a reset
        cfg = config(
            fake.base_url,
            api,
            providers={
                "keyed": {
                    "kind": api,
                    "base_url": fake.base_url,
                    "api_key_env": "STALWART_LOOPBACK_KEY",
                }
            },
            fallback_models=("keyed:m2",),
            max_retries=0,
        )
        async with provider_layer(cfg, store) as layer:
            for _ in range(2):
                errors.append(await failing(layer))
            fake.set_default(Answer(text="ok"))
            reply = await call(layer)
            shown = repr(layer.clients) + repr(layer.caller().__dict__) + repr(layer.config)
        requests = fake.requests
    assert reply.text == "ok"
    assert [(r.model, r.authorized) for r in requests] == [
        ("m1", False),  # main has no key: 401
        ("m2", True),
        ("m1", False),
        ("m2", True),
        ("m1", False),
        ("m2", True),
    ]
    assert [(e.provider, e.kind) for e in errors] == [
        ("keyed", "auth"),
        ("keyed", "connection_reset"),
    ]
    assert errors[1].__cause__ is not None  # the transport error is chained, and shown below
    assert [e.error_class for e in of(store, ProviderCallFailed, "provider:main")] == ["auth"] * 3
    assert logs  # the failures were logged...
    texts = [repr(logs), shown]
    texts += ["".join(traceback.format_exception(e)) + repr(e.__cause__) for e in errors]
    texts += [repr(r) + msgspec.json.encode(r.event).decode() for r in store.read_all()]
    for text in texts:
        assert SECRET not in text  # ...and the key is in none of it
