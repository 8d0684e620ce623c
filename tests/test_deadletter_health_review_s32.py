"""Review (s32) of provider health, the dead-letter queue and the announcer.

Real parts: LMDB directories in ``tmp_path``, the test session's PostgreSQL behind the
relay that cuts its connections (``tests._relay``), the IoPortal, the Scheduler driven by
a FakeClock, MemoryChannels. A test marked ``# Was: DEFECT:`` failed on the code it was
written against and passes since the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import pykka
import pytest

from stalwart.actors import (
    DeadLetterActor,
    Drain,
    Enqueue,
    GetHealth,
    HealthReport,
    IoPortal,
    PollHealth,
    ProviderHealthActor,
    QueueState,
    Scheduler,
)
from stalwart.channels import Channel, Delivery, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings, HealthSettings
from stalwart.events import (
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
)
from stalwart.state import (
    DEADLETTER,
    HEALTH,
    DeadLetterState,
    apply_deadletter,
    decide_drain,
    decide_expiry,
    decide_health,
    decide_retries,
    fold,
)
from stalwart.store import EventStore, PostgresEventStore
from tests._relay import CuttingRelay
from tests._runtime_support import GUARD, until

Logs = list[MutableMapping[str, Any]]

#: the most a wait for a PostgreSQL store to come back (its pool reconnects) takes
BACK = 30.0
T0 = 1_800_000_000.0  # the conftest clock's start
D = DeadLetterSettings()


def _failed(agent: str, provider: str = "p") -> ProviderCallFailed:
    return ProviderCallFailed(provider=provider, model="m", agent=agent, error_class="server_error")


def _logged(logs: Logs, name: str) -> bool:
    return any(entry["event"] == name for entry in list(logs))


def _report(ref: pykka.ActorRef[Any]) -> HealthReport:
    report = ref.ask(GetHealth(), timeout=GUARD)
    assert isinstance(report, HealthReport)
    return report


# -- provider health ---------------------------------------------------------------------


# Was: DEFECT: a store outage (PostgreSQL unreachable) ended the health follower for good
def test_the_health_actor_follows_its_stream_again_after_the_store_comes_back(
    pg_store: EventStore,
    relay: CuttingRelay,
    relayed_store: PostgresEventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    logs: Logs,
) -> None:
    """docs/resilience.md: the actor "follows its stream by itself". Its follower waits on
    the store's head; while the database cannot be reached that wait fails, and the
    follower used to take that for a closed store and stop: once the database was back,
    no failure was ever folded again, so the next outage was never declared."""
    ref = ProviderHealthActor.start(relayed_store, clock, scheduler, "p", HealthSettings())
    try:
        assert not _report(ref).degraded  # started: its follower waits on the head
        relay.cut_now()
        until(  # real-time: the follower's wait fails once the pool gives up connecting
            lambda: (
                _logged(logs, "health.follower_store_unreachable")
                or _logged(logs, "health.follower_stopped")
            ),
            BACK,
            what="the follower saw the outage",
        )
        relay.restore()
        pg_store.append("provider:p", [_failed("a"), _failed("b")])  # another process's
        until(  # real-time: the follower wakes the actor once the store answers again
            lambda: _report(ref).degraded, BACK, what="the outage after the store came back"
        )
    finally:
        ref.stop(timeout=GUARD)


# Was: DEFECT: a call in flight when the outage was declared ended it with its success
def test_a_success_of_a_call_begun_before_the_outage_does_not_end_it(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler
) -> None:
    """Two agents' calls fail: degraded. A long call begun 20 s earlier then ends well: it
    recovered the provider at once, so the agents called it again, failed, and degraded
    it again (the dead-letter queue drained and every user waited for that in between).
    The breaker already ignores such a call; health now does too, and a call begun after
    the outage was declared still ends it."""
    settings = HealthSettings()
    ref = ProviderHealthActor.start(lmdb_store, clock, scheduler, "p", settings, follow=False)
    try:
        lmdb_store.append("provider:p", [_failed("a"), _failed("b")])
        assert ref.ask(PollHealth(), timeout=GUARD).degraded
        outage = clock.now()
        clock.advance(1.0)
        early = ProviderCallSucceeded(provider="p", model="m", agent="c", started_at=outage - 20)
        lmdb_store.append("provider:p", [early])
        assert ref.ask(PollHealth(), timeout=GUARD).degraded
        clock.advance(1.0)
        late = ProviderCallSucceeded(provider="p", model="m", agent="c", started_at=outage + 1)
        lmdb_store.append("provider:p", [late])
        report = ref.ask(PollHealth(), timeout=GUARD)
        assert (report.status, report.rule) == ("healthy", "success")
    finally:
        ref.stop(timeout=GUARD)
    records = list(lmdb_store.read_stream("provider:p"))
    decided = [
        (i, r)
        for i, r in enumerate(records)
        if isinstance(r.event, ProviderDegraded | ProviderRecovered)
    ]
    assert [type(r.event) for _, r in decided] == [ProviderDegraded, ProviderRecovered]
    for index, record in decided:  # each decision is what replay re-derives
        state = fold(HEALTH, "provider:p", records[:index])
        assert decide_health(
            state,
            record.ts,
            window_ms=settings.window_ms,
            min_agents=settings.min_agents,
            consecutive=settings.consecutive_failures,
        ) == [record.event]


# -- the dead-letter queue: order within a conversation -----------------------------------


class Overtaking:
    """A channel on which later sends overtake an earlier one still under way (a webhook
    receiver under concurrent requests): a send waits up to half a second for a later one
    to begin, and then until every later one has ended, before it delivers."""

    def __init__(self, name: str = "chat") -> None:
        self.name = name
        self.begun = 0
        self.ended = 0
        self.messages: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> Delivery:
        self.begun += 1
        mine = self.begun
        with anyio.move_on_after(0.5):  # real-time: a later send, when there is one, begins at once
            while self.begun == mine:
                await anyio.sleep(0.005)  # real-time: see above
        with anyio.move_on_after(GUARD):  # real-time: the later sends end at once
            while self.ended < self.begun - mine:
                await anyio.sleep(0.005)  # real-time: see above
        self.messages.append(message)
        self.ended += 1
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def queue(
    lmdb_store: EventStore, clock: FakeClock, scheduler: Scheduler, portal: IoPortal
) -> Iterator[Any]:
    refs: list[pykka.ActorRef[Any]] = []

    def start(channel: Channel) -> pykka.ActorRef[Any]:
        ref = DeadLetterActor.start(
            store=lmdb_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": channel},
            settings=D,
        )
        refs.append(ref)
        return ref

    yield start
    for ref in refs:
        ref.stop(block=True, timeout=GUARD)


def _enqueue(ref: pykka.ActorRef[Any], name: str, conversation: str = "conv-1") -> str:
    entry_id = ref.ask(
        Enqueue(f"a-{name}", "chat", conversation, f"text {name}", "timeout"), timeout=GUARD
    )
    assert isinstance(entry_id, str)
    return entry_id


def _state(ref: pykka.ActorRef[Any]) -> DeadLetterState:
    state = ref.ask(QueueState(), timeout=GUARD)
    assert isinstance(state, DeadLetterState)
    return state


def _delivered(ref: pykka.ActorRef[Any], count: int) -> DeadLetterState:
    return until(  # real-time: the sends run on the portal's loop
        lambda: (state := _state(ref)).delivered >= count and state, GUARD, what="deliveries"
    )


def _keys(messages: list[OutboundMessage]) -> list[str | None]:
    return [m.idempotency_key for m in messages]


def _replays(store: EventStore) -> None:
    """Every retry and expiry is one the unordered policies (what replay re-runs) allow."""
    state = DEADLETTER.initial("deadletter")
    for record in store.read_stream("deadletter"):
        event = record.event
        decided: list[Event] = [event]
        if isinstance(event, AnnouncementDeadLetterRetried) and event.reason == "drain":
            decided = list(decide_drain(state, event.provider or ""))
        elif isinstance(event, AnnouncementDeadLetterRetried):
            decided = list(
                decide_retries(
                    state,
                    record.ts,
                    max_retries=D.max_retries,
                    base_ms=D.retry_base_ms,
                    cap_ms=D.retry_cap_ms,
                )
            )
        elif isinstance(event, AnnouncementDeadLetterExpired):
            decided = decide_expiry(
                state, record.ts, max_age_ms=D.max_age_ms, max_retries=D.max_retries
            )
        assert event in decided, record
        state = apply_deadletter(state, record)


# Was: DEFECT: a later message's first retry delivered it before an earlier one still in backoff
def test_a_later_message_never_overtakes_an_earlier_one_of_its_conversation(
    queue: Any, lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Reply 1 was queued and its first retry failed (its next is 60 s later); reply 2 of
    the same conversation was queued meanwhile. The channel is back: reply 2's
    first retry came before reply 1's second and the user read reply 2 first. Now reply 2
    waits for reply 1, and follows it at once."""
    chat = MemoryChannel("chat")
    ref = queue(chat)
    chat.fail_next(1)
    first = _enqueue(ref, "1")
    clock.set(T0 + 30)  # reply 1's first retry: it fails
    failed_once = lambda: _state(ref).entries[0].attempts == 1  # noqa: E731
    until(failed_once, GUARD, what="the failed retry")  # real-time: the outcome is the portal's
    clock.set(T0 + 40)
    second = _enqueue(ref, "2")
    _enqueue(ref, "3", conversation="conv-2")  # another conversation: not held back
    clock.set(T0 + 70)  # reply 2's first retry is due (T0 + 40 + 30), reply 1's at T0 + 90
    _delivered(ref, 1)
    assert _keys(chat.messages) == ["a-3"]
    assert [e.entry_id for e in _state(ref).entries] == [first, second]
    clock.set(T0 + 90)
    state = _delivered(ref, 3)
    assert state.entries == ()
    assert _keys(chat.messages) == ["a-3", "a-1", "a-2"]
    assert clock.now() == T0 + 90  # reply 2 went right after reply 1, no later
    _replays(lmdb_store)


# Was: DEFECT: a drain sent a conversation's entries all at once: the channel could reorder them
def test_a_drain_delivers_a_conversations_messages_in_the_order_they_were_queued(
    queue: Any, lmdb_store: EventStore
) -> None:
    chat = Overtaking()
    ref = queue(chat)
    for name in ("1", "2", "3"):
        _enqueue(ref, name)
    ref.tell(Drain("openai"))
    state = _delivered(ref, 3)
    assert state.entries == ()
    assert _keys(chat.messages) == ["a-1", "a-2", "a-3"]
    retried = [r.event for r in lmdb_store.read_stream("deadletter") if r.type.endswith("_retried")]
    assert [(e.reason, e.provider, e.attempt) for e in retried] == [("drain", "openai", 1)] * 3
    _replays(lmdb_store)
