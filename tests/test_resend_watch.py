"""The resend watch: a durable runtime looks again, every ``RESEND_SWEEP_S`` on its Clock,
for sessions whose reply another worker of the same log left unsent (frozen,
partitioned, killed and not restarted) after the start-up pass had looked.

Real parts: an LMDB store in ``tmp_path``, the fake provider on loopback, MemoryChannels.
The watch's interval is a scheduler timer on the runtime's Clock, so a FakeClock drives
every pass here; nothing sleeps for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from stalwart.actors import SendsPending
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    MessageAppended,
    SessionCreated,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.runtime._sessions import RESEND_SWEEP_S
from stalwart.store import EventStore, NewEvent
from stalwart.testing import FakeProvider
from tests._runtime_support import in_flight_s, of, runtime_config, until

GUARD = 30.0  # real seconds: the longest a wait on other threads may take

Logs = list[MutableMapping[str, Any]]


def _until(check: Callable[[], Any], what: str) -> Any:
    return until(check, GUARD, what=what)


def _named(name: str) -> bool:
    return any(t.name == name for t in threading.enumerate())


def _passes(logs: Logs) -> int:
    return sum(1 for entry in logs if entry["event"] == "runtime.resend_watch_passed")


def _resends(logs: Logs, session: str) -> int:
    return sum(
        1
        for entry in logs
        if entry["event"] == "runtime.resend_cut_short" and entry.get("session") == session
    )


def _watching(logs: Logs) -> None:
    """The start-up pass has ended and the watch is waiting for its timer."""
    _until(lambda: not _named("stalwart-resend"), "the start-up pass ended")
    _until(lambda: _named("stalwart-resend-watch"), "the watch runs")


def _advance_one_pass(clock: FakeClock, logs: Logs, seconds: float) -> None:
    """Move the clock (the watch's timer fires inside ``advance``) and wait for the pass."""
    before = _passes(logs)
    clock.advance(seconds)
    _until(lambda: _passes(logs) > before, "the watch's pass ended")


def _left_unsent(store: EventStore, session: str, ts: float) -> None:
    """What another worker's Agent leaves when it is frozen mid-send: an answered turn and
    its reply queued, with no outcome."""
    events = [
        SessionCreated(agent="default", channel="chat"),
        TurnStarted(turn_id="t1"),
        MessageAppended(message_id="m1", role="user", content="refund order 7", turn_id="t1"),
        MessageAppended(message_id="m2", role="assistant", content="Refunded.", turn_id="t1"),
        TurnCompleted(turn_id="t1", outcome="answered"),
        AnnouncementQueued(announcement_id="a1", channel="chat", text="Refunded."),
    ]
    store.append(f"session:{session}", [NewEvent(event=e, ts=ts) for e in events])


def test_a_reply_left_unsent_after_start_is_resent_at_the_first_pass_once_quiet(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, logs: Logs
) -> None:
    """The start-up pass found nothing; a reply another worker left unsent afterwards is
    not touched while its sender's send may still be under way (the passes before the
    send's timeout and grace are over), and is resent, once, by the first pass after."""
    config = runtime_config(fake.base_url)
    quiet_s = in_flight_s(config)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        _watching(logs)
        _left_unsent(store, "s1", clock.now())
        waited = RESEND_SWEEP_S
        while waited < quiet_s:  # each pass: the log moved, but is not quiet yet
            _advance_one_pass(clock, logs, RESEND_SWEEP_S)
            waited += RESEND_SWEEP_S
            assert _resends(logs, "s1") == 0
        assert waited > RESEND_SWEEP_S  # there were such passes
        assert chat.messages == []
        _advance_one_pass(clock, logs, RESEND_SWEEP_S)  # the first pass once it is quiet
        assert _resends(logs, "s1") == 1
        handle = rt.session("s1", channel="chat")  # the Agent the pass started
        _until(lambda: [m.text for m in chat.messages] == ["Refunded."], "the reply is resent")
        _until(lambda: handle.ref.ask(SendsPending(), timeout=GUARD) == 0, "sends ended")
        for _ in range(3):  # later passes: the log moved (the resend), nothing is left unsaid
            _advance_one_pass(clock, logs, RESEND_SWEEP_S + quiet_s)
        records = list(store.read_stream("session:s1"))
    assert [m.text for m in chat.messages] == ["Refunded."]
    assert len(of(AnnouncementResent, records)) == 1
    assert len(of(AnnouncementDelivered, records)) == 1
    assert _resends(logs, "s1") == 1


def test_a_session_the_watch_found_settled_is_looked_at_again_when_its_log_moves(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, logs: Logs
) -> None:
    """A session the watch looked at and found settled (its reply sent) is remembered as
    looked at; when its log moves again and goes quiet with a reply left unsent, the
    watch looks again and resends it."""
    config = runtime_config(fake.base_url)
    quiet_s = in_flight_s(config)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        _watching(logs)
        _left_unsent(store, "s1", clock.now())
        store.append("session:s1", [NewEvent(event=AnnouncementDelivered(announcement_id="a1"))])
        _advance_one_pass(clock, logs, quiet_s + 1.0)  # looked at: nothing left unsaid
        for _ in range(3):
            _advance_one_pass(clock, logs, RESEND_SWEEP_S)
        assert _resends(logs, "s1") == 0
        queued = AnnouncementQueued(announcement_id="a2", channel="chat", text="Also refunded.")
        store.append("session:s1", [NewEvent(event=queued, ts=clock.now())])
        _advance_one_pass(clock, logs, quiet_s + 1.0)
        assert _resends(logs, "s1") == 1
        handle = rt.session("s1", channel="chat")
        _until(lambda: [m.text for m in chat.messages] == ["Also refunded."], "a2 is resent")
        _until(lambda: handle.ref.ask(SendsPending(), timeout=GUARD) == 0, "sends ended")


def test_a_closed_runtime_leaves_no_watch_and_no_timer(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, logs: Logs
) -> None:
    """The watch ends with its runtime at once (not at its next pass), and a clock moved
    afterwards runs no pass against the closed store."""
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}):
        _watching(logs)
        _advance_one_pass(clock, logs, RESEND_SWEEP_S)
    assert not _named("stalwart-resend-watch")
    passes = _passes(logs)
    _left_unsent(store, "s1", clock.now())
    clock.advance(10 * (RESEND_SWEEP_S + in_flight_s(config)))
    assert _passes(logs) == passes
    assert _resends(logs, "s1") == 0
    assert chat.messages == []
