"""Review of two commits: the Agent's replies bounded on the runtime's Clock
(``send_by_clock``, 74fdb85) and the health monitor and the breaker counting calls, not
attempts (be9a469). The review found three defects, all fixed: the tests say what each
was ("Once") and check the fix; the others cover risky corners that held.

Real parts only: a real LMDB store in a temp dir, the fake provider over loopback HTTP,
MemoryChannel / ConsoleChannel, the runtime's own actors; time from the FakeClock.
"""

from __future__ import annotations

import os
import random
import select
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, suppress
from types import FrameType
from typing import Any

import anyio
import pytest

from stalwart.channels import ConsoleChannel, MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.errors import ProviderError
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    BreakerOpened,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    ProviderCallFailed,
    ProviderDegraded,
    RecordedEvent,
)
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer, Runtime
from stalwart.state import HEALTH, decide_health
from stalwart.store import EventStore, load_state
from stalwart.testing import Answer, Fail, FakeProvider
from tests._runtime_support import (
    GUARD,
    RETRYING,
    advance_until,
    agent_settings,
    delivered_by_clock,
    has,
    log_until,
    of,
    runtime_config,
    until,
)

SESSION = "session:s1"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
#: seed 000's monitor, as configured by default
HEALTH_KNOBS: dict[str, int] = {"window_ms": 60_000, "min_agents": 2, "consecutive": 3}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _degraded(store: EventStore, now: float) -> bool:
    """Whether the provider health monitor holds ``provider:main`` degraded at ``now``:
    recorded so, or due to be on its fold of the log (as the ProviderHealth actor and
    ``replay --verify`` fold it)."""
    state = load_state(store, "provider:main", HEALTH, use_snapshots=False)
    due = decide_health(state, now, **HEALTH_KNOBS)
    return state.status == "degraded" or any(isinstance(e, ProviderDegraded) for e in due)


# -- be9a469: a failure is a call's -----------------------------------------------------------


@asynccontextmanager
async def _layer(cfg: Config, store: EventStore, clock: FakeClock) -> AsyncIterator[ProviderLayer]:
    layer = ProviderLayer(cfg, store, clock=clock, rng=random.Random(7))
    try:
        yield layer
    finally:
        await layer.aclose()


def _retrying(fake: FakeProvider, **provider: Any) -> Config:
    """Provider ``main`` (its knobs: ``provider``) and agent ``default`` with the default
    ``max_retries`` (2) and a millisecond backoff, so attempts follow each other at once."""
    main = {"kind": "openai", "base_url": fake.base_url, "connect_timeout_ms": 1000, **provider}
    agent = agent_settings(2_000, **RETRYING)
    return parse_config({"providers": {"main": main}, "agents": {"default": agent}})


@pytest.mark.anyio
async def test_a_failed_probe_whose_retry_the_breaker_refuses_is_still_a_failed_call(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """The provider answers 500 to everything. The breaker (threshold 1, reset 10 s)
    opens on the first failed call; each later call, 10 s on, is the half-open probe,
    whose failure opens the breaker again, so its scheduled retry is refused at once
    (``breaker_open``, no ``prompt:started`` for attempt 2).

    Once: the first design marked a failure ``retried`` before its retry ran, and the
    monitor skipped it; the probe's failure never counted, so one agent failing three
    calls in a row within 20 s never degraded the provider.

    Correct: a failed call counts from its first failed attempt (a retry's outcome takes
    its place), so a retry that never runs leaves the failure counted: three here."""
    fake.set_default(Fail(status=500))
    cfg = _retrying(fake, breaker_failure_threshold=1, breaker_reset_timeout_ms=10_000)
    async with _layer(cfg, store, clock) as layer:
        for index in range(3):
            if index:
                clock.advance(10)  # the reset timeout: the next call is the probe
            with anyio.fail_after(GUARD), pytest.raises(ProviderError):
                await layer.caller().call(SESSION, REQUEST)
    provider = [r.event for r in store.read_stream("provider:main")]
    failed = [e for e in provider if isinstance(e, ProviderCallFailed)]
    # each call: one attempt, whose failure opens the breaker and so refuses its retry
    assert [bool(e.retry_of) for e in failed] == [False, False, False]
    assert sum(isinstance(e, BreakerOpened) for e in provider) == 3
    session = [r.event for r in store.read_stream(SESSION)]
    scheduled = [e.attempt for e in session if isinstance(e, PromptRetryScheduled)]
    started = [e.attempt for e in session if isinstance(e, PromptStarted)]
    assert scheduled == [2, 2, 2]  # each call's retry was scheduled ...
    assert started == [1, 1, 1]  # ... and never started
    assert len(fake.requests) == 3
    # three failed calls of one agent within 20 s: the monitor must see three
    assert _degraded(store, clock.now()), "three failed calls in a row, not degraded"


def test_a_call_cut_during_its_retry_backoff_still_counts_as_a_failed_call(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The provider answers 503 with ``Retry-After: 10`` (under the 20 s the caller
    waits out on the same model): every call's first attempt fails, and the caller
    sleeps 10 s (on the Clock) before its retry. The turn's execution timeout
    (``supervision.execution_timeout_ms``, 5 s on the Clock) fires during that sleep: the
    Agent aborts the turn and cancels the call, so the retry never happens. Three such
    turns in a row, 6 s apart.

    Once: each call's only failure was recorded ``retried`` and skipped by the monitor:
    the provider failed one agent's calls three times in a row and was not degraded
    (the same for any call cancelled during a backoff: an interrupt, a takeover).

    Correct: the three failed calls count, and the monitor decides ``provider:degraded``
    (consecutive)."""
    fake.set_default(Fail(status=503, retry_after="10"))
    cfg = runtime_config(
        fake.base_url,
        agents={
            "default": {
                "provider": "main",
                "model": "m1",
                "prompt_timeout_ms": 2_000,
                "retry_prompt_timeout_ms": 2_000,
                "max_retries": 2,
            }
        },
        supervision={"execution_timeout_ms": 5_000},
        dead_letters={"close_grace_ms": 0},
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        for count in (1, 2, 3):
            session.send(f"message {count}")
            log_until(store, SESSION, has(PromptRetryScheduled, count))  # in its backoff
            clock.advance(6)  # the turn's execution timeout, on the Clock
            until(lambda n=count: len(chat.messages) >= n)  # the turn was aborted
    failed = of(ProviderCallFailed, list(store.read_stream("provider:main")))
    assert [e.retry_of for e in failed] == ["", "", ""]  # no retry ever ran
    assert len(fake.requests) == 3
    assert _degraded(store, clock.now()), "three failed calls in a row, not degraded"


# -- 74fdb85: the Agent's replies bounded on the Clock ----------------------------------------


@pytest.fixture
def full_pipe() -> Iterator[tuple[int, int]]:
    """A real pipe whose buffer is full: the next write to it blocks until it is read
    (a console piped into a reader that has fallen behind: ``stalwart run | less``)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        while True:
            os.write(write_fd, b"." * 65_536)
    except BlockingIOError:
        pass
    os.set_blocking(write_fd, True)
    try:
        yield read_fd, write_fd
    finally:
        for fd in (read_fd, write_fd):
            with suppress(OSError):
                os.close(fd)


def _drain_until(read_fd: int, needle: bytes) -> bytes:
    """Read the pipe (freeing the blocked writer) until ``needle`` came through."""
    seen = b""
    give_up = time.monotonic() + GUARD
    while needle not in seen:
        left = give_up - time.monotonic()
        assert left > 0, f"{needle!r} never reached the pipe"
        ready, _, _ = select.select([read_fd], [], [], min(left, 0.1))
        if ready:
            seen = (seen + os.read(read_fd, 65_536))[-4096:]
    return seen


def _console_writing() -> bool:
    """True when a thread is inside the console's write (blocked on the full pipe); the
    event loop is not: the console writes on a thread of its own."""
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            if frame.f_code is ConsoleChannel._write.__code__:
                return True
            frame = frame.f_back
    return False


def _outcome(store: EventStore, announcement_id: str) -> RecordedEvent | None:
    for record in store.read_stream(SESSION):
        event = record.event
        if (
            isinstance(event, AnnouncementDelivered | AnnouncementSendFailed)
            and event.announcement_id == announcement_id
        ):
            return record
    return None


def test_a_reply_the_channel_delivered_is_not_recorded_as_timed_out(
    store: EventStore, clock: FakeClock, fake: FakeProvider, full_pipe: tuple[int, int]
) -> None:
    """The session's channel is stalwart's ``ConsoleChannel`` on a pipe whose reader has
    fallen behind: the answer's write blocks (once begun, it runs to its end whatever
    cuts the send). The send's deadline (``announce_timeout_ms``, 1 s) passes on the
    Clock meanwhile; then the reader catches up and the answer is written.

    Once: the Clock timer cancelled the portal's future, and ``send_by_clock`` took a
    cancelled future for a send that did not happen: ``announcement:send_failed``
    (``timeout``) was recorded and the answer dead-lettered (the user saw it twice),
    while the coroutine, which never reached a checkpoint, went on and delivered it.

    Correct: the outcome is what the send did: the timer cuts a cancel scope inside the
    send, and the send's own result (delivered) is recorded."""
    read_fd, write_fd = full_pipe
    fake.set_default(Answer(text="the answer"))
    cfg = runtime_config(
        fake.base_url, dead_letters={"announce_timeout_ms": 1_000, "close_grace_ms": 0}
    )
    with os.fdopen(os.dup(write_fd), "w") as stream:
        console = ConsoleChannel("console", stream=stream)
        with Runtime(cfg, store=store, clock=clock, channels={"console": console}) as rt:
            rt.session("s1", channel="console").send("hello")
            records = log_until(store, SESSION, has(AnnouncementQueued))
            [queued] = of(AnnouncementQueued, records)
            until(_console_writing)  # the answer's write is under way, blocked
            clock.advance(1.5)  # its deadline passes on the Clock
            _drain_until(read_fd, b"[s1] the answer\n")  # the reader catches up
            outcome = until(lambda: _outcome(store, queued.announcement_id))
            assert isinstance(outcome.event, AnnouncementDelivered), (
                "the answer reached the console, but the log says "
                f"{outcome.type} ({getattr(outcome.event, 'error_class', None)})"
            )


def test_a_reply_cut_off_by_close_is_not_timed_out_after_the_portal_stopped(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Coverage: the answer's send hangs when the runtime closes (no close grace): the
    portal stops and cancels it, and its Clock deadline passes only afterwards. The
    stopped send's timer records nothing (no ``announcement:send_failed`` at a time no
    runtime ran, no dead letter), and the next runtime on the log sends the answer once
    its in-flight wait has passed on the Clock, and records it delivered."""
    fake.set_default(Answer(text="the answer"))
    cfg = runtime_config(
        fake.base_url, dead_letters={"announce_timeout_ms": 1_000, "close_grace_ms": 0}
    )
    chat.hang_next(1)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        records = log_until(store, SESSION, has(AnnouncementQueued))
        [queued] = of(AnnouncementQueued, records)
        until(lambda: len(chat.attempted) >= 1)  # the send is in flight, hanging
    clock.advance(2)  # the send's deadline, after the portal stopped
    time.sleep(0.05)  # real-time: a timer that (wrongly) fired would tell someone now
    assert _outcome(store, queued.announcement_id) is None
    assert not list(store.read_stream("deadletter"))
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}):
        # the in-flight wait (timeout + grace) passes on the Clock; the new Agent resends
        outcome = advance_until(clock, lambda: _outcome(store, queued.announcement_id), 1)
    assert isinstance(outcome.event, AnnouncementDelivered)
    assert [m.text for m in chat.messages] == ["the answer"]


def test_each_retried_failure_is_followed_by_its_retry_and_the_log_verifies(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Coverage: through a 503 (backoff), a 429 with a short Retry-After (retried once
    per model) and a second 429 (the chain moves on to ``backup``), each attempt's
    ``provider:call_failed`` names the attempt it retried exactly when that one had its
    ``prompt:retry_scheduled``, the breaker counts the one failed call, and
    ``replay --verify`` re-derives every retry and breaker decision from the log."""
    fake.add(Fail(status=503, model="m1"), Fail(status=429, retry_after="0", model="m1", times=2))
    fake.set_default(Answer(text="from the backup"))
    agent = agent_settings(2_000, **RETRYING, fallback_models=("backup:m2",))
    main = {"kind": "openai", "base_url": fake.base_url, "breaker_failure_threshold": 2}
    cfg = runtime_config(
        fake.base_url,
        providers={"main": main, "backup": dict(main)},
        agents={"default": agent},
        dead_letters={"close_grace_ms": 0},
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        delivered_by_clock(clock, chat, 1)  # the 503's backoff runs on the Clock
    assert [m.text for m in chat.messages] == ["from the backup"]
    session = [r.event for r in store.read_stream(SESSION)]
    failed_calls = [e.call_id for e in session if isinstance(e, PromptFailed)]
    retried_calls = [e.call_id for e in session if isinstance(e, PromptRetryScheduled)]
    provider = [r.event for r in store.read_stream("provider:main")]
    failed = [e for e in provider if isinstance(e, ProviderCallFailed)]
    assert [e.call_id for e in failed] == failed_calls
    # each retry's outcome names the attempt it retried: the two with a retry scheduled
    assert [e.retry_of for e in failed] == ["", *retried_calls]
    assert retried_calls == failed_calls[:2]
    assert not any(isinstance(e, BreakerOpened) for e in provider)  # one failed call of 2
    report = verify_store(store, None)
    assert report.clean, report
    assert report.checked.get("prompt:retry_scheduled") == 2
