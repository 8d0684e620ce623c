"""The Agent end to end: a real LMDB log, the fake provider over loopback, a real I/O portal.

Two time bases, on purpose. The actor, its scheduler and the log's decisions run on a
``FakeClock``: the execution timeout (10 minutes by default) is fired by moving that
clock, exactly at its limit. The model caller runs on a ``SystemClock`` with budgets of a
few seconds, as in production: its HTTP requests are real, so a ``Hang`` really hangs on
the wire until the actor cancels it, and the fake sees the client close. (Sharing the
fake clock with the caller would freeze its stall budget and make the backstop race
against it.) Tests wait on futures, the log (``store.wait_for``) and the fake's record,
never on a sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio
import msgspec
import pykka
import pytest

from stalwart.actors import (
    ABANDONED_TEXT,
    DEGRADED_TEXT,
    FAILED_TEXT,
    MAX_STEPS_TEXT,
    OVERFLOW_TEXT,
    TIMEOUT_TEXT,
    UNANSWERED_TOOL_TEXT,
    AgentActor,
    AgentLoopSettings,
    AgentReport,
    AgentStatus,
    DeadLetterActor,
    IoPortal,
    ModelDone,
    QueueState,
    Scheduler,
    UserMessage,
    decide_execution_timeout,
    request_messages,
)
from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock, SystemClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    Event,
    ExecutionAborted,
    MessageAppended,
    RecordedEvent,
    ToolBlocked,
    ToolCall,
    TurnCompleted,
    TurnStarted,
)
from stalwart.providers import Message, ProviderResponse
from stalwart.runtime import ProviderLayer
from stalwart.store import EventStore
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall, Hang, RecordedRequest
from stalwart.tools import ToolRegistry, blocked_text

GUARD = 10.0
SESSION = "s1"
STREAM = f"session:{SESSION}"
AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
    "retry_base_ms": 10,
    "retry_cap_ms": 50,
    "activity_interval_ms": 20,
}
E = TypeVar("E", bound=Event)


# -- the parts ------------------------------------------------------------------------------


@pytest.fixture
def channel() -> MemoryChannel:
    return MemoryChannel()


def config(base_url: str, **agent: Any) -> Config:
    main = {"kind": "openai", "base_url": base_url, "breaker_failure_threshold": 50}
    providers = {"main": main, "backup": dict(main)}
    return parse_config({"providers": providers, "agents": {"default": AGENT | agent}})


class Harness:
    """Starts Agents on the shared parts and stops them (and the provider layer) after."""

    def __init__(
        self,
        store: EventStore,
        clock: FakeClock,
        scheduler: Scheduler,
        portal: IoPortal,
        fake: FakeProvider,
        channel: MemoryChannel,
    ) -> None:
        self.store, self.clock, self.scheduler = store, clock, scheduler
        self.portal, self.fake, self.channel = portal, fake, channel
        self.tools = ToolRegistry()
        self._layers: list[ProviderLayer] = []
        self._refs: list[pykka.ActorRef[Any]] = []

    def start(
        self,
        *,
        is_degraded: Callable[[str], bool] | None = None,
        dead_letters: pykka.ActorRef[Any] | None = None,
        agent: dict[str, Any] | None = None,
        **settings: Any,
    ) -> pykka.ActorRef[Any]:
        layer = ProviderLayer(
            config(self.fake.base_url, **(agent or {})), self.store, clock=SystemClock()
        )
        self._layers.append(layer)
        ref = AgentActor.start(
            SESSION,
            self.store,
            self.clock,
            self.scheduler,
            self.portal,
            layer.caller(),
            self.tools,
            self.channel,
            conversation="c1",
            thread="t1",
            settings=AgentLoopSettings(**settings),
            is_degraded=is_degraded,
            dead_letters=dead_letters,
        )
        self._refs.append(ref)
        return ref

    def close(self) -> None:
        for ref in self._refs:
            ref.stop(timeout=GUARD)
        for layer in self._layers:
            self.portal.submit(layer.aclose).result(GUARD)

    # -- waiting ----------------------------------------------------------------------------

    def replies(self, count: int) -> list[OutboundMessage]:
        """The channel's messages once ``count`` were delivered (waited for on the portal)."""

        async def wait() -> list[OutboundMessage]:
            with anyio.fail_after(GUARD):
                return await self.channel.wait_for(count)

        return self.portal.submit(wait).result(GUARD + 1)

    def log(
        self, until: Callable[[list[RecordedEvent]], bool], stream: str = STREAM
    ) -> list[RecordedEvent]:
        """The stream once ``until`` holds (woken by appends: ``store.wait_for``)."""
        give_up = time.monotonic() + GUARD
        while True:
            head = self.store.head()
            records = list(self.store.read_stream(stream))
            if until(records):
                return records
            left = give_up - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the log never got there: {[r.type for r in records]}")
            self.store.wait_for(head + 1, left)

    def settled(self, answers: int) -> list[RecordedEvent]:
        """The stream once ``answers`` announcements have a delivery outcome."""
        ended = (AnnouncementDelivered, AnnouncementSendFailed)
        return self.log(lambda rs: sum(isinstance(r.event, ended) for r in rs) >= answers)

    def requests(self, count: int) -> list[RecordedRequest]:
        return self.fake.wait_for(lambda rs: len(rs) >= count, GUARD)


@pytest.fixture
def harness(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    fake: FakeProvider,
    channel: MemoryChannel,
) -> Iterator[Harness]:
    made = Harness(store, clock, scheduler, portal, fake, channel)
    try:
        yield made
    finally:
        made.close()


def status(ref: pykka.ActorRef[Any]) -> AgentReport:
    report = ref.ask(AgentStatus(), timeout=GUARD)
    assert isinstance(report, AgentReport)
    return report


def of(records: list[RecordedEvent], kind: type[E]) -> list[E]:
    return [r.event for r in records if isinstance(r.event, kind)]


def types(records: list[RecordedEvent]) -> list[str]:
    return [r.type for r in records if r.type != "prompt:activity"]


def chat(request: RecordedRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = request.body["messages"]
    return messages


# -- the loop -------------------------------------------------------------------------------


def test_a_plain_answer_is_recorded_in_order_and_replied_once(harness: Harness) -> None:
    harness.fake.add(Answer(text="Hello there"))
    agent = harness.start()
    agent.tell(UserMessage("hi", message_id="m1"))
    [reply] = harness.replies(1)
    records = harness.settled(1)
    assert types(records) == [
        "session:created",
        "turn:started",
        "message:appended",
        "prompt:started",
        "prompt:completed",
        "message:appended",
        "turn:completed",
        "announcement:queued",
        "announcement:delivered",
    ]
    user, assistant = of(records, MessageAppended)
    [started] = of(records, TurnStarted)
    assert (user.message_id, user.role, user.content, user.turn_id) == (
        "m1",
        "user",
        "hi",
        started.turn_id,
    )
    assert (assistant.role, assistant.content) == ("assistant", "Hello there")
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.reason, completed.steps) == ("answered", None, 1)
    [queued] = of(records, AnnouncementQueued)
    [delivered] = of(records, AnnouncementDelivered)
    assert (queued.kind, delivered.announcement_id) == ("completion", queued.announcement_id)
    assert (reply.text, reply.kind, reply.conversation, reply.thread) == (
        "Hello there",
        "reply",
        "c1",
        "t1",
    )
    assert reply.idempotency_key == queued.announcement_id
    assert harness.channel.messages == [reply]
    assert [m["content"] for m in chat(harness.fake.requests[0])] == ["hi"]
    report = status(agent)
    assert report.idle
    assert (report.session.status, report.session.last_turn_outcome) == ("idle", "answered")


def test_tool_calls_run_concurrently_within_the_limit_and_go_back_to_the_model(
    harness: Harness,
) -> None:
    gauge = {"active": 0, "peak": 0}
    together: list[anyio.Event] = []

    async def probe(n: int) -> str:
        """Returns only once two probes ran at the same time."""
        if not together:
            together.append(anyio.Event())
        gauge["active"] += 1
        gauge["peak"] = max(gauge["peak"], gauge["active"])
        if gauge["active"] >= 2:
            together[0].set()
        try:
            await together[0].wait()
        finally:
            gauge["active"] -= 1
        return f"probe {n} done"

    harness.tools.register(probe, timeout_ms=5_000)
    calls = tuple(FakeToolCall(id=f"c{n}", name="probe", arguments={"n": n}) for n in (1, 2, 3))
    harness.fake.add(Answer(text="", tool_calls=calls), Answer(text="all done"))
    agent = harness.start(tool_limit=2)
    agent.tell(UserMessage("probe three times"))
    [reply] = harness.replies(1)
    assert reply.text == "all done"
    assert gauge["peak"] == 2  # two at once (or the probes would time out), never three
    records = harness.settled(1)
    tool_events = [t for t in types(records) if t.startswith("tool:")]
    assert tool_events == ["tool:started"] * 3 + ["tool:completed"] * 3
    results = [m for m in of(records, MessageAppended) if m.role == "tool"]
    assert [(m.tool_call_id, m.name, m.content) for m in results] == [
        ("c1", "probe", "probe 1 done"),
        ("c2", "probe", "probe 2 done"),
        ("c3", "probe", "probe 3 done"),
    ]
    first, second = harness.requests(2)
    assert [t["function"]["name"] for t in first.body["tools"]] == ["probe"]
    assert [(m["role"], m.get("tool_call_id")) for m in chat(second)] == [
        ("user", None),
        ("assistant", None),
        ("tool", "c1"),
        ("tool", "c2"),
        ("tool", "c3"),
    ]
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.steps) == ("answered", 2)


def test_a_call_failing_three_times_is_blocked_and_the_model_reads_why(
    harness: Harness,
) -> None:
    def flaky(x: int) -> str:
        """Always loses its connection."""
        raise ConnectionError("secret-host:5432 refused")

    harness.tools.register(flaky, timeout_ms=5_000)
    call = FakeToolCall(id="f1", name="flaky", arguments={"x": 1})
    harness.fake.add(Answer(text="", tool_calls=(call,), times=4), Answer(text="gave up"))
    agent = harness.start()
    agent.tell(UserMessage("try it"))
    [reply] = harness.replies(1)
    assert reply.text == "gave up"
    records = harness.settled(1)
    tool_events = [t for t in types(records) if t.startswith("tool:")]
    assert tool_events == ["tool:started", "tool:failed"] * 3 + ["tool:blocked"]
    [blocked] = of(records, ToolBlocked)
    assert (blocked.rule, blocked.failures, blocked.threshold) == ("same_call", 3, 3)
    requests = harness.requests(5)
    assert len(requests) == 5
    *_, asked, last = chat(requests[4])
    # the model repeated the id "f1": each repeat got a fresh one, so results pair up
    [renamed] = asked["tool_calls"]
    assert renamed["id"].startswith("call_")
    assert (last["role"], last["tool_call_id"]) == ("tool", renamed["id"])
    ids = [c["id"] for m in chat(requests[4]) for c in m.get("tool_calls") or ()]
    assert ids[0] == "f1"
    assert len(set(ids)) == 4
    assert last["content"] == blocked_text(blocked)
    assert "secret-host" not in msgspec.json.encode([r.body for r in requests]).decode()


def test_max_steps_ends_the_turn_with_the_static_text(harness: Harness) -> None:
    def noop() -> str:
        """Does nothing."""
        return "nothing"

    harness.tools.register(noop)
    harness.fake.set_default(Answer(text="", tool_calls=(FakeToolCall(id="n", name="noop"),)))
    agent = harness.start(max_steps=2)
    agent.tell(UserMessage("loop forever"))
    [reply] = harness.replies(1)
    assert (reply.text, reply.kind) == (MAX_STEPS_TEXT, "failure_notice")
    records = harness.settled(1)
    assert len(harness.fake.requests) == 2
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.reason, completed.steps) == ("failed", "max_steps", 2)
    # the last step's tool ran and is answered: the history stays valid for the next turn
    assert [m.role for m in of(records, MessageAppended)][-1] == "tool"
    assert status(agent).idle


# -- the execution timeout -------------------------------------------------------------------


def test_the_pure_decision_fires_exactly_at_the_limit() -> None:
    start = 1_800_000_000.0
    assert decide_execution_timeout("t", start, start + 599.999, 600_000) is None
    aborted = decide_execution_timeout("t", start, start + 600.0, 600_000)
    assert aborted == ExecutionAborted(
        reason="pipeline_timeout", turn_id="t", limit_ms=600_000, elapsed_ms=600_000
    )


def test_execution_timeout_cancels_the_hung_call_and_replies_once(harness: Harness) -> None:
    harness.fake.add(Hang())
    agent = harness.start()
    agent.tell(UserMessage("hang please"))
    harness.requests(1)
    [record] = [r for r in harness.store.read_stream(STREAM) if r.type == "turn:started"]
    started = record.event
    assert isinstance(started, TurnStarted)
    deadline = record.ts + 600.0  # the fake clock has not moved: exactly representable
    assert harness.scheduler.next_deadline() == deadline

    harness.clock.set(deadline - 0.001)  # 1 ms before the limit: nothing
    report = status(agent)  # a barrier: anything told meanwhile was handled
    assert (report.session.current_turn, report.waiting_for) == (started.turn_id, "model")
    assert not of(list(harness.store.read_stream(STREAM)), ExecutionAborted)
    assert harness.channel.attempted == []

    harness.clock.set(deadline)  # exactly at the limit
    [notice] = harness.replies(1)
    assert (notice.text, notice.kind) == (TIMEOUT_TEXT, "failure_notice")
    assert harness.fake.wait_finished(0, GUARD).outcome == "client_closed"
    records = harness.settled(1)
    [aborted] = of(records, ExecutionAborted)
    assert (aborted.reason, aborted.turn_id) == ("pipeline_timeout", started.turn_id)
    assert (aborted.limit_ms, aborted.elapsed_ms) == (600_000, 600_000)
    tail = [t for t in types(records) if not t.startswith("prompt:")][-4:]
    assert tail == [
        "execution:aborted",
        "turn:completed",
        "announcement:queued",
        "announcement:delivered",
    ]
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.reason) == ("aborted", "pipeline_timeout")

    # an answer that comes after the abort is no reply: dropped, recorded nowhere
    late = ProviderResponse(provider="main", model="m1", text="late answer")
    agent.tell(ModelDone(turn_id=started.turn_id, step=1, response=late))
    assert status(agent).idle
    assert harness.channel.attempted == [notice]
    roles = [m.role for m in of(list(harness.store.read_stream(STREAM)), MessageAppended)]
    assert roles == ["user"]
    assert len(harness.fake.requests) == 1  # and no model call started after it

    # the session goes on: the next message is answered normally
    agent.tell(UserMessage("again"))
    assert harness.replies(2)[1].text == "default answer"


# -- failures and degradation ------------------------------------------------------------------


def test_every_model_failing_ends_with_the_static_failure_text(harness: Harness) -> None:
    harness.fake.set_default(Fail(status=500, body='{"error": "internal: key sk-123"}'))
    agent = harness.start(agent={"fallback_models": ["backup:m2"]})
    agent.tell(UserMessage("anyone?"))
    [notice] = harness.replies(1)
    assert (notice.text, notice.kind) == (FAILED_TEXT, "failure_notice")
    records = harness.settled(1)
    assert [r.model for r in harness.fake.requests] == ["m1", "m2"]
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.reason) == ("failed", "all_models_failed")
    assert "sk-123" not in msgspec.json.encode([r.event for r in records]).decode()


def test_a_context_overflow_ends_with_its_own_static_text(harness: Harness) -> None:
    harness.fake.add(Fail(status=400, error_type="context_length_exceeded"))
    agent = harness.start()
    agent.tell(UserMessage("a very long story"))
    [notice] = harness.replies(1)
    assert notice.text == OVERFLOW_TEXT
    [completed] = of(harness.settled(1), TurnCompleted)
    assert (completed.outcome, completed.reason) == ("failed", "context_overflow")


def test_a_degraded_provider_gets_one_static_message_at_once_and_no_call(
    harness: Harness,
) -> None:
    degraded = threading.Event()
    degraded.set()
    agent = harness.start(is_degraded=lambda provider: provider == "main" and degraded.is_set())
    began = time.monotonic()
    agent.tell(UserMessage("are you there?", message_id="u1"))
    [notice] = harness.replies(1)
    assert time.monotonic() - began < 1.0
    assert (notice.text, notice.kind) == (DEGRADED_TEXT, "static_reply")
    records = harness.settled(1)
    assert harness.fake.requests == []
    [user] = of(records, MessageAppended)
    assert (user.message_id, user.content) == ("u1", "are you there?")
    [completed] = of(records, TurnCompleted)
    assert (completed.outcome, completed.reason, completed.steps) == (
        "deferred",
        "provider_degraded",
        0,
    )
    [delivered] = of(records, AnnouncementDelivered)
    assert delivered.path == "direct"
    assert harness.channel.messages == [notice]

    degraded.clear()  # recovered: the next message reaches the model with the saved one
    agent.tell(UserMessage("now?"))
    assert harness.replies(2)[1].text == "default answer"
    [request] = harness.requests(1)
    assert [m["content"] for m in chat(request)] == ["are you there?", "now?"]


# -- queueing, restarts, failed sends ----------------------------------------------------------


def test_messages_during_a_turn_run_next_in_order(harness: Harness) -> None:
    entered, release = threading.Event(), threading.Event()

    def gate() -> str:
        """Waits until the test opens it."""
        entered.set()
        release.wait(GUARD)
        return "opened"

    harness.tools.register(gate, timeout_ms=int(GUARD * 1000))
    harness.fake.add(
        Answer(text="", tool_calls=(FakeToolCall(id="g", name="gate"),)),
        Answer(text="answer one"),
        Answer(text="answer two"),
        Answer(text="answer three"),
    )
    agent = harness.start()
    agent.tell(UserMessage("one"))
    assert entered.wait(GUARD)
    agent.tell(UserMessage("two"))
    agent.tell(UserMessage("three"))
    assert status(agent).queued == 2
    release.set()
    assert [m.text for m in harness.replies(3)] == ["answer one", "answer two", "answer three"]
    records = harness.settled(3)
    users = [m for m in of(records, MessageAppended) if m.role == "user"]
    assert [m.content for m in users] == ["one", "two", "three"]
    turns = [e.turn_id for e in of(records, TurnStarted)]
    assert [m.turn_id for m in users] == turns
    assert len(set(turns)) == 3
    # each queued message is recorded when its turn starts, after the previous turn ended
    flow = [(r.type, getattr(r.event, "role", None)) for r in records]
    assert flow.index(("message:appended", "user"), 3) > flow.index(("turn:completed", None))
    assert [m["content"] for m in chat(harness.requests(4)[3])][-1] == "three"
    assert [c.outcome for c in of(records, TurnCompleted)] == ["answered"] * 3


def test_a_restart_closes_the_turn_a_crash_left_running_and_says_so(harness: Harness) -> None:
    harness.fake.add(Hang())
    first = harness.start()
    first.tell(UserMessage("hang, then crash"))
    harness.requests(1)
    turn_id = status(first).session.current_turn
    assert turn_id is not None
    first.stop(timeout=GUARD)  # like a crash, it leaves the turn running in the log
    assert harness.fake.wait_finished(0, GUARD).outcome == "client_closed"
    assert of(list(harness.store.read_stream(STREAM)), TurnCompleted) == []

    second = harness.start()
    report = status(second)
    assert (report.session.current_turn, report.session.last_turn_outcome) == (
        None,
        "interrupted",
    )
    [completed] = of(list(harness.store.read_stream(STREAM)), TurnCompleted)
    assert completed == TurnCompleted(turn_id=turn_id, outcome="interrupted", reason="restart")
    [notice] = harness.replies(1)  # nothing retries an in-memory turn: the user is told
    assert (notice.text, notice.kind) == (ABANDONED_TEXT, "failure_notice")
    [queued] = of(list(harness.store.read_stream(STREAM)), AnnouncementQueued)
    assert queued.announcement_id == notice.idempotency_key

    second.tell(UserMessage("hello again"))
    assert harness.replies(2)[1].text == "default answer"
    assert [m["content"] for m in chat(harness.requests(2)[1])] == [
        "hang, then crash",
        "hello again",
    ]


def test_a_failed_send_is_recorded_and_dead_lettered(harness: Harness) -> None:
    dead_letters = DeadLetterActor.start(
        store=harness.store,
        clock=harness.clock,
        scheduler=harness.scheduler,
        portal=harness.portal,
        channels={harness.channel.name: harness.channel},
    )
    try:
        harness.channel.fail_next(kind="server_error")
        agent = harness.start(dead_letters=dead_letters)
        agent.tell(UserMessage("hi"))
        records = harness.settled(1)
        [failed] = of(records, AnnouncementSendFailed)
        [queued] = of(records, AnnouncementQueued)
        assert (failed.announcement_id, failed.error_class) == (
            queued.announcement_id,
            "server_error",
        )
        letters = harness.log(
            lambda rs: any(isinstance(r.event, AnnouncementDeadLettered) for r in rs),
            stream="deadletter",
        )
        [letter] = of(letters, AnnouncementDeadLettered)
        assert (letter.announcement_id, letter.conversation, letter.text) == (
            queued.announcement_id,
            "c1",
            "default answer",
        )
        dead_letters.ask(QueueState(), timeout=GUARD)  # a barrier: its retry timer is armed
        harness.clock.advance(60)  # the dead-letter retry is due
        [retried] = harness.replies(1)
        assert (retried.text, retried.idempotency_key) == ("default answer", queued.announcement_id)
    finally:
        dead_letters.stop(timeout=GUARD)


# -- the request ---------------------------------------------------------------------------------


def test_a_tool_call_left_without_a_result_is_answered_in_the_next_request() -> None:
    calls = (ToolCall(id="a", name="t"), ToolCall(id="b", name="t"))
    messages = (
        Message(role="user", content="q"),
        Message(role="assistant", tool_calls=calls),
        Message(role="tool", content="ok", tool_call_id="a"),
        Message(role="user", content="next"),
    )
    out = request_messages(messages, "be brief")
    assert [(m.role, m.tool_call_id, m.content) for m in out] == [
        ("system", None, "be brief"),
        ("user", None, "q"),
        ("assistant", None, ""),
        ("tool", "a", "ok"),
        ("tool", "b", UNANSWERED_TOOL_TEXT),
        ("user", None, "next"),
    ]
    assert request_messages(messages[:2]) == (
        *messages[:2],
        Message(role="tool", content=UNANSWERED_TOOL_TEXT, tool_call_id="a"),
        Message(role="tool", content=UNANSWERED_TOOL_TEXT, tool_call_id="b"),
    )
