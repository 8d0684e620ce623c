"""Review: Agents and the ContextStore started from snapshots (``agent_view@v2``), the
lazy search index, the resend's channel check and the PostgreSQL schema-name checks.

Real parts: LMDB stores in ``tmp_path`` (some opened with ``snapshot_every=1``, so every
fold saves a snapshot and every later start restores one), the PostgreSQL cluster of
the ``pg_url`` fixture, the fake provider on loopback, MemoryChannels, a FakeClock for
every deadline, and the command line in a real subprocess. Tests marked ``# Was:``
failed on the reviewed code (both fixed: the resend's channel check is
``yours_to_say``, shared with ``left_unsaid``; the schema check catches a name that is
not UTF-8); the others pin behaviour that holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    AGENT_VIEW,
    AgentView,
    Assemble,
    ContextStoreActor,
    SearchContext,
    SendsPending,
    ask_context,
    left_unsaid,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import ContextMessage, ExtractiveSummarizer, ModelProfile
from stalwart.errors import StoreError
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    ContextAssembled,
    MessageAppended,
    PromptStarted,
    RecordedEvent,
    SessionCreated,
    SessionRequiresAction,
    ToolCompleted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent, Snapshot, load_state, snapshot_name
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import (
    delivered,
    has,
    in_flight_s,
    log_until,
    of,
    runtime_config,
    until,
)

#: the longest a wait on other threads may take before the test fails (real seconds)
GUARD = 30.0
ASK = 10.0


def _until(check: Callable[[], Any], what: str, timeout: float = GUARD) -> Any:
    return until(check, timeout, what=what)


def _sweep_ended() -> bool:
    return not any(t.name == "stalwart-resend" for t in threading.enumerate())


def _through_a_snapshot(view: AgentView) -> AgentView:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(view), type=AgentView)


def _every_cut_folds_alike(records: list[RecordedEvent]) -> None:
    """For every cut of a real stream: the snapshot of the prefix, then the rest, is the
    fold of the whole stream (what an Agent started at that point would hold)."""
    whole = AGENT_VIEW.folder(AGENT_VIEW.initial(records[0].stream))
    for record in records:
        whole.add(record)
    for cut in range(len(records) + 1):
        head = AGENT_VIEW.folder(AGENT_VIEW.initial(records[0].stream))
        for record in records[:cut]:
            head.add(record)
        resumed = AGENT_VIEW.folder(_through_a_snapshot(head.state()))
        for record in records[cut:]:
            resumed.add(record)
        assert resumed.state() == whole.state(), f"differs when cut at {cut}"
        assert resumed.messages == whole.messages
        assert resumed.ledger.unanswered() == whole.ledger.unanswered()
        assert resumed.calls.state() == whole.calls.state()


@pytest.fixture(params=["lmdb", "postgres"])
def snapshotting(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[Callable[[], EventStore]]:
    """Opens the same store again and again, each saving a snapshot at every fold."""
    if request.param == "lmdb":
        location = str(tmp_path / "snap")
    else:
        location = request.getfixturevalue("pg_url")
    opened: list[EventStore] = []

    def open_it() -> EventStore:
        log = store_module.open(location, clock=clock, snapshot_every=1)
        opened.append(log)
        return log

    yield open_it
    for log in opened:
        log.close()


# -- the resend's channel check --------------------------------------------------------------


# Was: a reply cut short in a log that recorded the channel's own name was never resent
def test_a_reply_cut_short_in_a_log_that_named_the_channel_is_resent_after_restart(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """A log written before sessions recorded the channel's key names the channel's own
    ``name`` ("slack") in ``session:created`` and ``announcement:queued``; the runtime
    still finds that channel (``channel_named``) and runs the session on its key
    ("chat"). A reply whose send a crash cut short reached the user on the next start
    before this change. Now ``left_unsaid`` says there is news (it compares with the
    recorded "slack") and starts the Agent, whose ``_send_again`` then skips the reply
    ("slack" is not its ``_channel_name`` "chat"): the user never hears the answer."""
    now = clock.now()
    events = [
        SessionCreated(agent="default", channel="slack"),
        TurnStarted(turn_id="t1"),
        MessageAppended(message_id="m1", role="user", content="refund order 7", turn_id="t1"),
        MessageAppended(message_id="m2", role="assistant", content="Refunded.", turn_id="t1"),
        TurnCompleted(turn_id="t1", outcome="answered"),
        AnnouncementQueued(announcement_id="a1", channel="slack", text="Refunded."),
    ]  # the process died mid-send: no outcome
    store.append("session:s1", [NewEvent(event=e, ts=now) for e in events])
    config = runtime_config(fake.base_url)
    clock.advance(in_flight_s(config) + 1.0)  # no send of the dead process is under way
    assert left_unsaid(store, "session:s1", clock.now())  # the sweep starts its Agent
    slack = MemoryChannel("slack")
    with Runtime(config, store=store, clock=clock, channels={"chat": slack}) as rt:
        _until(_sweep_ended, "the start-up resend sweep ended")
        handle = rt.session("s1", channel="chat")  # the Agent the sweep started
        assert handle.channel == "chat"
        _until(lambda: handle.ref.ask(SendsPending(), timeout=5) == 0, "sends ended")
        texts = [m.text for m in slack.messages]
        records = list(store.read_stream("session:s1"))
    assert (texts, len(of(AnnouncementResent, records))) == (["Refunded."], 1)


# -- the PostgreSQL schema name ---------------------------------------------------------------


# Was: a schema name that cannot be encoded (a lone surrogate) was an internal error
def test_a_schema_name_with_a_lone_surrogate_is_refused_in_words(tmp_path: Path) -> None:
    """``_check_schema`` promises a StoreError saying why for every name the server would
    refuse, before connecting. A name holding bytes that are not UTF-8 reaches Python as a
    lone surrogate (argv and the environment are decoded with ``surrogateescape``), and
    ``schema.encode()`` raises a raw ``UnicodeEncodeError``: the CLI says "internal error
    ... a bug"."""
    url = "postgresql://u@127.0.0.1:1/db?schema=\udcff"
    with pytest.raises(StoreError):
        store_module.open(url)
    argv = [os.fsencode(sys.executable), b"-m", b"stalwart", b"--store"]
    argv += [b"postgresql://u@127.0.0.1:1/db?schema=\xff", b"status"]
    done = subprocess.run(argv, capture_output=True, timeout=GUARD, check=False)
    assert b"internal error" not in done.stderr
    assert b"schema" in done.stderr


def test_the_schema_names_the_server_refuses_are_refused_before_connecting() -> None:
    """``pg_`` (case-sensitive, as the server checks) and NUL, in words; ``PG_x`` is a
    name the server takes (quoted), and is not refused here."""
    for schema, words in (("pg_x", "pg_"), ("a%00b", "NUL"), ("", "1 to 50")):
        with pytest.raises(StoreError, match=words):
            store_module.open(f"postgresql://u@127.0.0.1:1/db?schema={schema}")
    with pytest.raises(StoreError) as raised:  # not refused for its name: no server there
        store_module.open("postgresql://u@127.0.0.1:1/db?schema=PG_x&connect_timeout=1")
    assert "schema name" not in str(raised.value)


def test_a_pg_prefix_elsewhere_in_the_url_is_not_refused(pg_url: str, clock: FakeClock) -> None:
    """Only the schema name is checked: ``pg_`` in another query value is libpq's."""
    url = pg_url.replace("?schema=", "?application_name=pg_app&schema=")
    with store_module.open(url, clock=clock) as log:  # type: ignore[attr-defined]
        log.append("s", [NewEvent(event=SessionCreated(), ts=clock.now())])
        assert log.stream_version("s") == 1


# -- an Agent started from its snapshot ----------------------------------------------------


def test_a_session_paused_for_approval_resumes_from_its_snapshot_after_a_restart(
    snapshotting: Callable[[], EventStore], clock: FakeClock, fake: FakeProvider
) -> None:
    """A durable session asks for approval and its runtime closes; every fold saved a
    snapshot, so the next runtime's Agent starts from the snapshot taken mid-pause. The
    approval runs the stored call exactly once, the next request carries the whole
    conversation, the answer reaches the user, and at every cut of the real stream the
    snapshot then the rest folds to what the whole stream does."""
    config = runtime_config(fake.base_url)
    call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refunded order 7."))
    ran: list[int] = []

    def refund(order: int) -> str:
        """Refund an order."""
        ran.append(order)
        return f"refunded {order}"

    log = snapshotting()
    chat = MemoryChannel("chat")
    with Runtime(config, store=log, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(refund, needs_confirmation=True)
        rt.session("s1", channel="chat").send("refund order 7")
        records = log_until(log, "session:s1", has(ActivationBlocked))
        [request] = of(SessionRequiresAction, records)
    log.close()
    log = snapshotting()
    paused_at = log.stream_version("session:s1")
    load_state(log, "session:s1", AGENT_VIEW)  # as the sweep or a recall would: saves one
    _until(
        lambda: (
            next(iter(log.snapshots("session:s1", snapshot_name(AGENT_VIEW)))).version == paused_at
        ),
        "the snapshot of the paused session is stored",
    )
    chat = MemoryChannel("chat")
    with Runtime(config, store=log, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(refund, needs_confirmation=True)
        rt.confirm("s1", request.request_id, allow=True)
        [reply] = delivered(rt, chat, 1)
        records = log_until(log, "session:s1", has(ActivationAcked, 1))
        records = log_until(log, "session:s1", has(AnnouncementDelivered, 2))
    assert reply.text == "Refunded order 7."
    assert ran == [7]
    assert len(of(ToolCompleted, records)) == 1
    last = fake.requests[-1].body["messages"]
    said = [(m["role"], m.get("content") or "") for m in last if m["role"] != "system"]
    assert said[0] == ("user", "refund order 7")
    assert [role for role, _ in said] == ["user", "assistant", "tool"]
    assert "refunded 7" in said[-1][1]
    _every_cut_folds_alike(records)
    restored = load_state(log, "session:s1", AGENT_VIEW)
    full = load_state(log, "session:s1", AGENT_VIEW, use_snapshots=False, snapshot_every=0)
    assert restored == full


def test_an_undecodable_v2_snapshot_and_a_v1_snapshot_are_passed_over(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """A store a previous version wrote holds ``agent_view@v1`` snapshots (no ledger, chat
    messages without ids); one may also hold a damaged ``agent_view@v2`` (it decodes as
    msgpack, not as an AgentView). The next Agent passes over both and folds the stream:
    the conversation goes on with its whole history."""
    config = runtime_config(fake.base_url)
    fake.add(Answer(text="first answer"), Answer(text="second answer"))
    chat = MemoryChannel("chat")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("remember ZEBRA")
        delivered(rt, chat, 1)
        log_until(store, "session:s1", has(AnnouncementDelivered))
    head = list(store.read_stream("session:s1"))[-1]
    old_view = {"session": {"stream": "session:s1", "version": head.version}, "messages": []}
    for name, data in (  # the damaged v2 first: saving it would prune an older version
        (snapshot_name(AGENT_VIEW), msgspec.msgpack.encode({"session": 1, "ledger": "x"})),
        ("agent_view@v1", msgspec.msgpack.encode(old_view)),
    ):
        snapshot = Snapshot(
            stream="session:s1",
            name=name,
            version=head.version,
            position=head.position,
            data=data,
        )
        store.put_snapshot(snapshot)
    _until(
        lambda: (
            any(True for _ in store.snapshots("session:s1", snapshot_name(AGENT_VIEW)))
            and any(True for _ in store.snapshots("session:s1", "agent_view@v1"))
        ),
        "both snapshots are stored",
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("what did I ask you to remember?")
        texts = [m.text for m in delivered(rt, chat, 2)]
    assert texts == ["first answer", "second answer"]
    last = fake.requests[-1].body["messages"]
    contents = [m.get("content") for m in last if m["role"] != "system"]
    assert contents == ["remember ZEBRA", "first answer", "what did I ask you to remember?"]


# -- the ContextStore: rebuilt from snapshots, the index built late ----------------------


def _history(turns: int) -> tuple[ContextMessage, ...]:
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be brief.")]
    for n in range(turns):
        code = f" Remember code ZEBRA{n:03d} for invoice {n * 7}." if n % 5 == 2 else ""
        out += [
            ContextMessage(
                message_id=f"u{n}", seq=len(out), role="user",
                content=f"Turn {n}.{code} " + "w " * 150,
            ),
            ContextMessage(
                message_id=f"b{n}", seq=len(out) + 1, role="assistant",
                content=f"Reply {n} about invoice {n * 7}. " + "r " * 150,
            ),
        ]  # fmt: skip
    return tuple(out)


def _session_stream(log: EventStore, messages: tuple[ContextMessage, ...]) -> None:
    log.append(
        "session:s1",
        [SessionCreated()]
        + [
            MessageAppended(message_id=m.message_id, role=m.role, content=m.content)
            for m in messages
        ],
    )


QUERIES = ("ZEBRA002", "invoice 49", "reply turn", "zebra012 invoice", "w r", "Turn 3")


def _searches(ref: Any) -> list[list[tuple[str, str | None, float]]]:
    out = []
    for query in QUERIES:
        hits = ask_context(ref, SearchContext(session_id="s1", tenant=None, query=query), ASK)
        out.append([(h.id, h.summary_id, round(h.score, 9)) for h in hits])
    return out


def test_recall_on_a_rebuilt_session_ranks_as_the_session_searched_all_along(
    tmp_path: Path, clock: FakeClock
) -> None:
    """One ContextStore searches a session early (its index is built then and grows with
    every message and summary); another, started later on the same log (each fold from
    its snapshot: the session's messages from the Agent's fold), builds the index at its
    first search, messages first and summaries after. The hits and scores are the same."""
    settings = ContextEngineSettings(fresh_tail_turns=2)
    messages = _history(30)
    with store_module.open(tmp_path / "ctx", clock=clock, snapshot_every=1) as log:  # type: ignore[attr-defined]
        _session_stream(log, messages)
        live = ContextStoreActor.start(
            store=log, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
        )
        try:
            early = messages[:9]
            ask_context(live, Assemble(session_id="s1", messages=early, budget=50_000), ASK)
            ask_context(live, SearchContext(session_id="s1", tenant=None, query="ZEBRA002"), ASK)
            for end in (21, 41, len(messages)):
                assemble = Assemble(session_id="s1", messages=messages[:end], budget=2_500)
                ask_context(live, assemble, ASK)
            searched_all_along = _searches(live)
        finally:
            live.stop()
        assert any(summary for hits in searched_all_along for _, summary, _ in hits)
        rebuilt = ContextStoreActor.start(
            store=log, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
        )
        try:
            assert _searches(rebuilt) == searched_all_along
        finally:
            rebuilt.stop()
        assert any(True for _ in log.snapshots("session:s1", snapshot_name(AGENT_VIEW)))


def test_a_pipeline_session_rebuilt_from_its_snapshot_appends_at_the_right_version(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Pipeline mode: a ContextStore started on a ``context:`` stream that holds records
    and a snapshot expects the version its fold read: its assembly is recorded, not
    refused as a conflict, and the next one too."""
    settings = ContextEngineSettings(version="pipeline")
    profile = ModelProfile(provider="openai")
    messages = _history(6)
    with store_module.open(tmp_path / "pipe", clock=clock, snapshot_every=1) as log:  # type: ignore[attr-defined]
        for turns in (3, 4):
            ref = ContextStoreActor.start(
                store=log, clock=clock, summarizer=ExtractiveSummarizer(), settings=settings
            )
            try:
                for end in (turns * 2 + 1, turns * 2 + 3):
                    assemble = Assemble(
                        session_id="s1", messages=messages[:end], budget=20_000, profile=profile
                    )
                    reply = ask_context(ref, assemble, ASK)
                    assert reply.engine == "pipeline"
            finally:
                ref.stop()
        records = list(log.read_stream("context:s1"))
        assert len(of(ContextAssembled, records)) == 4
        assert any(True for _ in log.snapshots("context:s1", "context_pipeline@v3"))


def test_left_unsaid_reads_the_snapshot_and_still_sees_a_reply_cut_short(
    tmp_path: Path, clock: FakeClock
) -> None:
    """``left_unsaid`` folds from the Agent's snapshot: a reply queued before the snapshot
    and never sent is still news after it; one whose outcome came after it is not."""
    with store_module.open(tmp_path / "unsaid", clock=clock, snapshot_every=1) as log:  # type: ignore[attr-defined]
        queued = AnnouncementQueued(announcement_id="a1", channel="chat", text="hi")
        log.append("session:s1", [SessionCreated(channel="chat"), queued])
        assert left_unsaid(log, "session:s1", clock.now())  # and a snapshot saved here
        _until(
            lambda: any(True for _ in log.snapshots("session:s1", snapshot_name(AGENT_VIEW))),
            "the snapshot is stored",
        )
        assert left_unsaid(log, "session:s1", clock.now())
        log.append("session:s1", [AnnouncementDelivered(announcement_id="a1")])
        assert not left_unsaid(log, "session:s1", clock.now())
        assert not left_unsaid(log, "session:s1", clock.now() + 7_200)  # and stale anyway


def test_a_session_cut_mid_turn_goes_on_from_a_snapshot_taken_with_its_prompt_open(
    snapshotting: Callable[[], EventStore], clock: FakeClock, fake: FakeProvider
) -> None:
    """A runtime closes while the session's model call hangs: the log holds a running
    turn with its prompt open. A snapshot taken there (the Agent's fold holds the open
    call and the leased activation) is what the next runtime's Agent starts from: the
    message is answered once, on a conversation that holds the user's message once."""
    config = runtime_config(fake.base_url)
    fake.add(Hang())
    log = snapshotting()
    chat = MemoryChannel("chat")
    with Runtime(config, store=log, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("slow question")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        log_until(log, "session:s1", has(PromptStarted))
    log.close()
    log = snapshotting()
    view = load_state(log, "session:s1", AGENT_VIEW)  # saved: the next start restores it
    assert view.session.current_turn is not None
    assert view.calls.open  # the hung call, never ended in the log
    version = view.session.version
    _until(
        lambda: (
            next(iter(log.snapshots("session:s1", snapshot_name(AGENT_VIEW)))).version == version
        ),
        "the mid-turn snapshot is stored",
    )
    chat = MemoryChannel("chat")
    with Runtime(config, store=log, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat")  # its wake was handed back: taken again
        [reply] = delivered(rt, chat, 1)
        records = log_until(log, "session:s1", has(ActivationAcked))
    assert reply.text == "default answer"
    users = [e.content for e in of(MessageAppended, records) if e.role == "user"]
    assert users == ["slow question"]
    last = fake.requests[-1].body["messages"]
    assert [m.get("content") for m in last if m["role"] == "user"] == ["slow question"]
    _every_cut_folds_alike(records)
