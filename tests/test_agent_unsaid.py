"""What a crash or a given-up wake would otherwise leave unsaid: the user is told.

- a durable wake the worker gives up on (its Agent crashed on every attempt) closes the
  turn it left running and sends one static notice;
- a wake no Agent can take (the session's channel is not configured) is retried and
  given up on, not leased for ever;
- an answer whose send a crash cut short is sent again by the restarted Agent.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lmdb
import structlog.testing

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    ActivationRequeued,
    AnnouncementDelivered,
    AnnouncementQueued,
    LeaseRenewed,
    SessionCreated,
    SupervisorRestarted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime, send_message
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang

from ._runtime_support import (
    GUARD,
    delivered,
    has,
    in_flight_s,
    log_until,
    of,
    runtime_config,
)


def _config(fake: FakeProvider, **extra: Any) -> Config:
    return runtime_config(fake.base_url, prompt_timeout_ms=120_000, **extra)


def _pass(clock: FakeClock, seconds: int) -> None:
    """Let fake time pass a second at a time, giving the actors a moment at each."""
    for _ in range(seconds):
        clock.advance(1.0)
        # the worker, supervisor and Agent run each fake second's timers on their own
        # threads; a moment lets them append before time moves on again
        time.sleep(0.01)  # real-time: actor threads append between fake seconds


def test_a_wake_given_up_on_closes_its_turn_and_tells_the_user(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.set_default(Hang())
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("hello")
        abandoned = has(ActivationAbandoned)
        for attempt in range(1, 6):  # max_attempts: the Agent dies of a bug on every one
            fake.wait_for(lambda requests, n=attempt: len(requests) >= n, GUARD)
            session.ref.tell(object())
            log_until(
                store,
                "session:s1",
                lambda rs, n=attempt: has(ActivationRequeued, n)(rs) or abandoned(rs),
            )
            _pass(clock, 40)  # the supervisor's restart backoff, then the requeue's
        records = log_until(store, "session:s1", has(AnnouncementDelivered))
        [notice] = delivered(rt, chat, 1)
        assert (notice.text, notice.kind) == (ABANDONED_TEXT, "failure_notice")
        started = [e.turn_id for e in of(TurnStarted, records)]
        closed = {e.turn_id: e for e in of(TurnCompleted, records)}
        assert set(started) == set(closed)  # no turn is left running
        last = closed[started[-1]]
        assert (last.outcome, last.reason) == ("failed", "abandoned")
        [queued] = of(AnnouncementQueued, records)  # once, even with the Agent restarted
        assert queued.text == ABANDONED_TEXT
        assert rt.runs() is not None


def test_a_wake_no_agent_can_take_is_retried_then_given_up(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    # recorded for the "console" channel, which this runtime's config does not have
    send_message(store, "s1", "hello", ts=clock.now())
    config = _config(fake, channels={"chat": {"kind": "memory"}})
    with Runtime(config, store=store, clock=clock) as rt:
        log_until(store, "session:s1", has(ActivationLeased))
        deadline = time.monotonic() + GUARD
        while time.monotonic() < deadline:
            _pass(clock, 30)
            if has(ActivationAbandoned)(list(store.read_stream("session:s1"))):
                break
        records = list(store.read_stream("session:s1"))
        assert of(ActivationAbandoned, records)
        assert len(of(ActivationRequeued, records)) == 4  # max_attempts 5
        assert rt.worker().running == {}
        renewals = len(of(LeaseRenewed, records))
        _pass(clock, 120)
        assert len(of(LeaseRenewed, list(store.read_stream("session:s1")))) == renewals


def test_an_answer_whose_send_a_crash_cut_short_is_sent_again(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    chat.hang_next(1)  # the first send hangs until the Agent's send deadline cancels it
    config = _config(fake, dead_letters={"announce_timeout_ms": 300})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("hello")
        [queued] = of(AnnouncementQueued, log_until(store, "session:s1", has(AnnouncementQueued)))
        delivered(rt, chat, 1, attempted=True)
        session.ref.tell(object())  # the Agent dies while its send is in flight
        log_until(store, "runtime", has(SupervisorRestarted))
        deadline = time.monotonic() + GUARD
        while not chat.messages and time.monotonic() < deadline:
            _pass(clock, 1)
        assert [m.text for m in chat.messages] == ["default answer"]
        assert chat.messages[0].idempotency_key == queued.announcement_id
        records = log_until(store, "session:s1", has(AnnouncementDelivered))
        [done] = of(AnnouncementDelivered, records)
        assert done.announcement_id == queued.announcement_id


def test_an_answer_young_enough_to_be_in_flight_elsewhere_is_sent_once_its_time_is_past(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """An answer queued a moment ago with no outcome may still be on its way from the
    runtime that queued it: its Agent, once started, sends it only when the sender's send
    timeout (plus ``RESEND_GRACE_S``) is past."""
    created = SessionCreated(agent="default", channel="chat")
    answer = AnnouncementQueued(
        announcement_id="a-1", channel="chat", kind="completion", text="your refund landed"
    )
    store.append("session:s1", [created, answer])
    config = _config(fake)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").status(GUARD)  # its Agent has started (and spoken)
        clock.advance(in_flight_s(config) - 1.0)
        assert chat.attempted == []
        clock.advance(1.0)
        [message] = delivered(rt, chat, 1)
        assert (message.text, message.idempotency_key) == ("your refund landed", "a-1")
        log_until(store, "session:s1", has(AnnouncementDelivered))
    assert len(chat.attempted) == 1


def test_only_recent_news_is_sent_again(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    def queued(session: str, text: str) -> None:
        created = SessionCreated(agent="default", channel="chat")
        announcement = AnnouncementQueued(
            announcement_id=f"a-{session}", channel="chat", kind="completion", text=text
        )
        store.append(f"session:{session}", [created, announcement])

    queued("old", "an answer from two hours ago")
    clock.advance(7_200 - 600)
    queued("new", "an answer from ten minutes ago")
    clock.advance(600)
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("old", channel="chat")
        rt.session("new", channel="chat")
        [message] = delivered(rt, chat, 1)
        assert message.text == "an answer from ten minutes ago"
        log_until(store, "session:new", has(AnnouncementDelivered))
        # proving that no second send comes needs a wait; both Agents had started before
        # the first send was delivered, and a resend is submitted at start
        time.sleep(0.2)  # real-time: proving an absence needs a wait
        assert len(chat.attempted) == 1
        assert not of(AnnouncementDelivered, list(store.read_stream("session:old")))


def test_a_damaged_session_does_not_stop_the_resend_of_the_others(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The start-up resend reads each recent session's log; one it cannot read (a
    corrupt record) is logged and passed over, and the sessions after it still get
    their answers (it used to end the whole sweep)."""
    directory = tmp_path / "store"
    writer = store_module.open(directory, clock=clock)
    try:
        for session in ("a-broken", "b-fine"):
            created = SessionCreated(agent="default", channel="chat")
            announcement = AnnouncementQueued(
                announcement_id=f"ann-{session}", channel="chat", kind="completion", text=session
            )
            writer.append(f"session:{session}", [created, announcement])
        broken = list(writer.read_stream("session:a-broken"))[-1].position
    finally:
        writer.close()
    env = lmdb.open(str(directory), max_dbs=8)  # bit rot in the broken session's record
    try:
        with env.begin(write=True) as txn:
            txn.put(broken.to_bytes(8, "big"), b"\xc1garbage", db=env.open_db(b"log", txn=txn))
    finally:
        env.close()
    store = store_module.open(directory, clock=clock)
    clock.advance(in_flight_s(_config(fake)))  # the process that was sending them is gone
    try:
        with (
            structlog.testing.capture_logs() as captured,
            Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt,
        ):
            [message] = delivered(rt, chat, 1)  # no session opened: the sweep started it
            assert message.text == "b-fine"
            failed = [e for e in captured if e["event"] == "runtime.resend_failed"]
            assert [e["session"] for e in failed] == ["a-broken"]
    finally:
        store.close()
