"""What ``send_message`` (the host's ``session.send`` and ``stalwart session send``)
records for a message no turn can answer: nothing, with a typed error.

Real parts: a real LMDB store in ``tmp_path`` and, for the host's path, a Runtime over
the loopback fake provider on the fake clock."""

from __future__ import annotations

import pytest
import structlog.testing

from stalwart.actors import UserMessage
from stalwart.clock import FakeClock
from stalwart.errors import SessionActionError
from stalwart.events import ActivationReady, TurnStarted
from stalwart.runtime import Runtime
from stalwart.runtime._control import send_message
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, runtime_config


# Was: DEFECT: a blank user message was recorded and acknowledged, then its turn failed
@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_a_blank_message_is_refused_and_nothing_is_recorded(store: EventStore, text: str) -> None:
    """A blank message used to become an ``activation:ready``: the worker ran a turn
    with nothing to answer (a request the providers refuse), and the host had been told
    the message was taken. The CLI refused it already; the API now does too."""
    with pytest.raises(SessionActionError) as raised:
        send_message(store, "s1", text)
    assert raised.value.reason == "empty_message"
    assert raised.value.session == "session:s1"
    assert store.stream_version("session:s1") == 0
    with pytest.raises(SessionActionError):
        send_message(store, "s1", text, message_id="platform-1")  # the dedupe path too
    assert store.stream_version("session:s1") == 0


def test_a_message_text_that_is_not_a_str_is_a_type_error_and_nothing_is_recorded(
    store: EventStore,
) -> None:
    """Before: the store's read-back check refused it (an ``EventError`` naming a
    corrupt record); now a TypeError naming the argument, as the other actions give."""
    for text in (5, None, b"hello", ["hi"]):
        with pytest.raises(TypeError, match="text"):
            send_message(store, "s1", text)  # type: ignore[arg-type]
    assert store.stream_version("session:s1") == 0
    assert list(store.read_all()) == []


def test_the_host_is_told_at_once_when_it_sends_a_blank_message(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    with Runtime(runtime_config(fake.base_url), store=store, clock=clock) as rt:
        session = rt.session("s1")
        with pytest.raises(SessionActionError, match="empty"):
            session.send("  ")
    recorded = [r.event for r in store.read_stream("session:s1")]
    assert not [e for e in recorded if isinstance(e, ActivationReady)]


# Was: DEFECT: a blank UserMessage told straight to a session's Agent was recorded and run as a turn
def test_a_blank_message_told_straight_to_the_agent_is_dropped_and_nothing_is_recorded(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    with Runtime(runtime_config(fake.base_url), store=store, clock=clock) as rt:
        session = rt.session("s1")
        with structlog.testing.capture_logs() as logs:
            report = session.ref.ask(UserMessage("  \n"), timeout=GUARD)
        assert report.queued == 0
    recorded = [r.event for r in store.read_stream("session:s1")]
    assert not [e for e in recorded if isinstance(e, ActivationReady | TurnStarted)]
    assert [e["event"] for e in logs if e["event"] == "agent.empty_message_dropped"]
    assert fake.requests == []
