"""What the session-34 tests share: a dead-letter queue on the FakeClock, the real webhook
receivers it sends to and the records written into its stream by hand; a supervisor
alone over a store; a config refused at load; what a request cost by the context
engine's own estimate.

A test module takes the ``receivers`` fixture by importing :func:`receivers_fixture`
(pytest knows it by its name, ``receivers``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import pykka
import pytest

from stalwart.actors import (
    DeadLetterActor,
    InFlight,
    IoPortal,
    QueueState,
    Scheduler,
    SupervisorActor,
)
from stalwart.channels import Channel, OutboundMessage, send_within
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings, parse_config
from stalwart.context import TokenEstimator
from stalwart.errors import ConfigError
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
    ToolCall,
)
from stalwart.providers import Message
from stalwart.state import DeadLetterState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD
from tests.test_channels import Receiver, Step

# -- the dead-letter queue --------------------------------------------------------------------

#: the queue's settings, the defaults a runtime starts it with
DEAD_LETTERS = DeadLetterSettings()
#: how long a test waits for a real send to end (on a loaded machine, generously)
SEND_WAIT_S = 15.0


@pytest.fixture(name="receivers")
def receivers_fixture() -> Iterator[list[Receiver]]:
    """The webhook receivers a test made (:func:`receiver_of`, :func:`busy_receiver`),
    closed at teardown."""
    made: list[Receiver] = []
    try:
        yield made
    finally:
        for receiver in made:
            receiver.close()


def receiver_of(receivers: list[Receiver], *steps: Step) -> Receiver:
    """A receiver that answers ``steps`` in turn (then 200), closed at teardown."""
    receivers.append(Receiver(*steps))
    return receivers[-1]


class BusyUntil:
    """A receiver's script by the FakeClock's time: 503 with ``Retry-After`` (what it was
    told to ask for) until ``until``, then 200 (a :class:`Receiver`'s ``steps``)."""

    def __init__(self, clock: FakeClock, until: float, retry_after: str) -> None:
        self.clock = clock
        self.until = until
        self.retry_after = retry_after
        self.asked_at: list[float] = []

    def __bool__(self) -> bool:
        return True

    def popleft(self) -> Step:
        now = self.clock.now()
        self.asked_at.append(now)
        if now < self.until:
            return Step(status=503, headers={"retry-after": self.retry_after})
        return Step(status=200)


def busy_receiver(receivers: list[Receiver], script: BusyUntil) -> Receiver:
    """A receiver that answers by ``script``, closed at teardown."""
    receiver = Receiver()
    receiver.steps = script  # type: ignore[assignment]  # answers by the clock, not in turn
    receivers.append(receiver)
    return receiver


def start_queue(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    channels: dict[str, Channel],
    actors: list[pykka.ActorRef[Any]],
    runtime: str = "rt-a",
) -> pykka.ActorRef[Any]:
    """Runtime ``runtime``'s dead-letter queue (:data:`DEAD_LETTERS`), stopped at teardown
    (``actors``)."""
    ref = DeadLetterActor.start(
        store=store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels=channels,
        settings=DEAD_LETTERS,
        runtime=runtime,
    )
    actors.append(ref)
    return ref


def queues_settled(*refs: pykka.ActorRef[Any]) -> list[DeadLetterState]:
    """The queues' states once no send of theirs is in flight and their outcomes are
    recorded."""
    give_up = time.monotonic() + SEND_WAIT_S
    states = []
    for ref in refs:
        while ref.ask(InFlight(), timeout=GUARD):
            assert time.monotonic() < give_up, "a send never ended"
            time.sleep(0.01)  # real-time: a send on the portal's loop
        state = ref.ask(QueueState(), timeout=GUARD)  # after the outcomes' own message
        assert isinstance(state, DeadLetterState)
        states.append(state)
    return states


def queue_settled(ref: pykka.ActorRef[Any]) -> DeadLetterState:
    """The queue's state once no send of it is in flight and their outcomes are recorded."""
    [state] = queues_settled(ref)
    return state


def step_queues(
    clock: FakeClock,
    scheduler: Scheduler,
    refs: Sequence[pykka.ActorRef[Any]],
    *,
    for_s: float,
    done: Callable[[list[DeadLetterState]], bool],
) -> list[DeadLetterState]:
    """Move the clock from one deadline to the next (every send of the queues ended and
    recorded before the next step) until ``done`` holds of their states, nothing is due,
    or ``for_s`` have passed: their states then."""
    until = clock.now() + for_s
    while True:
        states = queues_settled(*refs)
        due = scheduler.next_deadline()
        if done(states) or due is None or due > until:
            return states
        clock.advance(max(0.0, due - clock.now()))


def dead_letters(store: EventStore) -> list[RecordedEvent]:
    return list(store.read_stream("deadletter"))


def assert_dead_letters_verify(store: EventStore) -> None:
    """``replay --verify`` finds nothing in the ``deadletter`` stream."""
    report = verify_store(store, None)
    assert [f for f in report.findings if f.stream == "deadletter"] == []


def append_dead_letter(store: EventStore, clock: FakeClock, event: Event) -> None:
    """``event`` recorded in the ``deadletter`` stream now, as another runtime would."""
    store.append("deadletter", [NewEvent(event=event, ts=clock.now())])


def dead_lettered(entry_id: str, **fields: Any) -> AnnouncementDeadLettered:
    """Entry ``entry_id`` as a sender queues it: announcement ``ann-<entry_id>`` on
    ``chat``, conversation ``conv-1``, text ``one``, reason ``timeout``; ``fields``
    replace any of them."""
    queued: dict[str, Any] = {
        "entry_id": entry_id,
        "announcement_id": f"ann-{entry_id}",
        "channel": "chat",
        "text": "one",
        "reason": "timeout",
        "conversation": "conv-1",
    }
    return AnnouncementDeadLettered(**(queued | fields))


def failed_send(entry_id: str, **fields: Any) -> AnnouncementSendFailed:
    """A retry of entry ``entry_id`` (:func:`dead_lettered`) refused with a server error;
    ``fields`` add to it or replace."""
    failed: dict[str, Any] = {
        "announcement_id": f"ann-{entry_id}",
        "error_class": "server_error",
        "entry_id": entry_id,
    }
    return AnnouncementSendFailed(**(failed | fields))


def late_reply(conversation: str = "conv-1") -> OutboundMessage:
    """What a sender sends when a turn timed out."""
    return OutboundMessage(
        conversation=conversation, text="Sorry, that took too long.", idempotency_key="ann-1"
    )


def first_send(portal: IoPortal, channel: Channel, sent: OutboundMessage) -> str | None:
    """What a sender records of its first send (the word it queues the entry with)."""
    return portal.submit(send_within, channel, sent, GUARD).result(GUARD + 1)


# -- a supervisor alone -----------------------------------------------------------------------


@contextmanager
def supervising(store: Any, clock: FakeClock, **parts: Any) -> Iterator[pykka.ActorRef[Any]]:
    """A supervisor alone over ``store`` (a store, or a wrapper that counts what is asked
    of one) with ``parts``, stopped with every other actor when the block ends."""
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            yield SupervisorActor.start(
                store=cast(EventStore, store),
                clock=clock,
                scheduler=scheduler,
                portal=portal,
                channels={},
                **parts,
            )
        finally:
            pykka.ActorRegistry.stop_all(timeout=GUARD)


# -- a config refused at load -----------------------------------------------------------------


def provider_at(url: str) -> dict[str, Any]:
    """Config data: an OpenAI-wire provider ``main`` at ``url``, a ``default`` agent on it."""
    return {
        "providers": {"main": {"kind": "openai", "base_url": url}},
        "agents": {"default": {"provider": "main", "model": "m1"}},
    }


def webhook_at(url: str) -> dict[str, Any]:
    """Config data: a webhook channel ``hook`` to ``url``."""
    return {"channels": {"hook": {"kind": "webhook", "url": url}}}


def config_refused(data: dict[str, Any], match: str) -> ConfigError:
    """The error loading ``data`` raises (its message matches ``match``)."""
    with pytest.raises(ConfigError, match=match) as raised:
        parse_config(data)
    return raised.value


# -- what a request cost ----------------------------------------------------------------------


def sent_tokens(messages: list[dict[str, Any]]) -> int:
    """What a request's messages (as the provider received them) cost by the engine's
    own estimate at factor 1, calls included."""
    return TokenEstimator("openai").messages(
        Message(
            role=m["role"],
            content=m.get("content") or "",
            tool_calls=tuple(
                ToolCall(
                    id=call["id"],
                    name=call["function"]["name"],
                    arguments=call["function"]["arguments"],
                )
                for call in m.get("tool_calls") or ()
            ),
            tool_call_id=m.get("tool_call_id"),
        )
        for m in messages
    )
