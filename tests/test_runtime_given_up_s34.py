"""A runtime whose essential part was given up on says so.

Each part is crashed for real (told an object it does not understand) until the runtime
gives up on it (``supervisor:gave_up``); a ``FakeClock`` drives the restarts' backoff.
Then the host is seen to learn it (the activation worker), or the part is seen to stop
speaking for what it watched (a provider's health actor). A real LMDB store, the fake
provider over loopback, MemoryChannels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from stalwart.actors import (
    DEGRADED_TEXT,
    FAILED_TEXT,
    ActivationWorker,
    ContextStoreActor,
    ProviderHealthActor,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import SessionsStoppedError
from stalwart.events import (
    ActivationLeased,
    ActivationReady,
    ProviderDegraded,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Fail, FakeProvider
from tests._runtime_support import (
    GUARD,
    delivered,
    give_up_on,
    has,
    log_until,
    of,
    runtime_config,
)


def config(base_url: str) -> Config:
    # one failed call degrades the provider; its quiet window (60 s) is never reached here
    return runtime_config(base_url, health={"consecutive_failures": 1})


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


# -- the activation worker given up on ---------------------------------------------------------


# Was: DEFECT: a send after the activation worker was given up on returned as if all were well
def test_a_send_after_the_worker_was_given_up_on_raises_and_the_next_runtime_answers_it(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    session = rt.session("s1", channel="chat")
    give_up_on(rt, store, clock, ActivationWorker)
    with pytest.raises(SessionsStoppedError, match="runs no session's work") as raised:
        session.send("are you there?")
    assert (raised.value.part, raised.value.session) == ("activations", "session:s1")
    assert "activations" in rt.given_up()  # what a host can look at too
    [ready] = of(ActivationReady, list(store.read_stream("session:s1")))
    assert ready.text == "are you there?"  # recorded all the same: durable
    rt.close()

    later = MemoryChannel("chat")
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": later}) as nxt:
        [answer] = delivered(nxt, later, 1)
        assert answer.text == "default answer"
        assert nxt.given_up() == {}


# Was: DEFECT: asking for the worker's report after it was given up on waited out the timeout
def test_asking_the_worker_given_up_on_fails_at_once_and_says_so(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_on(rt, store, clock, ActivationWorker)
    began = time.monotonic()  # real-time: the ask's own wait is on the system clock
    with pytest.raises(TimeoutError, match="gave up on it"):
        rt.worker(timeout=60.0)
    assert time.monotonic() - began < GUARD  # real-time: the bound is a real wait


# Was: DEFECT: with the context engine given up on, every message failed and was abandoned
def test_a_send_after_the_context_engine_was_given_up_on_is_left_to_the_next_runtime(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    session = rt.session("s1", channel="chat")
    give_up_on(rt, store, clock, ContextStoreActor)
    with pytest.raises(SessionsStoppedError, match="context engine") as raised:
        session.send("are you there?")
    assert raised.value.part == "context"
    rt.worker(GUARD)  # the worker handled every tell before: it leased nothing
    clock.advance(60)  # its polls come and go
    rt.worker(GUARD)
    assert not of(ActivationLeased, list(store.read_stream("session:s1")))
    rt.close()

    later = MemoryChannel("chat")
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": later}) as nxt:
        [answer] = delivered(nxt, later, 1)
        assert answer.text == "default answer"


# -- a provider's health actor given up on -----------------------------------------------------


# Was: DEFECT: a degraded provider whose health actor was given up on deferred every message
def test_a_degraded_provider_whose_health_actor_was_given_up_on_is_called_again(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.add(Fail(status=503))
    session = rt.session("s1", channel="chat")
    session.send("one")
    assert delivered(rt, chat, 1)[0].text == FAILED_TEXT
    log_until(store, "provider:main", has(ProviderDegraded))
    assert rt.health_view.is_degraded("main")
    give_up_on(rt, store, clock, ProviderHealthActor)
    assert not rt.health_view.is_degraded("main")  # it no longer speaks for the provider
    calls = len(fake.requests)

    session.send("two")
    answer = delivered(rt, chat, 2)[1]
    assert answer.text == "default answer" != DEGRADED_TEXT
    assert len(fake.requests) == calls + 1  # the provider was called
    assert "health:main" in rt.given_up()
