"""A webhook's own retries run on the runtime's Clock: the backoff between attempts and
each attempt's time limit wait for the clock, not for the event loop's real time. The
receiver is a real HTTP server on 127.0.0.1; the timer is the runtime's (a scheduler on a
FakeClock handing expiries to an I/O portal)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from functools import partial
from typing import Any

import pytest

from stalwart.actors import IoPortal, Scheduler, clock_timer
from stalwart.channels import Delivery, OutboundMessage, WebhookChannel
from stalwart.clock import FakeClock, Timer
from stalwart.config import ChannelSettings
from stalwart.errors import ChannelError
from stalwart.events import AnnouncementDelivered
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, has, log_until, until
from tests.test_channels import Receiver, Step
from tests.test_runtime import config

MESSAGE = OutboundMessage(conversation="s1", text="hello", idempotency_key="k-1")
QUIET = 0.3  # real seconds in which nothing may happen while the clock stands still


Logs = list[MutableMapping[str, Any]]


@pytest.fixture
def timer(clock: FakeClock) -> Iterator[tuple[IoPortal, Timer, Scheduler]]:
    portal = IoPortal().start()
    scheduler = Scheduler(clock).start()
    try:
        yield portal, partial(clock_timer, portal, scheduler, clock), scheduler
    finally:
        scheduler.stop()
        portal.stop()


def backing_off(logs: Logs, retries: int = 1) -> bool:
    """The channel has logged its retry: the backoff is armed in the same loop callback,
    before the loop runs anything else."""
    return sum(entry["event"] == "channel.retry_scheduled" for entry in logs) >= retries


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(*steps: Step) -> Receiver:
        made.append(Receiver(*steps))
        return made[-1]

    yield make
    for each in made:
        each.close()


def hook(url: str, on: tuple[IoPortal, Timer, Scheduler], **knobs: object) -> WebhookChannel:
    settings = ChannelSettings(kind="webhook", url=url, **knobs)  # type: ignore[arg-type]
    return WebhookChannel("hook", settings, timer=on[1])


def test_the_backoff_between_attempts_waits_for_the_clock(
    clock: FakeClock,
    timer: tuple[IoPortal, Timer, Scheduler],
    receiver: Callable[..., Receiver],
    logs: Logs,
) -> None:
    got = receiver(Step(429, {"Retry-After": "30"}))
    channel = hook(got.url, timer, retry_cap_ms=60_000)
    portal, _, scheduler = timer
    sent = portal.submit(channel.send, MESSAGE)
    until(lambda: backing_off(logs) and scheduler.pending() == 1)  # the backoff's timer
    time.sleep(QUIET)  # real-time: nothing may fire while the clock stands still
    assert len(got.requests) == 1, "the backoff ran on real time, not on the clock"
    clock.advance(29)
    time.sleep(QUIET)  # real-time: 1 s short of the Retry-After, no retry may come
    assert len(got.requests) == 1, "the Retry-After of 30 s was not waited for"
    clock.advance(1)
    delivery: Delivery = sent.result(GUARD)
    assert (delivery.attempts, delivery.status) == (2, 200)
    portal.submit(channel.aclose).result(GUARD)


def test_an_attempts_time_limit_runs_on_the_clock(
    clock: FakeClock,
    timer: tuple[IoPortal, Timer, Scheduler],
    receiver: Callable[..., Receiver],
) -> None:
    got = receiver(Step(hang=True))
    channel = hook(got.url, timer, timeout_ms=60_000, max_attempts=1)
    portal = timer[0]
    sent = portal.submit(channel.send, MESSAGE)
    until(lambda: len(got.requests) == 1)  # its limit was armed before it was sent
    time.sleep(QUIET)  # real-time: nothing may cut it while the clock stands still
    assert not sent.done()
    clock.advance(60)
    with pytest.raises(ChannelError) as failed:
        sent.result(GUARD)  # httpx's own 60 s timeout is far off in real time
    assert (failed.value.kind, failed.value.attempts) == ("timeout", 1)
    portal.submit(channel.aclose).result(GUARD)


def test_a_runtimes_webhook_retries_on_the_runtimes_clock(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    receiver: Callable[..., Receiver],
    logs: Logs,
) -> None:
    got = receiver(Step(503, {"Retry-After": "20"}))
    fake.add(Answer(text="hi back"))
    channels = {"hook": {"kind": "webhook", "url": got.url, "retry_cap_ms": 25_000}}
    with Runtime(config(fake.base_url, channels=channels), store=store, clock=clock) as rt:
        rt.session("s1", channel="hook").send("hi")
        until(lambda: backing_off(logs))
        time.sleep(QUIET)  # real-time: the backoff is armed just after its log
        assert len(got.requests) == 1, "the runtime's webhook backed off on real time"
        clock.advance(20)  # inside the send's own deadline (announce_timeout_ms, 30 s)
        until(lambda: len(got.requests) == 2)
        log_until(store, "session:s1", has(AnnouncementDelivered))
    assert got.requests[0].headers["idempotency-key"] == got.requests[1].headers["idempotency-key"]
