"""Durable sessions end to end: a real runtime, a real LMDB store, the fake provider over
loopback HTTP, the fake clock. Messages become activations, a worker leases them, the
Agent runs each as one fenced wake; approvals, custom tools, interrupts, delayed wakes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import structlog.testing

from stalwart.actors import APPROVAL_TEXT, DENIED_TEXT, UNRECONCILED_TEXT, drafts_note
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import SessionActionError
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    AnnouncementDelivered,
    ContextAssembled,
    ContextSummaryCreated,
    LeaseRenewed,
    MessageAppended,
    SessionCreated,
    SessionRequiresAction,
    ToolCall,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserInterrupt,
)
from stalwart.runtime import Runtime, send_message
from stalwart.state import DRAFTS, RECENT_MESSAGES, fold
from stalwart.store import EventStore, Fence, NewEvent, snapshot_name
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from stalwart.tools import current_call
from tests._runtime_support import (
    GUARD,
    agent_settings,
    crashed_mid_wake,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
)

AGENT = agent_settings()


def config(base_url: str, **extra: Any) -> Config:
    return runtime_config(base_url, **extra)


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def test_a_message_is_an_activation_leased_run_and_acked_in_one_append(
    rt: Runtime, store: EventStore, chat: MemoryChannel
) -> None:
    rt.session("s1", channel="chat").send("hello", message_id="m1")
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"
    records = log_until(store, "session:s1", has(ActivationAcked))
    types = [r.type for r in records if not r.type.startswith("prompt:")]
    assert types[:5] == [
        "session:created",
        "activation:ready",
        "activation:leased",
        "turn:started",
        "message:appended",
    ]
    acked = next(r for r in records if isinstance(r.event, ActivationAcked))
    completed = next(r for r in records if isinstance(r.event, TurnCompleted))
    assert acked.position == completed.position + 2  # turn end, announcement, ack: one append
    [leased] = of(ActivationLeased, records)
    assert leased.owner == rt.worker().owner
    assert leased.epoch == 1
    assert store.lease_epoch("session:s1") == 1
    assert rt.worker().running == {}


def test_messages_sent_while_a_wake_runs_are_answered_by_one_next_wake(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.add(Answer(text="first", first_delay_ms=300))
    session = rt.session("s1", channel="chat")
    session.send("one")
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    session.send("two")
    session.send("three")
    replies = delivered(rt, chat, 2)
    assert [r.text for r in replies] == ["first", "default answer"]
    records = log_until(store, "session:s1", has(ActivationAcked, 2))
    second = of(ActivationLeased, records)[1]
    assert len(second.covers) == 1  # "three" rides along with "two"
    users = [e.content for e in of(MessageAppended, records) if e.role == "user"]
    assert users == ["one", "two", "three"]
    assert fake.requests[1].body["messages"][-1]["content"] == "three"


def test_a_lease_is_renewed_while_the_wake_runs(
    rt: Runtime, store: EventStore, fake: FakeProvider, clock: FakeClock
) -> None:
    fake.add(Hang())
    rt.session("s1", channel="chat").send("slow")
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    clock.advance(10.0)
    [renewed] = of(LeaseRenewed, log_until(store, "session:s1", has(LeaseRenewed)))
    assert renewed.epoch == 1
    assert renewed.expires_at == clock.now() + 30.0


def _approval_runtime(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> tuple[Runtime, list[dict[str, Any]]]:
    runs: list[dict[str, Any]] = []
    rt = Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat})
    rt.start()

    @rt.tool(needs_confirmation=True)
    def refund(order: int, amount: float) -> str:
        """Refund an order."""
        runs.append({"order": order, "amount": amount})
        return f"refunded {amount} on {order}"

    call = FakeToolCall(id="c1", name="refund", arguments={"order": 7, "amount": 12.5})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refund done."))
    rt.session("s1", channel="chat").send("refund order 7")
    return rt, runs


def test_an_approval_pauses_the_session_and_an_allow_runs_the_stored_input_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    rt, runs = _approval_runtime(store, clock, fake, chat)
    with rt:
        [notice] = delivered(rt, chat, 1)
        assert notice.text == APPROVAL_TEXT
        records = log_until(store, "session:s1", has(AnnouncementDelivered))
        [request] = of(SessionRequiresAction, records)
        assert (request.kind, request.tool, request.call_id) == ("approval", "refund", "c1")
        assert request.arguments == '{"order":7,"amount":12.5}'
        assert runs == []
        # the session's stream, not the log's head: the context engine's calibration may be
        # appended to its own stream meanwhile
        head = store.stream_version("session:s1")
        with pytest.raises(SessionActionError) as wrong:
            rt.confirm("s1", "not-the-id", allow=True)
        assert wrong.value.reason == "not_pending"
        with pytest.raises(SessionActionError) as kind:
            rt.submit_tool_result("s1", request.request_id, "x")
        assert kind.value.reason == "wrong_kind"
        assert str(kind.value).endswith("is an approval request, not a custom tool's call")
        assert store.stream_version("session:s1") == head  # refused actions append nothing
        rt.confirm("s1", request.request_id, allow=True)
        replies = delivered(rt, chat, 2)
        assert replies[-1].text == "Refund done."
        with pytest.raises(SessionActionError):
            rt.confirm("s1", request.request_id, allow=True)  # a second answer
    assert runs == [{"order": 7, "amount": 12.5}]
    records = list(store.read_stream("session:s1"))
    assert len(of(ToolStarted, records)) == 1
    assert len(of(ToolCompleted, records)) == 1
    outcomes = [e.outcome for e in of(TurnCompleted, records)]
    assert outcomes == ["paused", "answered"]


def test_a_denied_call_is_not_run_and_the_model_reads_the_refusal(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    rt, runs = _approval_runtime(store, clock, fake, chat)
    with rt:
        records = log_until(store, "session:s1", has(ActivationBlocked))
        [request] = of(SessionRequiresAction, records)
        rt.confirm("s1", request.request_id, allow=False)
        delivered(rt, chat, 2)
    assert runs == []
    tool_message = fake.requests[1].body["messages"][-1]
    assert (tool_message["role"], tool_message["content"]) == ("tool", DENIED_TEXT)


def test_a_custom_tool_pauses_until_the_host_submits_its_output(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    rt.tools.register_custom(
        "ask_crm",
        description="Look a customer up in the CRM.",
        parameters={"type": "object", "properties": {"email": {"type": "string"}}},
    )
    call = FakeToolCall(id="k1", name="ask_crm", arguments={"email": "a@b.c"})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Found them."))
    rt.session("s1", channel="chat").send("who is a@b.c?")
    records = log_until(store, "session:s1", has(ActivationBlocked))
    [request] = of(SessionRequiresAction, records)
    assert (request.kind, request.arguments) == ("custom_tool", '{"email":"a@b.c"}')
    assert not chat.attempted  # a host tool is not the user's business
    rt.submit_tool_result("s1", request.request_id, "Ada, customer since 2019")
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "Found them."
    tool_message = fake.requests[1].body["messages"][-1]
    assert tool_message == {
        "role": "tool",
        "tool_call_id": "k1",
        "content": "Ada, customer since 2019",
    }


def test_an_interrupt_clears_the_request_and_cancels_queued_work(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    rt, runs = _approval_runtime(store, clock, fake, chat)
    with rt:
        records = log_until(store, "session:s1", has(ActivationBlocked))
        [request] = of(SessionRequiresAction, records)
        rt.session("s1").send("are you there?")  # queued behind the pause
        cancelled = rt.interrupt("s1", "operator")
        assert len(cancelled) == 1
        with pytest.raises(SessionActionError) as late:
            rt.confirm("s1", request.request_id, allow=True)
        assert late.value.reason == "not_pending"
        records = list(store.read_stream("session:s1"))
        [interrupted] = of(UserInterrupt, records)
        assert interrupted.epoch == 2
        assert store.lease_epoch("session:s1") == 2
        assert len(of(ActivationCancelled, records)) == 1
    assert runs == []


def test_an_interrupt_stops_a_running_wake_which_appends_nothing_more(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.add(Hang())
    rt.session("s1", channel="chat").send("long job")
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    rt.interrupt("s1")
    assert fake.wait_finished(0, GUARD).outcome == "client_closed"
    records = list(store.read_stream("session:s1"))
    assert records[-1].type in {"activation:cancelled", "activation:lease_lost"}
    assert not of(ActivationAcked, records)
    assert not chat.attempted


def test_a_delayed_wake_runs_once_when_due_and_dedupes_by_key(
    rt: Runtime, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> None:
    session = rt.session("s1", channel="chat")
    first = rt.wake_at("s1", clock.now() + 60, "check the order", dedupe_key="order-7")
    again = rt.wake_at("s1", clock.now() + 90, "check the order", dedupe_key="order-7")
    assert first == again
    assert len(of(ActivationReady, list(store.read_stream("session:s1")))) == 1
    clock.advance(59.0)
    assert session.status(GUARD).session.turns == 0
    clock.advance(1.0)
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"
    records = log_until(store, "session:s1", has(ActivationAcked))
    [leased] = of(ActivationLeased, records)
    assert leased.activation_id == first
    clock.advance(600.0)
    assert len(of(ActivationLeased, list(store.read_stream("session:s1")))) == 1


def test_a_message_id_sent_from_many_threads_at_once_is_recorded_once(
    store: EventStore, clock: FakeClock
) -> None:
    """Redeliveries racing each other (and the session's creation): one
    ``activation:ready`` for the id, and every sender is given its activation id."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        ids = list(
            pool.map(
                lambda _: send_message(store, "s1", "refund?", message_id="m1", ts=clock.now()),
                range(16),
            )
        )
    records = list(store.read_stream("session:s1"))
    [ready] = of(ActivationReady, records)
    assert len(of(SessionCreated, records)) == 1
    assert set(ids) == {ready.activation_id}
    other = send_message(store, "s1", "and order 8?", message_id="m2", ts=clock.now())
    assert other != ready.activation_id
    assert len(of(ActivationReady, list(store.read_stream("session:s1")))) == 2


def test_a_message_id_is_remembered_across_the_recent_messages_snapshot(
    store: EventStore, clock: FakeClock
) -> None:
    """A long session's message ids are read from a snapshot of the recent-messages fold
    and the events after it, not from the whole stream: an id given before the snapshot
    is still known after it."""
    first = send_message(store, "s1", "refund?", message_id="m1", ts=clock.now())
    chatter = [
        NewEvent(event=MessageAppended(message_id=f"x{n}", role="user", content="."))
        for n in range(600)
    ]
    store.append("session:s1", chatter)  # past the snapshot interval (500)
    other = send_message(store, "s1", "order 8?", message_id="m2", ts=clock.now())
    assert [s.version for s in store.snapshots("session:s1", snapshot_name(RECENT_MESSAGES))]
    store.append("session:s1", chatter[:10])
    assert send_message(store, "s1", "refund?", message_id="m1", ts=clock.now()) == first
    assert send_message(store, "s1", "order 8?", message_id="m2", ts=clock.now()) == other
    assert len(of(ActivationReady, list(store.read_stream("session:s1")))) == 2


def test_wake_caps_are_refused_with_a_clear_error(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = config(fake.base_url, activations={"max_pending_wakes": 1, "max_wake_horizon_ms": 60_000})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat")
        with pytest.raises(SessionActionError, match="too_far"):
            rt.wake_at("s1", clock.now() + 61, "later")
        rt.wake_at("s1", clock.now() + 30, "soon")
        with pytest.raises(SessionActionError, match="too_many") as full:
            rt.wake_at("s1", clock.now() + 30, "another")
        assert full.value.reason == "wake_refused"


# -- a wake a crash cut short: resumed, its started calls reconciled, never re-run blindly


def _crashed_mid_tool(store: EventStore, clock: FakeClock) -> None:
    """The log a process leaves when it dies while a tool call runs."""
    call = ToolCall(id="c1", name="refund", arguments='{"order":7}')
    events = [
        SessionCreated(agent="default", channel="chat"),
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="refund 7"),
        ActivationLeased(activation_id="a1", owner="dead", epoch=1, expires_at=clock.now() - 1),
        TurnStarted(turn_id="t1", trigger="message"),
        MessageAppended(message_id="m1", role="user", content="refund 7", turn_id="t1"),
        MessageAppended(message_id="x", role="assistant", tool_calls=(call,), turn_id="t1"),
        ToolStarted(call_id="c1", tool="refund", idempotency_key="session:s1/c1", turn_id="t1"),
    ]
    store.append("session:s1", events, fence=Fence(1, claim=True))


@pytest.mark.parametrize("effect_happened", [True, False])
def test_a_cut_short_call_is_reconciled_by_its_tool(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    effect_happened: bool,
) -> None:
    _crashed_mid_tool(store, clock)
    runs: list[str | None] = []
    checks: list[tuple[str, dict[str, Any]]] = []

    def check(key: str, arguments: dict[str, Any]) -> str | None:
        checks.append((key, arguments))
        return "refund 7 was already made" if effect_happened else None

    fake.add(Answer(text="Done."))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(reconcile=check)
        def refund(order: int) -> str:
            """Refund an order."""
            context = current_call()
            runs.append(context.idempotency_key if context else None)
            return f"refunded {order}"

        [reply] = delivered(rt, chat, 1)
    assert reply.text == "Done."
    assert checks == [("session:s1/c1", {"order": 7})]
    assert runs == ([] if effect_happened else ["session:s1/c1"])
    records = list(store.read_stream("session:s1"))
    [completed] = of(ToolCompleted, records)
    assert completed.reconciled is effect_happened
    types = [r.type for r in records]
    assert types[7:9] == ["lease:expired", "activation:leased"]
    assert of(TurnCompleted, records)[0].outcome == "interrupted"
    assert len(of(MessageAppended, records)) == 4  # the user message was not added again


def test_a_cut_short_call_without_a_check_is_surfaced_not_run(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    _crashed_mid_tool(store, clock)
    runs: list[int] = []
    fake.add(Answer(text="I could not confirm the refund."))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool
        def refund(order: int) -> str:
            """Refund an order."""
            runs.append(order)
            return "refunded"

        delivered(rt, chat, 1)
    assert runs == []
    [failed] = of(ToolFailed, list(store.read_stream("session:s1")))
    assert failed.error_class == "unreconciled"
    assert fake.requests[0].body["messages"][-1]["content"] == UNRECONCILED_TEXT


def test_drafts_are_staged_survive_the_wake_and_are_committed_only_on_request(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    written: list[tuple[str, str, str, str]] = []
    write = FakeToolCall(
        id="w1", name="draft_write", arguments={"path": "notes.md", "content": "v1\n"}
    )
    commit = FakeToolCall(id="w2", name="draft_commit", arguments={"path": "notes.md"})
    fake.add(
        Answer(text="", tool_calls=(write,)),
        Answer(text="Staged."),
        Answer(text="", tool_calls=(commit,)),
        Answer(text="Committed."),
    )
    with Runtime(
        config(fake.base_url),
        store=store,
        clock=clock,
        channels={"chat": chat},
        committer=lambda *args: written.append(args),
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.send("draft the notes")
        delivered(rt, chat, 1)
        assert written == []  # staged, not written out
        session.send("commit them")
        replies = delivered(rt, chat, 2)
    assert replies[-1].text == "Committed."
    [(session_id, path, content, digest)] = written
    assert (session_id, path, content) == ("s1", "notes.md", "v1\n")
    system = fake.requests[2].body["messages"][0]
    assert system["role"] == "system"
    assert "notes.md (revision 1, 3 bytes" in system["content"]
    records = list(store.read_stream("session:s1"))
    drafts = fold(DRAFTS, "session:s1", records)
    assert drafts.drafts["notes.md"].status == "committed"
    assert drafts.drafts["notes.md"].content_hash == digest
    assert "notes.md" not in (drafts_note(drafts.open()) or "")


def test_an_idle_agent_is_passivated_and_rebuilt_by_its_next_wake(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = config(fake.base_url, activations={"passivate_after_ms": 60_000})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        session.send("one")
        delivered(rt, chat, 1)
        # the Agent has taken the send's outcome in (an Agent with a send in flight is
        # not idle, and the sweep would look again only when the clock moves on)
        log_until(store, "session:s1", has(AnnouncementDelivered))
        first = session.ref
        clock.advance(30.0)
        assert first.is_alive()  # not idle long enough yet
        clock.advance(60.0)
        first.actor_stopped.wait(GUARD)
        assert not first.is_alive()
        session.send("two")
        replies = delivered(rt, chat, 2)
        assert replies[-1].text == "default answer"
        assert session.ref is not first
        assert session.ref.is_alive()
        assert session.status(GUARD).session.turns == 2  # rebuilt from the log


def test_a_session_of_an_agent_the_config_lacks_runs_as_default_and_says_so(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A message queued from the command line for ``--agent billing`` (or for an agent the
    operator renamed) used to be answered by ``default`` with no word anywhere."""
    send_message(store, "s9", "hello", agent="billing", channel="chat", ts=clock.now())
    cfg = config(fake.base_url)
    with (
        structlog.testing.capture_logs() as logs,
        Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt,
    ):
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"
    [warning] = [e for e in logs if e["event"] == "runtime.agent_not_configured"]
    assert (warning["session"], warning["agent"], warning["log_level"]) == (
        "s9",
        "billing",
        "warning",
    )


def test_an_agent_that_crashes_mid_wake_is_retried_with_backoff(
    rt: Runtime, store: EventStore, fake: FakeProvider, clock: FakeClock, chat: MemoryChannel
) -> None:
    _, records = crashed_mid_wake(rt, fake, store, message_id="m1")
    [requeued] = of(ActivationRequeued, records)
    assert (requeued.streak, requeued.delay_ms, requeued.error_class) == (1, 2000, "agent_crashed")
    assert requeued.run_at == clock.now() + 2.0
    clock.advance(0.5)  # the supervisor's restart backoff
    assert len(of(ActivationLeased, list(store.read_stream("session:s1")))) == 1
    clock.advance(1.5)  # the retry is due: leased again at the next epoch, answered
    [reply] = delivered(rt, chat, 1)
    assert reply.text == "default answer"
    records = log_until(store, "session:s1", has(ActivationAcked))
    assert [e.epoch for e in of(ActivationLeased, records)] == [1, 2]
    assert of(ActivationAcked, records)[0].epoch == 2
    assert [e.outcome for e in of(TurnCompleted, records)] == ["interrupted", "answered"]
    users = [e for e in of(MessageAppended, records) if e.role == "user"]
    assert [u.message_id for u in users] == ["m1"]  # the retry did not add it again


def test_the_durable_log_verifies_clean(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Every lease, settlement, retry, pause and interrupt of a run of the runtime is
    re-derived by ``replay --verify`` from the state just before it."""
    rt, _runs = _approval_runtime(store, clock, fake, chat)
    with rt:
        records = log_until(store, "session:s1", has(ActivationBlocked))
        [request] = of(SessionRequiresAction, records)
        rt.confirm("s1", request.request_id, allow=True)
        delivered(rt, chat, 2)
        fake.add(Hang())
        other = rt.session("s2", channel="chat")
        other.send("hello")
        fake.wait_for(lambda requests: len(requests) == 3, GUARD)
        other.ref.tell(object())  # a crash mid-wake: requeued, retried
        log_until(store, "session:s2", has(ActivationRequeued))
        clock.advance(2.0)
        log_until(store, "session:s2", has(ActivationAcked))
        rt.session("s3", channel="chat").send("one")
        rt.interrupt("s3")
        rt.wake_at("s1", clock.now() + 5, "later")
        clock.advance(5.0)
        log_until(store, "session:s1", has(ActivationAcked, 2))
    report = verify_store(store, None)
    assert report.findings == ()
    for tag in ("activation:leased", "activation:acked", "activation:requeued"):
        assert report.checked[tag] >= 1, tag
    assert report.checked["activation:blocked"] == 1
    assert report.checked["user:interrupt"] == 1


def test_a_settlement_under_a_stale_lease_fails_verification(
    store: EventStore, clock: FakeClock
) -> None:
    now = clock.now()
    events = [
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="x"),
        ActivationLeased(
            activation_id="a1", owner="w1", epoch=1, expires_at=now + 30, ttl_ms=30_000
        ),
        ActivationAcked(activation_id="a1", epoch=7),
    ]
    store.append("session:s9", [NewEvent(event=e, ts=now) for e in events])
    report = verify_store(store, "session:s9")
    [finding] = report.findings
    assert finding.kind == "mismatch"
    assert finding.tag == "activation:acked"
    assert "settled at epoch 7 while the live lease was epoch 1" in finding.message


def test_a_long_session_is_fitted_into_the_window_by_the_context_engine(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    agents = {"default": AGENT | {"context_window": 3_000, "max_tokens": 200}}
    cfg = config(fake.base_url, agents=agents, context_engine={"fresh_tail_turns": 2})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        for n in range(12):
            fake.add(Answer(text=f"noted {n}. " + "words " * 150))
            session.send(f"fact {n}: the code is {n * 7}. " + "detail " * 150)
            delivered(rt, chat, n + 1)
    summaries = of(ContextSummaryCreated, list(store.read_stream("context:s1")))
    assert summaries  # the oldest turns were summarized, not dropped
    last = fake.requests[-1].body["messages"]
    assert "fact 11" in last[-1]["content"]  # the newest turn is verbatim
    assert any("stalwart:summary" in m["content"] for m in last)
    assembled = of(ContextAssembled, list(store.read_stream("context:s1")))
    assert assembled
    assert all(a.tokens_out <= a.budget for a in assembled)
