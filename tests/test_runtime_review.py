"""Review of the embeddable runtime's sessions: defects found, each shown by a failing test.

Every test uses real parts: a real LMDB store in ``tmp_path``, the loopback fake provider,
``MemoryChannel``s and the fake clock. Each docstring says what is wrong and what a host
should be able to expect instead.
"""

from __future__ import annotations

import math

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.errors import ConfigError, SessionActionError
from stalwart.events import ActivationAcked, AnnouncementDelivered, AnnouncementQueued
from stalwart.runtime import Runtime, SessionHandle
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang
from tests._runtime_support import (
    GUARD,
    delivered,
    has,
    in_flight_s,
    log_until,
    of,
    runtime_config,
)


def _passivated(rt: Runtime, clock: FakeClock, chat: MemoryChannel) -> SessionHandle:
    """Session ``s1`` on ``chat``, answered once, then passivated by the sweep."""
    session = rt.session("s1", channel="chat")
    session.send("one")
    delivered(rt, chat, 1)
    # the Agent has taken the send's outcome in (with a send in flight it is not idle)
    log_until(rt.store, "session:s1", has(AnnouncementDelivered))
    first = session.ref
    clock.advance(30.0)
    clock.advance(60.0)  # idle for longer than passivate_after_ms: the sweep stops it
    assert first.actor_stopped.wait(GUARD)
    return session


def test_a_passivated_sessions_handle_still_answers_status(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: once the passivation sweep stopped an idle session's Agent,
    ``SessionHandle.status()`` raises ``RuntimeError("... is stopped: its runtime was
    closed")`` although the runtime runs. docs/sessions.md says of passivation "the
    host's ``SessionHandle`` stays valid". Expected: the handle answers (the Agent is
    started again from the log, or the report is folded from it), as it did before the
    session went idle."""
    cfg = runtime_config(fake.base_url, activations={"passivate_after_ms": 60_000})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = _passivated(rt, clock, chat)
        report = session.status(GUARD)
        assert report.session.turns == 1


def test_asking_for_a_passivated_session_again_keeps_its_channel(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``rt.session("s1")`` for a session that runs is documented to return it "as
    it is (its agent and channel were chosen when it started)". For a passivated session
    it instead starts a fresh Agent on the default ``console`` channel (a new handle,
    replacing the host's one in the runtime), so every later reply of a session that lives
    on ``chat`` silently goes to ``console``. Whether the host's call keeps the channel
    depends on an idle timer the host cannot see. Expected: the passivated session's
    existing handle is restarted (``_start_again``) and its replies stay on ``chat``."""
    cfg = runtime_config(fake.base_url, activations={"passivate_after_ms": 60_000})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        _passivated(rt, clock, chat)
        again = rt.session("s1")  # "the running session ... returned as it is"
        again.send("two")
        records = log_until(store, "session:s1", has(ActivationAcked, 2))
    last = of(AnnouncementQueued, records)[-1]
    assert last.channel == "chat"


# Was: DEFECT (session:s1): the stream's name was recorded but the running Agent not told
@pytest.mark.parametrize("named", ["s1", "session:s1"])
def test_a_message_after_an_interrupt_is_run_at_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, named: str
) -> None:
    """Defect: ``rt.interrupt()`` on a running wake fences it out and tells the Agent
    ``LeaseLost(stream, None)``; the Agent drops the wake with ``notify=False``, so the
    ActivationWorker never hears ``WakeEnded`` and keeps the session in its ``running``
    set. The next user message is then not leased until the old lease's renewal timer
    fires and is fenced (``renew_every_ms``, 10 s by default; never, on a clock that does
    not move). docs/sessions.md: "The next user message starts new work as usual" and
    "within one process a new activation is picked up at once". Expected: the message
    sent after the interrupt is answered without waiting for a renewal tick."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        fake.add(Hang())
        session = rt.session("s1", channel="chat")
        session.send("long job")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        rt.interrupt(named, "wrong customer")  # the session's id, or its stream's name
        session.send("the right customer is 42")
        # woken by appends: no clock moves, so no renewal tick can free the session
        records = log_until(store, "session:s1", has(ActivationAcked))
    assert of(ActivationAcked, records)


def test_a_restarted_runtime_answers_in_the_sessions_conversation(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: ``session:created`` records only the agent and the channel, not the
    ``conversation`` (nor ``thread``) the host gave ``rt.session``. When work of the
    session runs in a later runtime (a delayed wake, a retried message after a crash or a
    close), the worker starts its Agent with ``conversation=None``, so the reply goes to
    the conversation named like the session id: the user who asked never gets it, and a
    later ``rt.session(..., conversation=...)`` returns that running Agent unchanged.
    Expected: the session's delivery address survives a restart (recorded in the log and
    used by ``agent_for_wake``)."""
    chat = MemoryChannel("chat")
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rt.session("s1", channel="chat", conversation="customer-42")
        rt.wake_at("s1", clock.now() + 60, "check the refund landed")
    after = MemoryChannel("chat")
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": after}
    ) as rt:
        clock.advance(60.0)
        [reply] = delivered(rt, after, 1)
    assert reply.conversation == "customer-42"


def test_an_answer_whose_send_a_close_cut_short_is_sent_after_restart(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: when the runtime closes (or the process dies) while a turn's answer is
    being sent, the log holds ``announcement:queued`` and ``activation:acked`` but no
    ``announcement:delivered`` / ``send_failed``. The Agent's ``_speak_up`` would send it
    again, but only when that session's Agent is started; a restarted runtime starts
    Agents only for due work or when the host calls ``rt.session``, and the acked session
    has no work. So the user never gets the answer: silence, which the design forbids
    ("users always receive a response"). Expected: a new runtime on the same log finishes
    (or dead-letters) announcements left unsent, as it does turns left running."""
    chat = MemoryChannel("chat")
    chat.hang_next(1)  # the answer's send is in flight when the runtime closes
    hurried = runtime_config(fake.base_url, dead_letters={"close_grace_ms": 0})  # cut at once
    with Runtime(hurried, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        delivered(rt, chat, 1, attempted=True)
    records = list(store.read_stream("session:s1"))
    assert of(ActivationAcked, records)
    assert [e.text for e in of(AnnouncementQueued, records)] == ["default answer"]
    after = MemoryChannel("chat")
    channels = {"chat": after}
    cfg = runtime_config(fake.base_url)
    with Runtime(cfg, store=store, clock=clock, channels=channels) as rt:
        # the send could be under way in another runtime until its timeout has passed
        clock.advance(in_flight_s(cfg))
        sent = delivered(rt, after, 1)
    assert [m.text for m in sent] == ["default answer"]


def test_a_wake_at_nan_is_refused(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``rt.wake_at(session, float("nan"), ...)`` is accepted: ``decide_wake``'s
    horizon check is false for NaN and ``max(nan, now)`` keeps NaN, so an
    ``activation:ready`` with ``wake_at=nan`` is appended. That wake is never due
    (``run_at <= now`` is always false), so it never runs, holds one of
    ``max_pending_wakes`` for ever, makes its ``dedupe_key`` return it for ever, and turns
    the session's work-queue due time into NaN (claimed by every poll). Expected: a
    non-finite time is refused with a typed error (``SessionActionError`` /
    ``ValueError``) and nothing is appended."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rt.session("s1", channel="chat")
        head = store.head()
        with pytest.raises((SessionActionError, ValueError)):
            rt.wake_at("s1", math.nan, "check later", dedupe_key="later")
        assert store.head() == head


def test_a_config_knob_too_large_to_record_is_a_config_error(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: the integer knobs have no upper bound, so ``parse_config`` accepts e.g.
    ``supervision.execution_timeout_ms = 2**64``, but the runtime can never start with
    it: recording the config in ``runtime:started`` fails with ``EventError: cannot
    encode an event for 'runtime': can't serialize ints ... > 2**64 - 1``, which names
    neither the key nor the allowed range. DESIGN.md: a malformed config gets a clear,
    typed error that "names the key and the allowed values". Expected: ``ConfigError``
    naming ``execution_timeout_ms`` (from ``parse_config``, or at the latest from
    ``start()``)."""
    data = {
        "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
        "agents": {"default": {"provider": "main", "model": "m1"}},
        "supervision": {"execution_timeout_ms": 2**64},
    }

    def start() -> None:
        rt = Runtime(parse_config(data), store=store, clock=clock, channels={"chat": chat})
        try:
            rt.start()
        finally:
            rt.close()

    with pytest.raises(ConfigError, match="execution_timeout_ms"):
        start()


def test_a_session_id_too_long_for_the_store_is_refused_as_invalid(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``valid_session_id`` counts characters (1 to 128), the store counts bytes
    (a stream id is at most 400 UTF-8 bytes). 128 emoji pass the check (``session:`` +
    512 bytes), and ``rt.session`` then fails inside the store with
    ``InvalidStreamError`` instead of the documented ``SessionActionError``
    (``invalid_session``) "for an id no session can have". A host that catches the
    documented error to reject bad ids from its users crashes instead. Expected:
    ``SessionActionError`` with reason ``invalid_session``."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        with pytest.raises(SessionActionError) as refused:
            rt.session("\U0001f600" * 128, channel="chat")
        assert refused.value.reason == "invalid_session"
