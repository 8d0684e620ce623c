"""The runtime's own actors through a store outage (PostgreSQL unreachable for a
while): a store error on a timer's or a follower's message is waited out and the message
handled again, not a crash. Each crash cost a restart, lost what the actor held in
memory (the dead-letter queue's send outcomes not yet recorded), and a store that came
and went three times within the restart window made supervision give the actor up for
good: no more outage detection, no more dead-letter retries, and nobody told."""

from __future__ import annotations

from typing import Any

import pykka

from stalwart.actors import (
    DeadLetterActor,
    Enqueue,
    IoPortal,
    PollHealth,
    ProviderHealthActor,
    RetryDue,
    Scheduler,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings, HealthSettings
from stalwart.store import EventStore, PostgresEventStore
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import GUARD, until
from tests.test_deadletter_health_review_s32 import BACK, Logs, _failed, _logged, _report


def _dead_or_logged(ref: pykka.ActorRef[Any], logs: Logs, name: str) -> bool:
    return not ref.is_alive() or _logged(logs, name)


# Was: DEFECT: a health check during a store outage crashed the health actor (a restart each; three in the window: given up for good)  # noqa: E501
def test_the_health_actor_waits_a_store_outage_out(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    logs: Logs,
) -> None:
    ref = ProviderHealthActor.start(
        relayed_store, clock, scheduler, "p", HealthSettings(), follow=False
    )
    try:
        assert not _report(ref).degraded  # started (its start reads the stream)
        relay.cut_now()
        ref.tell(PollHealth())  # as the follower or a call's outcome tells it
        until(  # real-time: the pool gives up connecting after its timeout
            lambda: _dead_or_logged(ref, logs, "health.store_unreachable"),
            BACK,
            what="the check met the outage",
        )
        assert ref.is_alive()
        relay.restore()
        until(lambda: reachable(relayed_store), BACK, what="the store back")  # real-time
        pg_store.append("provider:p", [_failed("a"), _failed("b")])
        clock.advance(1.0)  # the check is tried again on the runtime's clock
        until(lambda: _report(ref).degraded, BACK, what="the outage decided")  # real-time
        assert _logged(logs, "health.store_back")
    finally:
        ref.stop(timeout=GUARD)


# Was: DEFECT: a dead-letter retry tick during a store outage crashed the queue's actor (send outcomes held in memory lost)  # noqa: E501
def test_the_dead_letter_queue_waits_a_store_outage_out(
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    logs: Logs,
) -> None:
    chat = MemoryChannel("chat")
    ref = DeadLetterActor.start(
        store=relayed_store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels={"chat": chat},
        settings=DeadLetterSettings(),
    )
    try:
        entry = Enqueue("a-1", "chat", "conv-1", "the answer", "timeout")
        ref.ask(entry, timeout=GUARD)  # a reply whose send failed, queued before the outage
        relay.cut_now()
        clock.advance(DeadLetterSettings().retry_cap_ms / 1000)  # its retry is due
        ref.tell(RetryDue(at=clock.now()))  # as its retry timer tells it
        until(  # real-time: the pool gives up connecting after its timeout
            lambda: _dead_or_logged(ref, logs, "deadletter.store_unreachable"),
            BACK,
            what="the tick met the outage",
        )
        assert ref.is_alive()
        relay.restore()
        until(lambda: reachable(relayed_store), BACK, what="the store back")  # real-time
        clock.advance(1.0)
        until(lambda: _logged(logs, "deadletter.store_back"), BACK, what="the tick again")
        assert ref.is_alive()
        until(lambda: chat.messages, GUARD, what="the retry's send")  # real-time: the portal
        assert [m.text for m in chat.messages] == ["the answer"]  # once the store was back
    finally:
        ref.stop(timeout=GUARD)
