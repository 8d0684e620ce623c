"""Wakes after a failure the worker noticed: one handed to an Agent whose turn still runs
under an older lease, and one requeued because its Agent died.

In the first, the worker that leased the running turn died and was restarted under a
new owner: the old lease stopped being renewed, expired, and the new worker took the
session over at a new epoch, handing its wake to the same Agent, still busy with the
old turn's model call. Real parts: a runtime on a real LMDB store, the loopback fake
provider, the clock driven by the test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pykka
import pytest

from stalwart.actors import ActivationWorker
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import ActivationAcked, ActivationLeased, ActivationRequeued, TurnCompleted
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, Hang
from tests._runtime_support import (
    GUARD,
    crashed_mid_wake,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
    until,
)
from tests.test_supervision_review_two import armed, clean, decided

#: a long model call: no prompt timeout fires while the test moves the clock
LONG_MS = 600_000


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    config = runtime_config(
        fake.base_url,
        prompt_timeout_ms=LONG_MS,
        activations={"lease_ttl_ms": 2_000, "renew_every_ms": 500},
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def _worker() -> pykka.ActorRef[Any]:
    [ref] = pykka.ActorRegistry.get_by_class(ActivationWorker)
    return ref


# Was: DEFECT: a takeover's wake reaching an Agent still in the old turn was dropped for good
def test_a_takeover_wake_for_a_busy_agent_runs_instead_of_being_dropped(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The Agent logged ``agent.wake_while_running`` and dropped the new wake; the new
    worker renewed a lease nobody ran, for ever, and the user never heard back. The old
    turn's lease is gone (its appends are fenced out), so the Agent stops it and runs
    the new wake."""
    fake.add(Hang(), Answer(text="late answer"))
    first_owner = rt.worker().owner
    rt.session("s1", channel="chat").send("long job")
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    _worker().tell(object())  # the worker crashes: its lease is no longer renewed
    [restarted] = decided(store, 1)
    assert restarted.actor == "activations"
    armed(rt)
    clock.advance(0.11)  # the restart's backoff: a worker under a new owner
    until(lambda: rt.worker().owner != first_owner)
    for _ in range(8):  # the old lease expires; the new worker takes the session over
        clock.advance(0.5)
    records = log_until(store, "session:s1", has(ActivationLeased, 2))
    assert [e.epoch for e in of(ActivationLeased, records)] == [1, 2]
    assert fake.wait_finished(0, GUARD).outcome == "client_closed"  # the old call stopped
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "late answer"
    records = log_until(store, "session:s1", has(ActivationAcked))
    [acked] = of(ActivationAcked, records)
    assert acked.epoch == 2
    ended = of(TurnCompleted, records)
    assert [t.outcome for t in ended] == ["interrupted", "answered"]
    clean(store)


# Was: DEFECT: the worker's own retries (an Agent that died) took no jitter: jitter_ms unused
def test_a_wake_whose_agent_died_is_requeued_with_the_configured_jitter(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``activations.jitter_ms`` reached the Agent's own requeues only: the failures the
    worker settles itself (an Agent that died mid-wake) were requeued with none, so the
    wakes of many Agents killed together all came back at one instant. The jitter is
    recorded in the requeue, and ``replay --verify`` re-derives it."""
    config = runtime_config(fake.base_url, activations={"jitter_ms": 1_000_000})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        _, records = crashed_mid_wake(rt, fake, store)
    [requeued] = of(ActivationRequeued, records)
    assert requeued.error_class == "agent_crashed"
    assert 0 < requeued.jitter_ms <= 1_000_000  # 0 with a chance of one in a million
    assert requeued.run_at == pytest.approx(clock.now() + 2.0 + requeued.jitter_ms / 1000)
    clean(store)
