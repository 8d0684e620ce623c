"""Review of the embedding runtime (open, send, control, close, the start-up resend):
defects found, each shown by a failing test.

Real parts only: a real LMDB store in ``tmp_path``, the loopback fake provider,
``MemoryChannel``s and the fake clock. Each docstring says what is (or was) wrong, why it
matters to a host or its users, and what is expected. All eight are fixed (the last five
were strict xfails for a session)."""

from __future__ import annotations

import anyio

from stalwart.actors import ABANDONED_TEXT
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import StalwartError
from stalwart.events import (
    ActivationAbandoned,
    AnnouncementDelivered,
    AnnouncementQueued,
)
from stalwart.runtime import Runtime, load_session, send_message
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import (
    GUARD,
    delivered,
    flush,
    has,
    log_until,
    of,
    runtime_config,
    settled,
)

# -- the live state and the log ------------------------------------------------------------


def test_a_sessions_status_counts_the_work_queued_for_it(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``SessionHandle.status()`` answers from the Agent's in-memory fold, which
    the Agent refreshes only when it appends something itself (``AgentActor._receive``
    handles ``AgentStatus`` with ``pass``). Everything else a durable session gets is
    appended to its stream by others (``send`` / ``wake_at`` / ``confirm`` / ``interrupt``
    go through ``_control``), so after ``rt.wake_at`` the report says ``queued == 0`` and
    ``idle`` with the session's version of before, while the log holds one more event and
    one pending activation. A host that polls ``status().idle`` to know whether work is
    left (or shows ``queued`` to an operator) is told there is none. Expected: the report
    agrees with a fold of the log at the time it is asked."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("hello")
        delivered(rt, chat, 1)
        log_until(store, "session:s1", has(AnnouncementDelivered))  # the Agent is done
        rt.wake_at("s1", clock.now() + 3_600, "check the refund landed")
        report = session.status(GUARD)
        folded, activations = load_session(store, "s1")
    assert activations.backlog == 1
    assert (report.session.version, report.queued) == (folded.version, activations.backlog)
    assert not report.idle


# -- one message, one answer -----------------------------------------------------------------


def test_a_message_sent_again_with_its_id_is_not_answered_twice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``handle.send(text, message_id=...)`` appends an ``activation:ready`` even
    when a message with that id is already in the conversation. The wake that runs it
    skips the user message (``_on_wake``: "not in the conversation yet"), yet still calls
    the model, on a conversation that ends with the assistant's last answer, and sends
    the user a second reply to a message they sent once. A host that hands on an inbound
    message with its own id (a chat platform redelivers its webhooks at least once)
    makes its user get every redelivered message answered again (and a new message that
    reuses an id is dropped, yet "answered"). Expected: a message id already recorded in
    the session is not run again (no model call, no reply), as a delayed wake's
    ``dedupe_key`` returns the pending one. Fixed: ``decide_message`` over the newest
    ``MESSAGES_KEPT`` message ids of the session's activations."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("where is order 7?", message_id="m1")
        delivered(rt, chat, 1)
        settled(store, "s1")
        session.send("where is order 7?", message_id="m1")  # the platform redelivered it
        settled(store, "s1")
    records = list(store.read_stream("session:s1"))
    assert len(of(AnnouncementQueued, records)) == 1
    assert len(fake.requests) == 1


# -- bad input -------------------------------------------------------------------------------


def test_a_message_with_a_lone_surrogate_does_not_put_its_text_in_the_error(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: a user message holding a lone surrogate (bytes that were not UTF-8, as a
    command line or a lenient JSON decoder hands them over) cannot be stored, and
    ``handle.send`` raises ``EventError("cannot encode an event for 'session:s1':
    UnicodeEncodeError('utf-8', '<the whole message>', ...)")``: the store's writer
    formats the encoder's exception with ``{exc!r}`` (``store/_environment.py``,
    ``append_in``), and a ``UnicodeEncodeError``'s repr holds the entire string. The user's
    text (here an account number) then lands in the host's error logs, however long it
    is. errors.py: messages "never contain secrets or payload content". Tool results get
    their lone surrogates replaced (``scrub_surrogates``); a user message does not.
    Expected: the message is accepted with its lone surrogates made valid, or refused
    with a typed error whose message holds none of its text."""
    text = "my account is 4111-1111-1111-1111 \udcff"
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        refusal: StalwartError | None = None
        try:
            session.send(text)
        except StalwartError as exc:
            refusal = exc
        if refusal is not None:
            assert "4111" not in str(refusal)
        else:
            [reply] = delivered(rt, chat, 1)
            assert reply.text == "default answer"


# -- the start-up resend ---------------------------------------------------------------------


def test_a_reply_another_live_runtime_is_sending_is_not_sent_again(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: an Agent that starts sends again every announcement of its session that is
    queued and not yet recorded as delivered or failed (``AgentActor._speak_up``), and the
    start-up sweep starts the Agent of every such session with no live lease
    (``left_unsent``). But a turn's answer is queued in the same append as its
    ``activation:acked``: while the runtime that answered is still sending it, the log
    looks exactly like a send a crash cut short. So a second runtime on the same log (the
    documented way to scale out, or a rolling restart) that starts, or touches the
    session, while the first is mid-send sends the same reply again: the user gets it
    twice. Expected: an announcement is sent again only once its sender is known to be
    gone (its runtime recorded ``runtime:stopped``) or its send could no longer be in
    flight (older than ``announce_timeout_ms``). Fixed: by its age (the send timeout
    plus ``RESEND_GRACE_S``); a younger one is looked at again when it is old enough."""
    cfg = runtime_config(fake.base_url, dead_letters={"close_grace_ms": 0})
    first = MemoryChannel("chat")
    first.hang_next(1)  # runtime A is still sending the answer (a slow receiver)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": first}) as a:
        a.session("s1", channel="chat").send("hello")
        delivered(a, first, 1, attempted=True)
        second = MemoryChannel("chat")
        with Runtime(cfg, store=store, clock=clock, channels={"chat": second}) as b:
            b.session("s1", channel="chat").status(GUARD)  # B's Agent of s1 has started
            flush(b.portal)
            resent = list(second.attempted)
    assert resent == []


def _unknown_channel_config(base_url: str) -> Config:
    """A runtime whose channels do not include the session's (nor ``console``), which
    gives up on a wake at its first failure."""
    return runtime_config(
        base_url,
        channels={"other": {"kind": "memory"}},
        activations={"max_attempts": 1},
    )


def test_an_abandonment_nobody_could_tell_is_told_by_the_next_runtime(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: when the worker gives up on a user's message and the session's Agent
    cannot be started to say so (its channel is not in this process's config, a store
    error, the runtime closing), the runtime only logs ``durable.abandoned_untold``: "the
    log says it all". The Agent would tell the user when it next starts
    (``_speak_up`` handles an abandonment with nothing announced since), but the next
    runtime's start-up sweep looks only for announcements left unsent (``left_unsent``),
    not for abandonments left untold; with no work due, nothing starts the Agent, and the
    user who sent the message hears nothing, ever. Expected: a runtime that can reach
    the session's channel tells the user (``ABANDONED_TEXT``) at start, as it resends a
    reply a crash cut short. Fixed: the sweep's ``left_unsaid`` counts it."""
    send_message(store, "s1", "hello", channel="chat", ts=clock.now())
    with Runtime(_unknown_channel_config(fake.base_url), store=store, clock=clock):
        log_until(store, "session:s1", has(ActivationAbandoned))
    chat = MemoryChannel("chat")
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        async def told() -> list[str]:
            with anyio.move_on_after(5.0):  # the sweep runs at start: this is generous
                await chat.wait_for(1)
            return [m.text for m in chat.messages]

        texts = rt.portal.submit(told).result(GUARD)
    assert texts == [ABANDONED_TEXT]


# -- handles ---------------------------------------------------------------------------------


def test_a_crashed_sessions_handle_answers_status_while_the_runtime_runs(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: once a session's Agent died of an exception (its restart waits for the
    supervisor's backoff, or supervision gave up on it), ``handle.status()`` raises a raw
    ``RuntimeError("session 's1' is stopped: its runtime was closed")`` although the
    runtime runs: ``SessionLayer._revive`` returns None for an Agent that is down and not
    passivated, and ``SessionHandle.status`` turns every None into that text. The same
    handle's ``send`` still works (the worker starts a new Agent at once). A host that
    believes the message rebuilds its runtime, or reports an outage that is not there.
    Expected: the report, folded from the log (or from an Agent started for it), as for a
    passivated session; at worst a typed error that says what is true. Fixed: folded
    from the log (the supervisor's backoff still decides when the Agent starts again)."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("hello")
        delivered(rt, chat, 1)
        log_until(store, "session:s1", has(AnnouncementDelivered))
        crashed = session.ref
        crashed.tell(object())  # the Agent dies of an exception (the clock does not move:
        assert crashed.actor_stopped.wait(GUARD)  # its restart's backoff has not passed)
        report = session.status(GUARD)
        assert not crashed.is_alive()
        assert session.ref is crashed  # status() does not restart it
    assert report.session.turns == 1
    assert report.idle


# -- channels --------------------------------------------------------------------------------


def test_a_host_channel_named_unlike_its_key_still_gets_the_sessions_replies_after_restart(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Defect: the runtime finds a host's channel by its key in ``channels=`` (the name
    ``rt.session(channel=...)`` takes), but records ``target.name`` in ``session:created``
    (``SessionLayer._record_created``) and in every ``announcement:queued`` and dead-letter
    entry. When the two differ (``channels={"chat": SlackChannel()}`` whose ``name`` is
    ``"slack"``), nothing complains; then the next runtime on the log runs the session's
    delayed wake, looks the recorded ``"slack"`` up among its channels, does not find it,
    and falls back to ``console``: the user's reply is printed on the server's stdout. A
    failed send is likewise dead-lettered to a channel the queue cannot find. Expected:
    the session keeps replying on the channel it was started on (record the key), or a
    channel whose name is not its key is refused up front with ``ConfigError``. Fixed:
    the key is recorded (the Agent's ``channel_name``)."""
    cfg = runtime_config(fake.base_url)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": MemoryChannel("slack")}) as rt:
        rt.session("s1", channel="chat")
        rt.wake_at("s1", clock.now() + 60, "check the refund landed")
    chat = MemoryChannel("slack")
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        clock.advance(60.0)
        records = log_until(store, "session:s1", has(AnnouncementQueued))
        [queued] = of(AnnouncementQueued, records)
        assert queued.channel in ("chat", "slack")  # not "console"
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"


def test_a_log_that_recorded_the_channels_own_name_still_finds_it_by_that_name(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """A log written before sessions recorded the key names the channel's own ``name``
    (``"slack"``): the runtime whose ``channels={"chat": ...}`` holds the one channel of
    that name replies there, and records its key from then on."""
    send_message(store, "s1", "hello", channel="slack", ts=clock.now())
    chat = MemoryChannel("slack")
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        [reply] = delivered(rt, chat, 1)
        records = log_until(store, "session:s1", has(AnnouncementDelivered))
    assert reply.text == "default answer"
    assert [queued.channel for queued in of(AnnouncementQueued, records)] == ["chat"]


# -- sub-agent runs --------------------------------------------------------------------------


def test_a_spawn_whose_task_cannot_be_recorded_is_refused_or_ends(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Defect: ``rt.spawn`` checks the timeout, the step budget and the channel before
    anything starts (``RunLayer._check``), but not the task. A task with a lone surrogate
    (what ``json.loads`` makes of a ``"\\udcff"`` escape in a model's ``spawn_subagent``
    arguments; a non-str task does the same) is accepted and a handle returned; the run's
    actor then dies on its first append (``subagent:spawned`` cannot be encoded), and the
    supervisor restarts it, again and again (a ``supervisor:restarted`` every few seconds,
    without end). Since ``subagent:spawned`` is never recorded, no watchdog is ever armed:
    the handle never resolves, the parent session hears nothing, the spawn has no
    timeout. "Every spawn has a timeout, no exceptions." Expected: ``SpawnRefusedError``
    (``field="task"``) with nothing started, or the task made valid and the run run."""

    async def work(report: object) -> str:
        return "done"

    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rt.session("s1", channel="chat")
        try:
            run = rt.spawn("s1", "summarise \udcff", task_class="research", work=work)
        except StalwartError:
            return  # refused up front: fine
        assert run.result(timeout=5.0).outcome == "succeeded"
