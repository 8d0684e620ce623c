"""Review of the dead-letter queue and the provider-health monitor (seed 000): defects a
production user would hit, each proved by a test that fails on the code as it stands.

Real parts only: an LMDB store in tmp_path, the loopback FakeProvider, MemoryChannels,
the runtime's own actors; time from the FakeClock. Call outcomes are appended to the
``provider:<name>`` stream the way the model caller appends them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pykka

from stalwart import store as store_module
from stalwart.actors import DeadLetterActor, Enqueue, InFlight
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementSendFailed,
    ModelFallbackAttempt,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent, read_readable
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import (
    GUARD,
    agent_settings,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
)

#: How long a test waits (real seconds) for what a correct runtime does at once.
SHORT = 4.0


def _config(fake: FakeProvider, **sections: Any) -> Config:
    return runtime_config(fake.base_url, **sections)


def _until(check: Callable[[], Any], timeout: float = SHORT) -> bool:
    """Poll ``check()`` until it holds or ``timeout`` real seconds pass."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if check():
            return True
        time.sleep(0.02)  # real-time: the actors work on their own threads; poll
    return bool(check())


def _fail(store: EventStore, clock: FakeClock, *agents: str) -> None:
    """Failed calls to provider ``main`` from ``agents``, as the model caller records them."""
    store.append(
        "provider:main",
        [
            NewEvent(
                event=ProviderCallFailed(
                    provider="main", model="m1", agent=a, error_class="server_error", status=503
                ),
                ts=clock.now(),
            )
            for a in agents
        ],
    )


def _only(kind: type[pykka.Actor]) -> pykka.ActorRef[Any]:
    [ref] = pykka.ActorRegistry.get_by_class(kind)
    return ref


def _corrupt(directory: Path, position: int) -> None:
    env = lmdb.open(str(directory), max_dbs=8)
    try:
        log_db = env.open_db(b"log")
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), b"\xc1garbage", db=log_db)
    finally:
        env.close()


def _entry(entry_id: str, text: str) -> AnnouncementDeadLettered:
    return AnnouncementDeadLettered(
        entry_id=entry_id,
        announcement_id=f"ann-{entry_id}",
        channel="chat",
        text=text,
        reason="server_error",
        conversation="conv-1",
    )


# -- 1. one corrupt record silences the whole dead-letter queue --------------------------------


def test_one_corrupt_dead_letter_record_does_not_lose_the_rest_of_the_queue(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: one undecodable record in the ``deadletter`` stream (the design's own example
    of bad input that must lose nothing) makes the DeadLetterActor's start-up fold raise
    CorruptRecordError every time: the runtime restarts it, it dies again at once (and is
    given up on after three restarts within 5 s). No dead letter is ever retried or
    drained: the good entry queued after the damaged one is never delivered, every answer
    the channel fails to take later is held in memory and lost at close, and
    ``rt.dead_letters()`` raises a raw ``pykka.ActorDeadError``.

    Correct: the damaged record is reported (once, at ERROR) and skipped, as the
    supervisor does for a damaged run stream; the rest of the queue is retried on
    schedule and delivered."""
    directory = tmp_path / "store"
    with store_module.open(directory, clock=clock) as first:  # type: ignore[attr-defined]
        damaged, _ = first.append(
            "deadletter", [_entry("e1", "lost to the damage"), _entry("e2", "still owed")]
        )
    _corrupt(directory, damaged.position)
    with (
        store_module.open(directory, clock=clock) as store,  # type: ignore[attr-defined]
        Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}),
    ):
        for backoff_ms in (100, 200, 400, 800):  # any restarts the runtime decides
            clock.advance(backoff_ms / 1000 + 0.005)
            _until(lambda: bool(pykka.ActorRegistry.get_by_class(DeadLetterActor)), 0.5)
        # e2's first retry (30 s after it was queued) and then some
        for _ in range(6):
            clock.advance(31)
            if _until(lambda: bool(chat.messages), 0.5):
                break
        assert [m.text for m in chat.messages] == ["still owed"], (
            "the good dead letter was never delivered; runtime stream: "
            f"{[r.type for r in store.read_stream('runtime')]}"
        )


def test_a_corrupt_provider_record_neither_stops_the_runtime_nor_its_health_checks(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm (was): one undecodable record in ``provider:main`` made the provider layer's
    breaker fold raise CorruptRecordError in ``Runtime.start()``: the runtime could not
    start at all, and the health actor's fold died on it too. A breaker's and a health
    window's state are worth less than the whole runtime: the damaged record is logged
    and passed over, the runtime answers, and the provider's health is still watched
    (the damaged record was the stream's last, so the health actor's first append must
    also get past it)."""
    directory = tmp_path / "store"
    with store_module.open(directory, clock=clock) as first:  # type: ignore[attr-defined]
        ok = ProviderCallSucceeded(provider="main", model="m1", agent="a")
        failed = ProviderCallFailed(
            provider="main", model="m1", agent="a", error_class="server_error", status=503
        )
        _, damaged = first.append(
            "provider:main", [NewEvent(event=ok, ts=clock.now()), NewEvent(event=failed)]
        )
    _corrupt(directory, damaged.position)
    with (
        store_module.open(directory, clock=clock) as store,  # type: ignore[attr-defined]
        Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt,
    ):
        assert _until(lambda: rt.health()["main"].status == "healthy")
        _fail(store, clock, "a", "b")
        assert _until(lambda: rt.health_view.is_degraded("main"))
        readable = [r.event for r in read_readable(store, "provider:main")]
        assert [type(e) for e in readable][-1] is ProviderDegraded
        rt.session("s1", channel="chat").send("hi")  # a degraded primary: the static text
        assert len(delivered(rt, chat, 1)) == 1


# -- 2. a recovery told while the queue restarts is dropped ------------------------------------


def test_a_recovery_while_the_dead_letter_queue_restarts_still_drains_it(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: the runtime's health listener tells ``Drain`` to the dead-letter actor's bare
    ActorRef (``PartsLayer._on_health_changed``), not to the queue's LiveRef that holds
    messages while the part restarts. A provider that recovers while the queue waits out
    its restart backoff (a crash, 100 ms to 1 s) loses the drain: ActorDeadError is
    swallowed, the restarted queue does not drain, and the user's dead-lettered message
    waits for its next scheduled retry (here 2 minutes) instead of going out at recovery.

    Correct: seed 000, "on provider:recovered events, the queue drains automatically": a
    Drain told during the backoff reaches the restarted queue, like an Enqueue does."""
    config = _config(fake, dead_letters={"retry_base_ms": 120_000})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        enqueue = Enqueue("ann-1", "chat", "conv-1", "the late answer", "server_error")
        _only(DeadLetterActor).ask(enqueue, timeout=GUARD)
        _fail(store, clock, "a", "b")
        log_until(store, "provider:main", has(ProviderDegraded))
        assert _until(lambda: rt.health_view.is_degraded("main"))

        _only(DeadLetterActor).tell(object())  # a real crash: it does not understand it
        log_until(store, "runtime", has(SupervisorRestarted))
        assert not pykka.ActorRegistry.get_by_class(DeadLetterActor)  # in its backoff
        store.append(  # a call succeeds: the provider recovers at once
            "provider:main",
            [
                NewEvent(
                    event=ProviderCallSucceeded(provider="main", model="m1", agent="a"),
                    ts=clock.now(),
                )
            ],
        )
        log_until(store, "provider:main", has(ProviderRecovered))
        assert _until(lambda: not rt.health_view.is_degraded("main"))

        clock.advance(0.11)  # the restart backoff passes; far from the 120 s retry
        assert _until(lambda: bool(pykka.ActorRegistry.get_by_class(DeadLetterActor)))
        assert _until(lambda: bool(chat.messages)), (
            "the recovery's drain was lost: the entry waits for its retry; queue: "
            f"{rt.dead_letters().entries}"
        )
        assert [m.text for m in chat.messages] == ["the late answer"]


# -- 3. retries burn out during an outage instead of accumulating -------------------------------


def test_dead_letters_accumulate_while_degraded_and_are_delivered_on_recovery(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: seed 000 says that while a provider is degraded "dead-letter queue entries
    accumulate for later retry" and that "even during extended provider outages,
    announcements are preserved and delivered once the provider recovers"; the docs give
    "holding dead letters" to the DeadLetter actor. It holds nothing: it keeps retrying on
    its own schedule through the outage (30, 60, 120, 240, 480 s) while the channel is
    down too, spends its 5 retries in 15.5 minutes and expires the entry
    (``retries_exhausted``). When the provider recovers 17 minutes in, the drain finds an
    empty queue: the user never gets the message.

    Correct: while degraded, scheduled retries wait; on recovery the queue drains and the
    message is delivered (within a retry or two of the recovery)."""
    chat.fail_next(1)  # the channel is down with the provider
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        _fail(store, clock, "a", "b")
        log_until(store, "provider:main", has(ProviderDegraded))
        assert _until(lambda: rt.health_view.is_degraded("main"))
        dead_letters = _only(DeadLetterActor)
        dead_letters.ask(
            Enqueue("ann-1", "chat", "conv-1", "the late answer", "server_error"), timeout=GUARD
        )
        seen = 0
        for _ in range(34):  # 17 minutes of outage, a failed call every 30 s
            clock.advance(30)
            _fail(store, clock, "a")
            assert _until(lambda: dead_letters.ask(InFlight(), timeout=GUARD) == ())
            if len(chat.attempted) > seen:  # keep the channel down for the next send
                chat.fail_next(len(chat.attempted) - seen)
                seen = len(chat.attempted)
        assert rt.health_view.is_degraded("main")
        # the outage ends: a quiet window, the provider recovers, the queue drains
        clock.advance(61)
        log_until(store, "provider:main", has(ProviderRecovered))
        for _ in range(10):
            clock.advance(30)
            if _until(lambda: bool(chat.messages), 0.3):
                break
        queue = list(store.read_stream("deadletter"))
        assert [m.text for m in chat.messages] == ["the late answer"], (
            f"lost during the outage: {of(AnnouncementDeadLetterExpired, queue)}, "
            f"{len(of(AnnouncementSendFailed, queue))} sends tried while degraded"
        )


# -- 4. a degraded primary provider silences an agent that has a healthy fallback --------------


def test_a_degraded_primary_uses_the_fallback_on_a_healthy_provider_then_the_primary_again(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: an agent on ``main:m1`` with ``fallback_models = ["backup:m2"]`` (another,
    healthy provider) answers every message with the static DEGRADED_TEXT while ``main``
    is degraded: the Agent checks only its primary provider's health
    (``AgentActor._call_model``) and skips the whole model chain, so the fallback the
    operator configured for exactly this outage is never asked. Seed 000: degradation
    skips LLM work "to avoid wasting tokens on a down provider", and the fallback chains
    exist "so you never lose [service] to a single provider's outage".

    Correct: while ``main`` is degraded the turn goes to the next model of the chain on a
    provider that is not degraded (here ``backup:m2``); once ``main`` recovers the primary
    is tried again."""
    fake.add(Answer(text="from the fallback", model="m2", times=5))
    config = runtime_config(
        fake.base_url,
        providers={
            "main": {"kind": "openai", "base_url": fake.base_url},
            "backup": {"kind": "openai", "base_url": fake.base_url},
        },
        agents={"default": agent_settings(fallback_models=["backup:m2"])},
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        _fail(store, clock, "a", "b")
        log_until(store, "provider:main", has(ProviderDegraded))
        assert _until(lambda: rt.health_view.is_degraded("main"))
        assert not rt.health_view.is_degraded("backup")
        session = rt.session("s1", channel="chat")
        session.send("hello while main is down")
        [reply] = delivered(rt, chat, 1)
        assert reply.text == "from the fallback", (
            f"the healthy fallback was never asked: {reply.text!r}; "
            f"requests: {[r.model for r in fake.requests]}"
        )
        clock.advance(rt.config.health.window_ms / 1000 + 1)  # a quiet window: recovered
        log_until(store, "provider:main", has(ProviderRecovered))
        assert _until(lambda: not rt.health_view.is_degraded("main"))
        session.send("hello again")
        second = delivered(rt, chat, 2)[1]
        assert second.text == "default answer"
        assert [r.model for r in fake.requests] == ["m2", "m1"]
    # the pass over main is recorded as a fallback replay re-derives
    [passed] = of(ModelFallbackAttempt, list(store.read_stream("session:s1")))
    assert (passed.from_model, passed.to_model, passed.reason) == (
        "main:m1",
        "backup:m2",
        "provider_degraded",
    )
    report = verify_store(store, None)
    assert report.clean, report
