"""A runtime part down or given up on (session 35): what the others still do.

Each part is crashed for real (told an object it does not understand) until the runtime
restarts it or gives up on it (``supervisor:gave_up``); a ``FakeClock`` drives the
restarts' backoff. A real LMDB store, the fake provider over loopback, MemoryChannels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from typing import Any

import pykka
import pytest

from stalwart.actors import (
    ActivationWorker,
    ContextStoreActor,
    DeadLetterActor,
    Enqueue,
    GetHealth,
    HealthReport,
    ProviderHealthActor,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import SessionsStoppedError
from stalwart.events import (
    ActivationRequeued,
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementSendFailed,
    SupervisorGaveUp,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import (
    GUARD,
    crash_decided,
    delivered,
    delivered_by_clock,
    give_up_on,
    has,
    log_until,
    of,
    runtime_config,
    until,
)

Logs = list[MutableMapping[str, Any]]
#: the backoffs of the restarts before a give-up (supervision's defaults), in seconds
BACKOFFS_S = (0.1, 0.2, 0.4)


def config(base_url: str) -> Config:
    """Two providers (``main`` answers; ``backup`` is only watched)."""
    provider = {"kind": "openai", "base_url": base_url}
    return runtime_config(base_url, providers={"main": provider, "backup": provider})


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def health_actor(provider: str) -> pykka.ActorRef[Any]:
    """The running health actor of ``provider`` (pykka's registry: no runtime internals)."""
    for ref in pykka.ActorRegistry.get_by_class(ProviderHealthActor):
        report = ref.ask(GetHealth(), timeout=GUARD)
        if report.provider == provider:
            return ref
    raise AssertionError(f"no health actor runs for {provider!r}")


def give_up_health(rt: Runtime, store: EventStore, clock: FakeClock, provider: str) -> None:
    """Crash ``provider``'s health actor until supervision gives up on it."""
    part = f"health:{provider}"

    def decisions(records: list[Any]) -> list[Any]:
        decided = of((SupervisorRestarted, SupervisorGaveUp), records)
        return [decision for decision in decided if decision.actor == part]

    for count in range(1, 5):
        health_actor(provider).tell(object())  # an unhandled exception: it dies
        records = log_until(store, "runtime", lambda rs, n=count: len(decisions(rs)) >= n)
        with rt._restarts_lock:  # the decision is appended and acted on under it
            pass
        if count <= len(BACKOFFS_S):
            assert isinstance(decisions(records)[-1], SupervisorRestarted)
            clock.advance(BACKOFFS_S[count - 1] + 0.005)
            health_actor(provider)  # started again
    assert isinstance(decisions(records)[-1], SupervisorGaveUp)


def logged(logs: Logs, event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry.get("event") == event]


# -- item 1: one provider's health actor given up on -------------------------------------------


# Was: DEFECT: rt.health() raised for all providers once one's health actor was given up on
def test_health_reports_every_provider_and_marks_the_one_whose_actor_was_given_up_on(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_health(rt, store, clock, "backup")
    reports = rt.health(timeout=GUARD)
    assert reports["main"] == HealthReport(provider="main")  # its actor answers as ever
    backup = reports["backup"]
    assert (backup.status, backup.rule, backup.since) == ("healthy", "unwatched", clock.now())
    assert rt.health_view["backup"] == backup  # the same report, read without an ask
    assert "health:backup" in rt.given_up()


# -- item 2: the context engine restarting while a turn assembles ------------------------------


# Was: DEFECT: a turn assembled while the context engine restarted failed as internal
def test_a_turn_during_the_context_engines_restart_waits_for_it_and_is_answered(
    logs: Logs,
    rt: Runtime,
    store: EventStore,
    clock: FakeClock,
    chat: MemoryChannel,
) -> None:
    session = rt.session("s1", channel="chat")
    assert isinstance(crash_decided(rt, store, ContextStoreActor, 1), SupervisorRestarted)  # 100 ms
    session.send("hello")

    def turn_reached_the_engine() -> bool:  # waiting for it, or (before) failed at once
        failed = of(ActivationRequeued, list(store.read_stream("session:s1")))
        return bool(logged(logs, "runtime.part_awaited") or failed)

    until(turn_reached_the_engine, what="the turn reached the context engine")
    assert not of(ActivationRequeued, list(store.read_stream("session:s1")))  # not failed
    clock.advance(BACKOFFS_S[0] + 0.005)  # the engine's restart
    [answer] = delivered(rt, chat, 1)
    assert answer.text == "default answer"
    assert not of(ActivationRequeued, list(store.read_stream("session:s1")))
    assert rt.given_up() == {}


# -- item 3: the activation worker given up on --------------------------------------------------


# Was: DEFECT: every tell to a dead activation worker logged durable.worker_dead again
def test_a_dead_activation_worker_is_logged_once_however_often_it_is_told(
    logs: Logs, rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    session = rt.session("s1", channel="chat")
    give_up_on(rt, store, clock, ActivationWorker)
    for text in ("one", "two", "three"):
        with pytest.raises(SessionsStoppedError):  # refused as before: recorded, not run
            session.send(text)
    [dead] = logged(logs, "durable.worker_dead")
    assert dead["given_up"] is True


# -- item 4: the dead-letter queue given up on ---------------------------------------------------


# Was: DEFECT: an answer whose send failed after the dead-letter queue was given up on was lost
def test_a_failed_send_after_the_queue_was_given_up_on_is_recorded_for_the_next_runtime(
    rt: Runtime, store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    give_up_on(rt, store, clock, DeadLetterActor)
    chat.fail_next(1)
    rt.session("s1", channel="chat").send("hello")
    [attempt] = delivered(rt, chat, 1, attempted=True)
    records = log_until(store, "deadletter", has(AnnouncementDeadLettered))
    [entry] = of(AnnouncementDeadLettered, records)
    assert (entry.channel, entry.text, entry.conversation) == ("chat", attempt.text, "s1")
    log_until(store, "session:s1", has(AnnouncementSendFailed))  # the failure, after it
    assert rt.given_up() == {"deadletter": 0}  # taken, not refused
    rt.close()

    later = MemoryChannel("chat")
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": later}):
        [retried] = delivered_by_clock(clock, later, 1, step_s=5.0)  # the retry's backoff
        assert retried.text == attempt.text
        log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered))


# -- the dead-letter queue's mail through its restarts -------------------------------------------


# Was: DEFECT: an entry held through the queue's restart was lost when the restarted queue died
def test_an_entry_held_for_a_restarted_queue_that_dies_again_reaches_the_next_one(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    assert isinstance(crash_decided(rt, store, DeadLetterActor, 1), SupervisorRestarted)
    assert rt._parts is not None
    rt._parts.dead_letters_ref.tell(object())  # held: the restarted queue dies of it
    chat.fail_next(1)
    rt.session("s1", channel="chat").send("hello")
    log_until(store, "session:s1", has(AnnouncementSendFailed))  # its entry is held
    clock.advance(BACKOFFS_S[0] + 0.005)  # restarted: told the poison, then the entry
    decided = (SupervisorRestarted, SupervisorGaveUp)
    assert isinstance(
        of(decided, log_until(store, "runtime", has(decided, 2)))[-1], SupervisorRestarted
    )
    with rt._restarts_lock:  # the decision is appended and acted on under it
        pass
    clock.advance(BACKOFFS_S[1] + 0.005)  # restarted again
    [entry] = of(
        AnnouncementDeadLettered, log_until(store, "deadletter", has(AnnouncementDeadLettered))
    )
    assert (entry.channel, entry.conversation) == ("chat", "s1")
    assert rt.dead_letters(GUARD).entries[0].entry_id == entry.entry_id


# Was: DEFECT: two tells of one failed answer to the given-up queue at once (its held copy
# and the asker's retell) both folded the stream, both missed the other and both appended:
# two entries, and the next runtime delivered the answer twice
def test_one_answer_told_at_once_from_many_threads_is_recorded_once(
    rt: Runtime, store: EventStore, clock: FakeClock
) -> None:
    give_up_on(rt, store, clock, DeadLetterActor)
    assert rt._parts is not None
    enqueue = Enqueue(
        announcement_id="a1", channel="chat", conversation="s1", text="hi", reason="timeout"
    )
    start = threading.Barrier(8)

    def tell() -> None:
        start.wait()
        assert rt._parts is not None
        rt._parts.dead_letters_ref.tell(enqueue)

    threads = [threading.Thread(target=tell) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD)
    entries = of(AnnouncementDeadLettered, list(store.read_stream("deadletter")))
    assert [e.announcement_id for e in entries] == ["a1"]
