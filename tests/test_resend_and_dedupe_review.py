"""Review of the message-id dedupe and the gated resends (an Agent's unsent answer, a
supervisor's unsent notice): defects a review found, each shown by a test that failed
before its fix. All three are fixed.

Real parts only: a real LMDB store in ``tmp_path``, the loopback fake provider,
``MemoryChannel``s and the fake clock. Each docstring says what was wrong, why it
matters to a host or its users, and what is expected."""

from __future__ import annotations

from typing import Any

import pykka

from stalwart.actors import (
    GetRuns,
    IoPortal,
    Scheduler,
    SupervisorActor,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import SubagentSettings
from stalwart.events import (
    ActivationReady,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    MessageAppended,
    SessionCreated,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.testing import FakeProvider
from tests._runtime_support import (
    GUARD,
    attempted_on,
    delivered,
    flush,
    has,
    in_flight_s,
    log_until,
    of,
    runtime_config,
    settled,
)
from tests.test_supervisor import T0, batch_left_queued, notice_left_queued

ANNOUNCE_MS = 200  # the supervisors' send timeout (on the FakeClock)


# -- one message, one answer -----------------------------------------------------------------


def test_a_message_sent_with_an_empty_id_is_run_with_its_text_and_not_dropped(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``send_message`` (``runtime/_control.py``, what ``handle.send`` calls)
    used to treat a falsy ``message_id`` as none (``message_id or new_id()``); since the
    dedupe it takes only ``None`` as "no id", so ``message_id=""`` is recorded as the
    id ``""``. Two things then break. The wake adds a user message only when
    ``activation.message_id`` is truthy (``AgentActor._on_wake``), so the message's text
    never reaches the conversation: the model is called without it and the user gets an
    answer to nothing. And ``""`` is remembered among the session's message ids, so every
    later message sent with ``""`` is silently not recorded (``decide_message`` returns
    the first one's activation). A host that passes its platform's id straight through
    (``message_id=event.get("client_msg_id", "")``) loses its users' messages. The Agent
    path (``_record_message``) still maps ``""`` to a new id. Expected: an empty id is no
    id, as before: each message gets its own activation and is answered with its text.
    Fixed: ``send_message`` takes any falsy id as none."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("where is order 7?", message_id="")
        delivered(rt, chat, 1)
        log_until(store, "session:s1", has(AnnouncementDelivered))
        session.send("and order 8?", message_id="")
        settled(store, "s1")
    records = list(store.read_stream("session:s1"))
    users = [m.content for m in of(MessageAppended, records) if m.role == "user"]
    assert users == ["where is order 7?", "and order 8?"]
    assert len(of(ActivationReady, records)) == 2


# -- a resend under way is a send under way --------------------------------------------------


def test_an_answer_one_runtime_is_resending_is_not_sent_again_beside_it_by_another(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: ``AgentActor._speak_up`` leaves an unsent announcement to "its sender" only
    while it is younger than the send timeout plus ``RESEND_GRACE_S``, counted from the
    ``announcement:queued`` record. Once it is older, every Agent that starts for the
    session sends it again at once, and a resend records nothing when it begins, so the
    log of a resend under way looks exactly like the crash it repairs. Runtime A,
    restarted after a crash, resends the answer to a slow receiver (often the very
    reason the first send never ended); runtime B on the same log (the second worker
    docs/scaling.md describes, or a host opening the session there) starts the session's
    Agent meanwhile and sends the same answer beside it: the user gets it twice.
    docs/resilience.md promises the Agent "sends only what is still without an outcome"
    once "its send could no longer be under way". Expected: an announcement another
    runtime is (re)sending is not sent again until that send could no longer be in
    flight, e.g. the resend's start is recorded and the gate counts from the newest.
    Fixed: ``announcement:resent`` is appended (expecting the folded version) before
    the resend, and the gate counts from the newest send."""
    store.append(
        "session:s1",
        [
            SessionCreated(agent="default", channel="chat"),
            AnnouncementQueued(
                announcement_id="a-1", channel="chat", kind="completion", text="refund landed"
            ),
        ],
    )  # the runtime that queued it crashed mid-send
    cfg = runtime_config(fake.base_url, dead_letters={"close_grace_ms": 0})
    clock.advance(in_flight_s(cfg) + 1.0)  # the crashed sender's send is surely over
    first = MemoryChannel("chat")
    first.hang_next(1)  # runtime A's resend is still on its way (a slow receiver)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": first}) as a:
        a.session("s1", channel="chat").status(GUARD)  # A's Agent started and resent
        delivered(a, first, 1, attempted=True)
        second = MemoryChannel("chat")
        with Runtime(cfg, store=store, clock=clock, channels={"chat": second}) as b:
            b.session("s1", channel="chat").status(GUARD)  # B's Agent of s1 has started
            flush(b.portal)
            resent = list(second.attempted)
    assert [m.idempotency_key for m in first.attempted] == ["a-1"]
    assert resent == []


def supervisor(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    chat: Any,
    *,
    announce_ms: int = ANNOUNCE_MS,
    announcer: MemoryChannel | None = None,
) -> pykka.ActorRef[Any]:
    """A supervisor on ``store`` whose runs' channel is ``chat``."""
    return SupervisorActor.start(
        store=store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels={"chat": chat},
        settings=SubagentSettings(),
        announce_timeout_ms=announce_ms,
        announcer=announcer or MemoryChannel("parent"),
    )


def _sent_beside(store: EventStore, clock: FakeClock) -> tuple[list[str], list[str]]:
    """Supervisor A starts and resends what is due (its send hangs: still under way),
    then supervisor B of another process starts and sweeps: the idempotency keys each
    sent."""
    with (
        Scheduler(clock) as scheduler_a,
        IoPortal() as portal_a,
        Scheduler(clock) as scheduler_b,
        IoPortal() as portal_b,
    ):
        try:
            chat_a, chat_b = MemoryChannel("chat"), MemoryChannel("chat")
            chat_a.hang_next(1)  # A's resend is on its way (its Clock timeout never comes)
            supervisor(store, clock, scheduler_a, portal_a, chat_a)
            attempted_on(portal_a, chat_a, 1)  # A's first sweep resent it
            b = supervisor(store, clock, scheduler_b, portal_b, chat_b)
            b.ask(GetRuns(), timeout=GUARD)  # B's first sweep ran
            flush(portal_b)
        finally:
            pykka.ActorRegistry.stop_all(timeout=GUARD)
    return (
        [m.idempotency_key for m in chat_a.attempted],
        [m.idempotency_key for m in chat_b.attempted],
    )


def test_a_notice_one_supervisor_is_resending_is_not_sent_again_beside_it_by_another(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Defect: ``SupervisorActor._settle`` sends a queued notice again (directly) once
    ``notice_interrupted`` says its send could no longer be under way: the announce
    timeout plus ``RESEND_GRACE_S`` after ``notice_at``, the time its stage began. The
    direct resend that follows records nothing and leaves stage and ``notice_at`` as they
    were, so while supervisor A's resend is under way (a slow or hanging receiver), the
    supervisor of another process on the same log sees the same "interrupted" notice at
    its first sweep and sends it too: the user gets the failure notice twice. This is what
    the change set out to stop (CHANGELOG: "including one the supervisor of another
    process on the same log was still sending"; docs/resilience.md: "a supervisor of
    another process on the same log does not send a notice twice while its sender is at
    it"). Expected: a notice being resent elsewhere is not sent beside it until that send
    could no longer be under way, e.g. the resend's start is recorded and moves
    ``notice_at``. Fixed: the resend is a decision (``announcement:resent``, appended
    expecting the run's version) that moves ``notice_at``."""
    notice_left_queued(lmdb_store)
    clock.set(T0 + 130)  # past T0 + 120 + ANNOUNCE_MS / 1000 + RESEND_GRACE_S
    assert _sent_beside(lmdb_store, clock) == (["n1"], [])


def test_a_batch_one_supervisor_is_resending_is_not_sent_again_beside_it_by_another(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """The same gap for a batch of completions a crash cut short: once a supervisor sends
    it again, every run of the batch records ``announcement:resent``, so the supervisor
    of another process waits again whichever run of the batch it looks at first."""
    batch_left_queued(lmdb_store)
    settings = SubagentSettings()
    clock.set(T0 + 12 + (settings.announce_max_wait_ms + ANNOUNCE_MS) / 1000)
    assert _sent_beside(lmdb_store, clock) == (["b1"], [])
    for run_id in ("r1", "r2"):
        assert len(of(AnnouncementResent, list(lmdb_store.read_stream(f"session:{run_id}")))) == 1


def test_a_batch_whose_outcome_one_run_holds_is_not_sent_again(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """A crash between the appends of a batch's outcome leaves it recorded in one run and
    not in the other: the batch was sent, so no supervisor sends it again for the run
    that still shows it queued (whichever run of the batch comes first)."""
    batch_left_queued(lmdb_store)
    lmdb_store.append(
        "session:r2",
        [NewEvent(event=AnnouncementDelivered(announcement_id="b1", path="direct"), ts=T0 + 12)],
    )
    settings = SubagentSettings()
    clock.set(T0 + 12 + (settings.announce_max_wait_ms + ANNOUNCE_MS) / 1000)
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        try:
            chat = MemoryChannel("chat")
            ref = supervisor(lmdb_store, clock, scheduler, portal, chat)
            ref.ask(GetRuns(), timeout=GUARD)  # its first sweep ran
            flush(portal)
        finally:
            pykka.ActorRegistry.stop_all(timeout=GUARD)
    assert chat.attempted == []
