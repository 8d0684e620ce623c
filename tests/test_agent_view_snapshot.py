"""The Agent's fold (``AGENT_VIEW``) restored from a snapshot is the fold of the whole stream.

An Agent starts from its newest ``agent_view`` snapshot and folds only what came after, so
everything it keeps (the session, the conversation, the tool breaker, the wake's ledger,
the open model calls) must survive the snapshot's encoding and go on folding as if it
had never stopped. Checked as fold algebra over generated streams of the events those
parts read, and on a real LMDB store that snapshots at every event.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart import store as store_module
from stalwart.actors import AGENT_VIEW, AgentView, AgentViewFolder
from stalwart.actors._agent_fold import message_of
from stalwart.clock import FakeClock
from stalwart.context import messages_from_records
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    ActivationReady,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    DraftStaged,
    Event,
    ExecutionAborted,
    MessageAppended,
    PromptCompleted,
    PromptStarted,
    RecordedEvent,
    SessionCreated,
    SessionRequiresAction,
    ToolCall,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)
from stalwart.state import ACTIVATIONS, CALLS, DRAFTS, SESSION
from stalwart.store import NewEvent, load_state, snapshot_name
from tests._log import recorded

STREAM = "session:s"
IDS = st.sampled_from(["a", "b", "c"])
TOOL_CALLS = st.lists(st.builds(ToolCall, id=IDS, name=st.sampled_from(["x", "y"])), max_size=2)

AGENT_EVENTS = st.one_of(
    st.builds(SessionCreated, agent=st.just("a"), channel=st.just("chat")),
    st.builds(
        MessageAppended,
        message_id=st.text("mn", min_size=1, max_size=3),
        role=st.sampled_from(["user", "assistant"]),
        content=st.text(max_size=10),
        tool_calls=TOOL_CALLS.map(tuple),
        name=st.none() | st.just("bot"),
    ),
    st.builds(
        MessageAppended,
        message_id=st.text("mn", min_size=1, max_size=3),
        role=st.just("tool"),
        tool_call_id=IDS,
    ),
    st.builds(TurnStarted, turn_id=st.sampled_from(["t1", "t2"])),
    st.builds(TurnCompleted, turn_id=st.sampled_from(["t1", "t2"])),
    st.builds(TurnCompleted, turn_id=st.just("t1"), reason=st.just("abandoned")),
    st.builds(ExecutionAborted, reason=st.just("pipeline_timeout")),
    st.builds(
        SessionRequiresAction,
        request_id=st.sampled_from(["r1", "r2"]),
        kind=st.sampled_from(["approval", "custom_tool"]),
        tool=st.just("x"),
        call_id=IDS,
    ),
    st.builds(UserToolConfirmation, request_id=st.sampled_from(["r1", "r2"]), allow=st.booleans()),
    st.builds(UserCustomToolResult, request_id=st.sampled_from(["r1", "r2"]), output=st.just("o")),
    st.builds(UserInterrupt),
    st.builds(ToolStarted, call_id=IDS, tool=st.just("x")),
    st.builds(ToolCompleted, call_id=IDS, tool=st.just("x")),
    st.builds(ToolFailed, call_id=IDS, tool=st.just("x"), error_class=st.just("E")),
    st.builds(
        AnnouncementQueued,
        announcement_id=st.sampled_from(["n1", "n2"]),
        channel=st.just("chat"),
        text=st.text(max_size=5),
    ),
    st.builds(AnnouncementDelivered, announcement_id=st.sampled_from(["n1", "n2"])),
    st.builds(
        AnnouncementSendFailed,
        announcement_id=st.sampled_from(["n1", "n2"]),
        error_class=st.just("E"),
    ),
    st.builds(AnnouncementResent, announcement_id=st.sampled_from(["n1", "n2"])),
    st.builds(
        ActivationReady,
        activation_id=st.sampled_from(["w1", "w2"]),
        kind=st.sampled_from(["message", "wake", "resume"]),
        message_id=st.none() | st.text("mn", min_size=1, max_size=3),
        text=st.just("hi"),
    ),
    st.builds(
        ActivationLeased,
        activation_id=st.sampled_from(["w1", "w2"]),
        owner=st.just("worker"),
        epoch=st.integers(1, 3),
        expires_at=st.floats(100, 200),
    ),
    st.builds(
        ActivationAbandoned,
        activation_id=st.sampled_from(["w1", "w2"]),
        attempts=st.just(3),
        error_class=st.just("E"),
    ),
    st.builds(
        PromptStarted,
        call_id=st.sampled_from(["p1", "p2"]),
        provider=st.just("p"),
        model=st.just("m"),
        attempt=st.integers(1, 3),
    ),
    st.builds(PromptCompleted, call_id=st.sampled_from(["p1", "p2"])),
    st.builds(
        DraftStaged,
        path=st.sampled_from(["a.md", "b.md"]),
        content=st.just("x"),
        content_hash=st.just("h"),
        size=st.just(1),
    ),
)


def records(events: list[Event]) -> list[RecordedEvent]:
    return [recorded(event, 100.0 + i, i, STREAM) for i, event in enumerate(events, start=1)]


def folded(recs: list[RecordedEvent], start: AgentView | None = None) -> AgentViewFolder:
    folder = AGENT_VIEW.folder(AGENT_VIEW.initial(STREAM) if start is None else start)
    for record in recs:
        folder.add(record)
    return folder


def through_a_snapshot(view: AgentView) -> AgentView:
    """What ``load_state`` gets back from a saved snapshot of ``view``."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(view), type=AgentView)


@settings(max_examples=300, deadline=None)
@given(st.lists(AGENT_EVENTS, max_size=40), st.integers(min_value=0, max_value=40))
def test_a_snapshot_then_the_rest_folds_to_what_the_whole_stream_does(
    events: list[Event], cut: int
) -> None:
    recs = records(events)
    cut = min(cut, len(recs))
    whole = folded(recs)
    resumed = folded(recs[cut:], through_a_snapshot(folded(recs[:cut]).state()))
    assert resumed.state() == whole.state()
    # what the Agent reads in place: the request's messages and the engine's messages
    appended = [r.event for r in recs if isinstance(r.event, MessageAppended)]
    assert resumed.messages == whole.messages == tuple(map(message_of, appended))
    peeked = folded(recs[:cut])
    early = peeked.messages  # asked before the rest: kept up to date from then on
    assert early == whole.messages[: len(early)]
    for record in recs[cut:]:
        peeked.add(record)
    assert peeked.messages == whole.messages
    assert resumed.context.messages == messages_from_records(recs)
    assert resumed.context.turn == whole.context.turn
    # the ledger's own answers
    assert resumed.ledger.unanswered() == whole.ledger.unanswered()
    assert resumed.ledger.call_ids == whole.ledger.call_ids
    assert resumed.version == whole.version == len(recs)


def test_an_agent_view_restored_from_a_real_store_equals_the_full_fold(tmp_path: Path) -> None:
    """On LMDB, with a snapshot saved at every event: each rebuild starts from the newest
    snapshot and equals the fold of the whole stream, and the snapshot is keyed by the
    fold's version 2 (a version 1 snapshot, which held no ledger, is never used)."""
    clock = FakeClock(start=1_000.0)
    call = ToolCall(id="c1", name="x")
    script: list[Event] = [
        SessionCreated(agent="a", channel="chat"),
        ActivationReady(activation_id="w1", kind="message", message_id="m1", text="hi"),
        ActivationLeased(activation_id="w1", owner="w", epoch=1, expires_at=2_000.0),
        TurnStarted(turn_id="t1"),
        MessageAppended(message_id="m1", role="user", content="hi"),
        PromptStarted(call_id="p1", provider="p", model="m"),
        PromptCompleted(call_id="p1"),
        MessageAppended(message_id="m2", role="assistant", tool_calls=(call,)),
        SessionRequiresAction(request_id="r1", kind="approval", tool="x", call_id="c1"),
        TurnCompleted(turn_id="t1", outcome="paused"),
        AnnouncementQueued(announcement_id="n1", channel="chat", text="may I?"),
        UserToolConfirmation(request_id="r1", allow=True),
        ToolStarted(call_id="c1", tool="x"),
    ]
    with store_module.open(tmp_path / "log", clock=clock) as log:  # type: ignore[attr-defined]
        for event in script:
            log.append(STREAM, [NewEvent(event=event, ts=clock.now())])
            clock.advance(1.0)
            restored = load_state(log, STREAM, AGENT_VIEW, snapshot_every=1)
            full = load_state(log, STREAM, AGENT_VIEW, use_snapshots=False, snapshot_every=0)
            assert restored == full
        newest = next(iter(log.snapshots(STREAM, snapshot_name(AGENT_VIEW))))
        assert newest.version == len(script)
        assert snapshot_name(AGENT_VIEW) == "agent_view@v5"
        view = load_state(log, STREAM, AGENT_VIEW)
    ledger = view.ledger
    assert ledger.resolutions["c1"].kind == "allow"  # the confirmation survives the snapshot
    assert ledger.started == {"c1"}  # a crash now: the call was cut short
    assert set(ledger.unsent) == {"n1"}  # the question was never sent: resent on start
    assert ledger.message_ids == {"m1", "m2"}
    assert [m.turn for m in view.messages] == [1, 1]
    assert view.calls.open == {}


def test_the_agent_view_version_moves_with_what_its_snapshot_embeds() -> None:
    """``agent_view@v5`` holds the states of other folds (the session, the activations,
    the drafts, the calls) without their versions, so a snapshot saved before one of
    them changed would be read as if it had not. When this fails: bump
    ``AgentViewAggregate.version`` (old snapshots are then passed over, and dropped at the
    next save), then update the figures here."""
    embedded = {agg.name: agg.version for agg in (SESSION, ACTIVATIONS, DRAFTS, CALLS)}
    schema = json.dumps(msgspec.json.schema(AgentView), sort_keys=True).encode()
    shape = hashlib.sha256(schema).hexdigest()[:16]
    assert (AGENT_VIEW.version, embedded, shape) == (
        5,
        {"session": 1, "activations": 1, "drafts": 2, "verify_calls": 1},
        # the shape moved with `announcement:queued`'s optional `text_run` (session 35)
        # and the version did not: every older snapshot's queued records had their own
        # text, which is what its None says
        "ee91f1b4a4cfed92",
    )
