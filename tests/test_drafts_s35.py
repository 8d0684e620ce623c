"""Staged drafts and the Agent's small leaks: defects a review found, each test failing
on the code before its fix.

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the fake
clock, a MemoryChannel; the Agent that crashes mid-step dies of a real unhandled
exception and is restarted by its supervisor.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from stalwart.actors import (
    ABANDONED_TEXT,
    DENIED_TEXT,
    AgentActor,
    AgentStatus,
    IoPortal,
    Scheduler,
    drafts_note,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock, SystemClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationBlocked,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    AnnouncementQueued,
    DraftDiscarded,
    DraftStaged,
    Event,
    MessageAppended,
    SessionCreated,
    SessionRequiresAction,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
)
from stalwart.runtime import ProviderLayer, Runtime, load_session
from stalwart.state import DRAFTS, fold
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import ToolRegistry
from tests._runtime_support import GUARD, delivered, has, log_until, of, runtime_config

STREAM = "session:s1"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _committed(session_id: str, path: str, content: str, content_hash: str) -> None:
    """A committer that writes nowhere."""


def _tool_texts(store: EventStore) -> dict[str, str]:
    """What the model read for each tool call of the session, by call id."""
    messages = of(MessageAppended, list(store.read_stream(STREAM)))
    return {m.tool_call_id: m.content for m in messages if m.role == "tool"}


def _call(call_id: str, name: str, **arguments: Any) -> Answer:
    return Answer(text="", tool_calls=(FakeToolCall(id=call_id, name=name, arguments=arguments),))


# -- staged drafts ----------------------------------------------------------------------------


# Was: DEFECT: nothing could discard a draft: a session's open drafts only grew, and every request's note counted them  # noqa: E501
def test_a_draft_is_discarded_once_and_a_discard_of_an_unknown_or_committed_one_is_refused(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``draft:discarded`` was folded but nothing wrote it: a draft the model gave up on
    stayed open for the session's life, listed in every request's system prompt. Now
    ``draft_discard`` records it once (again: nothing more), and refuses a path that has
    no draft and one already committed."""
    write_a = FakeToolCall(id="w1", name="draft_write", arguments={"path": "a.md", "content": "A"})
    write_b = FakeToolCall(id="w2", name="draft_write", arguments={"path": "b.md", "content": "B"})
    fake.add(
        Answer(text="", tool_calls=(write_a, write_b)),
        _call("d1", "draft_discard", path="a.md"),
        _call("d2", "draft_discard", path="a.md"),
        _call("d3", "draft_discard", path="nowhere.md"),
        _call("c1", "draft_commit", path="b.md"),
        _call("d4", "draft_discard", path="b.md"),
        Answer(text="Done."),
    )
    config = runtime_config(fake.base_url)
    with Runtime(
        config, store=store, clock=clock, channels={"chat": chat}, committer=_committed
    ) as rt:
        rt.session("s1", channel="chat").send("draft two notes, then drop the first")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "Done."
    records = list(store.read_stream(STREAM))
    assert [e.path for e in of(DraftDiscarded, records)] == ["a.md"]
    texts = _tool_texts(store)
    assert texts["d1"] == "discarded revision 1 of a.md"
    assert texts["d2"] == "the draft at a.md is discarded already"
    assert "there is no draft at 'nowhere.md'" in texts["d3"]
    assert "the draft at 'b.md' is committed" in texts["d4"]
    failed = {e.call_id: e.error_class for e in of(ToolFailed, records)}
    assert set(failed) == {"d3", "d4"}
    drafts = fold(DRAFTS, STREAM, records)
    assert (drafts.drafts["a.md"].status, drafts.drafts["b.md"].status) == (
        "discarded",
        "committed",
    )
    before, after = (fake.requests[n].body["messages"][0]["content"] for n in (1, 2))
    assert "- a.md (revision 1" in before  # open: the note lists it
    assert "a.md" not in after  # discarded: no request lists it again


# Was: DEFECT: draft_list took no arguments: thousands of open drafts came back whole, with no way to page  # noqa: E501
def test_draft_list_pages_through_many_open_drafts_and_lists_a_few_as_before(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``draft_list`` answered every open draft at once (250 here; a long session may
    hold thousands, past any result limit, whose marker says to call again with
    arguments that narrow it: it had none). Now it shows at most 100, says where the
    next page starts, and takes an ``offset`` and a path ``prefix``; a list that fits is
    answered as before (the note's own lines)."""
    drafts = [
        NewEvent(
            event=DraftStaged(
                path=f"notes/draft-{n:04}.md",
                content="hello",
                content_hash=_sha("hello"),
                size=5,
                revision=1,
            ),
            ts=clock.now() - 300 + n,
        )
        for n in range(250)
    ]
    created = NewEvent(event=SessionCreated(agent="default", channel="chat"), ts=clock.now() - 301)
    store.append(STREAM, [created, *drafts])
    fake.add(
        _call("l1", "draft_list"),
        _call("l2", "draft_list", offset=100),
        _call("l3", "draft_list", offset=200),
        _call("l4", "draft_list", prefix="notes/draft-024"),
        _call("l5", "draft_list", offset=250),
        Answer(text="Listed."),
    )
    config = runtime_config(fake.base_url)
    with Runtime(
        config, store=store, clock=clock, channels={"chat": chat}, committer=_committed
    ) as rt:
        rt.session("s1", channel="chat").send("which drafts are open?")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "Listed."
    texts = _tool_texts(store)

    def listed(call_id: str) -> list[int]:
        return [n for n in range(250) if f"- notes/draft-{n:04}.md (" in texts[call_id]]

    assert listed("l1") == list(range(100))
    assert texts["l1"].endswith(
        "- (drafts 1 to 100 of 250 shown; call draft_list with offset=100 for the next)"
    )
    assert listed("l2") == list(range(100, 200))
    assert listed("l3") == list(range(200, 250))
    assert texts["l3"].endswith("- (drafts 201 to 250 of 250 shown)")
    open_drafts = fold(DRAFTS, STREAM, list(store.read_stream(STREAM))).open()
    few = [d for d in open_drafts if d.path.startswith("notes/draft-024")]
    assert texts["l4"] == drafts_note(few)  # all of them fit: the note's own lines
    assert texts["l5"] == "There are 250 open drafts: offset 250 is past the last."
    assert not of(ToolFailed, list(store.read_stream(STREAM)))


# Was: DEFECT: draft_list showed a path with a space or an accent as a safe label that draft_read could not find  # noqa: E501
def test_draft_list_shows_a_path_as_written_so_the_draft_can_be_read_back(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``draft_list`` answered with the system prompt's note, whose paths are reduced to
    safe labels: ``Meeting notes/résumé.md`` read ``Meeting_notes/r_sum_.md``, and
    ``draft_read`` of that (what a model that lost the path in a long session does)
    found no draft, nor could ``draft_commit`` write it. Now ``draft_list`` (a tool
    result) shows the path as written, and the system prompt's note says when a path is
    only a label."""
    path = "Meeting notes/résumé.md"
    staged = DraftStaged(
        path=path, content="agenda", content_hash=_sha("agenda"), size=6, revision=1
    )
    created = SessionCreated(agent="default", channel="chat")
    store.append(STREAM, [NewEvent(event=e, ts=clock.now()) for e in (created, staged)])
    fake.add(
        _call("l1", "draft_list"),
        _call("r1", "draft_read", path=path),
        Answer(text="Read."),
    )
    config = runtime_config(fake.base_url)
    with Runtime(
        config, store=store, clock=clock, channels={"chat": chat}, committer=_committed
    ) as rt:
        rt.session("s1", channel="chat").send("go on with the meeting notes")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "Read."
    texts = _tool_texts(store)
    assert f"- {path} (revision 1, 6 bytes" in texts["l1"]
    assert texts["r1"] == "agenda"
    system = fake.requests[0].body["messages"][0]["content"]
    assert "- Meeting_notes/r_sum_.md (a label: draft_list shows its path as written)" in system


# -- the Agent --------------------------------------------------------------------------------


class RacingStore:
    """Passes every call to the store it wraps; the first append that expects a version
    finds ``racer`` appended to its stream just before it (another runtime's Agent won
    the race). A test double of a concurrent writer, not of stalwart."""

    def __init__(self, inner: EventStore, racer: Event, ts: float) -> None:
        self._inner = inner
        self._racer: NewEvent | None = NewEvent(event=racer, ts=ts)

    def append(self, stream: str, events: Any, *args: Any, **kwargs: Any) -> Any:
        racer, expected = self._racer, kwargs.get("expected_version")
        if racer is not None and expected is not None:
            self._racer = None
            self._inner.append(stream, [racer])
        return self._inner.append(stream, events, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def layer(store: EventStore, fake: FakeProvider, portal: IoPortal) -> Iterator[ProviderLayer]:
    made = ProviderLayer(runtime_config(fake.base_url), store, clock=SystemClock())
    try:
        yield made
    finally:
        portal.submit(made.aclose).result(GUARD)


# Was: DEFECT: a failure notice whose append lost a race stayed in the Agent's own notices for ever
def test_a_notice_whose_append_loses_a_race_is_not_kept_by_the_agent(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    layer: ProviderLayer,
    chat: MemoryChannel,
) -> None:
    """An Agent that starts on a session whose wake was given up with nothing said tells
    the user, appending the notice on the version it folded. When another writer wins
    the stream first (here another runtime's Agent, saying it), the append fails and is
    looked at again later, but the lost notice's id stayed in ``_own_notices``: one id
    per lost race, for the Agent's whole life."""
    now = clock.now()
    script: list[Event] = [
        SessionCreated(agent="default", channel="chat"),
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="hi"),
        ActivationLeased(activation_id="a1", owner="w", epoch=1, expires_at=now + 30),
        ActivationAbandoned(activation_id="a1", attempts=1, error_class="internal", epoch=1),
    ]
    store.append(STREAM, [NewEvent(event=e, ts=now) for e in script])
    theirs = AnnouncementQueued(
        announcement_id="theirs", channel="chat", kind="failure_notice", text=ABANDONED_TEXT
    )
    racing = RacingStore(store, theirs, now)
    ref = AgentActor.start(
        "s1", racing, clock, scheduler, portal, layer.caller(), ToolRegistry(), chat
    )
    try:
        ref.ask(AgentStatus(), timeout=GUARD)  # started: it spoke up, and lost the race
        agent = ref._actor_weakref()  # type: ignore[attr-defined]
        assert agent._own_notices == set()
    finally:
        ref.stop(timeout=GUARD)
    queued = of(AnnouncementQueued, list(store.read_stream(STREAM)))
    assert [q.announcement_id for q in queued] == ["theirs"]  # said once, by the winner


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end of the test, so nothing is left waiting on it."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


# Was: DEFECT: a crash mid-step recorded a denied call's tool:failed (or a host's tool:completed) again on the next wake  # noqa: E501
@pytest.mark.parametrize("answer", ["deny", "output"])
def test_a_settled_calls_outcome_is_recorded_once_when_a_crash_cuts_its_step_short(
    answer: str,
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    released: threading.Event,
) -> None:
    """A step resumed after a pause records, in its first append, each call it will not
    run (a denied one's ``tool:failed``, a custom tool's ``tool:completed`` with the
    host's output) beside the ``tool:started`` of the ones it runs, and their results
    only when those end. An Agent that died in between left no result for any call, so
    the next wake resumed the step again and recorded each settled outcome a second
    time: the session counted two failures for one denial, and the log two answers for
    one host output. Now each is recorded with the step's results, once."""
    running = threading.Event()
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            return f"refunded {order}"

        rt.tools.register_custom(
            "ask_crm",
            description="Look a customer up in the CRM.",
            parameters={"type": "object", "properties": {"email": {"type": "string"}}},
        )

        @rt.tool
        async def lookup(order: int) -> str:
            """Look an order up."""
            running.set()
            await anyio.to_thread.run_sync(released.wait, GUARD)
            return f"order {order}: shipped"

        settled = (
            FakeToolCall(id="k1", name="refund", arguments={"order": 7})
            if answer == "deny"
            else FakeToolCall(id="k1", name="ask_crm", arguments={"email": "a@b.c"})
        )
        ran = FakeToolCall(id="k2", name="lookup", arguments={"order": 8})
        fake.add(Answer(text="", tool_calls=(settled, ran)), Answer(text="Done."))
        session = rt.session("s1", channel="chat")
        session.send("refund order 7, look order 8 up")
        [request] = of(SessionRequiresAction, log_until(store, STREAM, has(ActivationBlocked)))
        if answer == "deny":
            rt.confirm("s1", request.request_id, allow=False)
        else:
            rt.submit_tool_result("s1", request.request_id, "Ada, customer since 2019")
        log_until(store, STREAM, lambda rs: any(_started(r.event, "k2") for r in rs))
        assert running.wait(GUARD)  # real-time: the tool runs on the portal's loop
        session.ref.tell(object())  # the Agent dies of an exception before the results
        log_until(store, STREAM, has(ActivationRequeued))
        clock.advance(0.5)  # the supervisor's restart backoff
        clock.advance(1.5)  # the retry is due: the step is resumed by the next wake
        replies = delivered(rt, chat, 2 if answer == "deny" else 1)
        assert replies[-1].text == "Done."
        records = log_until(store, STREAM, has(MessageAppended, 5))
        view, _ = load_session(store, "s1")
    outcomes = [e for e in of((ToolCompleted, ToolFailed), records) if e.call_id == "k1"]
    texts = _tool_texts(store)
    if answer == "deny":
        assert [(type(e), e.error_class) for e in outcomes] == [(ToolFailed, "denied")]
        assert texts["k1"] == DENIED_TEXT
    else:
        assert [(type(e), e.output) for e in outcomes] == [
            (ToolCompleted, "Ada, customer since 2019")
        ]
    [cut] = [e for e in of(ToolFailed, records) if e.call_id == "k2"]
    assert cut.error_class == "unreconciled"  # started, never run again
    assert view.tool_failures == len(of(ToolFailed, records))


def _started(event: Event, call_id: str) -> bool:
    return isinstance(event, ToolStarted) and event.call_id == call_id
