"""The DAG engine's storage, tail, summaries and rebuild (issue 6, item 2)."""

from __future__ import annotations

import msgspec
import pytest

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    estimate_message_tokens,
    validity_violations,
)
from stalwart.events import (
    ContextBound,
    ContextDagDegraded,
    ContextSummaryCreated,
    RecordedEvent,
    ToolCall,
)


def conversation(turns: int, *, words: int = 30, start: int = 0) -> list[ContextMessage]:
    """A system prompt then ``turns`` of user / assistant call / result / answer."""
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be careful.")]
    for turn in range(start, start + turns):
        seq = len(out)
        call = ToolCall(id=f"c{turn}", name="lookup", arguments=f'{{"n": {turn}}}')
        out += [
            ContextMessage(
                message_id=f"u{turn}",
                seq=seq,
                role="user",
                turn=turn,
                content=f"Question {turn}. " + "word " * words,
                ts=1000.0 + turn,
            ),
            ContextMessage(
                message_id=f"a{turn}",
                seq=seq + 1,
                role="assistant",
                turn=turn,
                tool_calls=(call,),
                ts=1000.0 + turn,
            ),
            ContextMessage(
                message_id=f"r{turn}",
                seq=seq + 2,
                role="tool",
                turn=turn,
                tool_call_id=f"c{turn}",
                content=f"Result {turn}. " + "data " * words,
                ts=1000.0 + turn,
            ),
            ContextMessage(
                message_id=f"b{turn}",
                seq=seq + 3,
                role="assistant",
                turn=turn,
                content=f"Answer {turn}. " + "text " * words,
                ts=1000.0 + turn,
            ),
        ]
    return out


def engine(clock: FakeClock, **knobs: object) -> DagEngine:
    settings = msgspec.structs.replace(ContextEngineSettings(), **knobs)
    counter = iter(range(10**6))
    return DagEngine(
        settings,
        summarizer=ExtractiveSummarizer(),
        clock=clock,
        make_id=lambda: f"s{next(counter)}",
    )


def recorded(events: list[object], stream: str = "context:s1") -> list[RecordedEvent]:
    return [
        RecordedEvent(
            position=i + 1,
            stream=stream,
            version=i + 1,
            ts=1.0,
            id=str(i),
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=event,
        )  # type: ignore[arg-type]
        for i, event in enumerate(events)
    ]


def test_everything_under_budget_is_passed_verbatim_with_the_dag_clause(clock: FakeClock) -> None:
    messages = conversation(3)
    result = engine(clock).assemble("s1", messages, 100_000)
    assert result.messages[1:] == tuple(messages[1:])
    assert result.messages[0].content.startswith("Be careful.")
    assert "lossy recall cue" in result.messages[0].content
    assert isinstance(result.events[0], ContextBound)
    assert result.summaries_made == ()


def test_identical_messages_are_stored_twice_and_reingest_is_idempotent(clock: FakeClock) -> None:
    dag = engine(clock)
    same = [
        ContextMessage(message_id="u1", seq=0, role="user", content="hello"),
        ContextMessage(message_id="u2", seq=1, role="user", content="hello"),
    ]
    dag.assemble("s1", same, 10_000)
    dag.assemble("s1", same, 10_000)
    dag.assemble("s1", same[:1], 10_000)
    session = dag.sessions["s1"]
    assert [m.message_id for m in session.messages] == ["u1", "u2"]
    assert len(session.index) == 2


def test_leaf_summaries_start_past_the_threshold_and_keep_the_budget(clock: FakeClock) -> None:
    dag = engine(clock)
    messages = conversation(60)
    budget = 4_000
    made = []
    for end in range(5, len(messages) + 1, 4):
        result = dag.assemble("s1", messages[:end], budget)
        assert result.tokens <= budget
        assert validity_violations(result.messages) == []
        made += [e for e in result.events if isinstance(e, ContextSummaryCreated)]
    leaves = [e for e in made if e.depth == 0]
    assert leaves, "a 60-turn session at 4k needs summaries"
    covered = [message_id for leaf in leaves for message_id in leaf.covers]
    assert covered == [m.message_id for m in messages[1 : 1 + len(covered)]]
    # every summarized message is replaced by its summary, never shown twice
    shown = {m.message_id for m in result.messages}
    assert not shown & set(covered)


def test_the_fresh_tail_is_verbatim_and_starts_at_a_user_message(clock: FakeClock) -> None:
    dag = engine(clock, fresh_tail_turns=3)
    messages = conversation(40)
    result = dag.assemble("s1", messages, 3_000)
    tail = messages[-12:]  # three turns of four messages
    assert result.messages[-12:] == tuple(tail)
    assert tail[0].role == "user"


def test_condensation_folds_fanout_same_depth_summaries(clock: FakeClock) -> None:
    dag = engine(clock, condensed_min_fanout=4, fresh_tail_turns=2)
    messages = conversation(200, words=20)
    events = []
    for end in range(5, len(messages) + 1, 4):
        events += dag.assemble("s1", messages[:end], 2_500).events
    summaries = [e for e in events if isinstance(e, ContextSummaryCreated)]
    condensed = [e for e in summaries if e.depth >= 1]
    assert condensed
    by_id = {e.summary_id: e for e in summaries}
    for event in condensed:
        assert len(event.covers) == 4
        assert {by_id[child].depth for child in event.covers} == {event.depth - 1}
        assert event.descendant_count == sum(by_id[c].descendant_count for c in event.covers)
    session = dag.sessions["s1"]
    depths = [session.nodes[root].depth for root in session.roots]
    assert depths == sorted(depths, reverse=True)
    assert all(depths.count(depth) < 4 for depth in set(depths))


def test_a_tail_over_budget_shrinks_by_whole_turns_and_is_recorded(clock: FakeClock) -> None:
    dag = engine(clock, fresh_tail_turns=8)
    messages = conversation(10, words=200)
    result = dag.assemble("s1", messages, 2_000)
    assert result.tokens <= 2_000
    degraded = [e for e in result.events if isinstance(e, ContextDagDegraded)]
    assert [e.reason for e in degraded] == ["tail_over_budget"]
    assert degraded[0].knob == "context_engine.fresh_tail_turns"
    assert degraded[0].used > degraded[0].limit
    assert result.messages[-1] == messages[-1]
    assert any(m.message_id == "u9" for m in result.messages)  # the newest user message
    # recorded once per episode, not every call
    again = dag.assemble("s1", messages, 2_000)
    assert not [e for e in again.events if isinstance(e, ContextDagDegraded)]


def test_a_single_turn_over_budget_is_clipped_with_a_marker(clock: FakeClock) -> None:
    huge = [
        ContextMessage(message_id="u", seq=0, role="user", content="read it"),
        ContextMessage(
            message_id="a", seq=1, role="assistant", tool_calls=(ToolCall(id="c", name="read"),)
        ),
        ContextMessage(message_id="r", seq=2, role="tool", tool_call_id="c", content="x" * 40_000),
    ]
    result = engine(clock).assemble("s1", huge, 2_000)
    assert result.tokens <= 2_000
    assert result.clipped == 1
    clipped = result.messages[-1]
    assert clipped.message_id == "r"
    assert "ctx_expand id=r" in clipped.content
    assert validity_violations(result.messages) == []


def test_the_state_is_rebuilt_from_the_context_stream_and_the_messages(clock: FakeClock) -> None:
    live = engine(clock)
    messages = conversation(80)
    events = []
    for end in range(5, len(messages) + 1, 4):
        events += live.assemble("s1", messages[:end], 3_000).events
    rebuilt = engine(clock)
    rebuilt.restore("s1", recorded(events), messages)
    a, b = live.sessions["s1"], rebuilt.sessions["s1"]
    assert a.roots == b.roots
    assert a.covered == b.covered
    assert a.nodes.keys() == b.nodes.keys()
    next_live = live.assemble("s1", messages, 3_000)
    next_rebuilt = rebuilt.assemble("s1", messages, 3_000)
    assert next_live.messages == next_rebuilt.messages


def test_estimates_are_cached_per_message(clock: FakeClock) -> None:
    dag = engine(clock)
    messages = conversation(5)
    dag.assemble("s1", messages, 50_000)
    session = dag.sessions["s1"]
    assert session.tokens == [estimate_message_tokens(m) for m in messages]
    assert session.range_tokens(0, len(messages)) == sum(session.tokens)


@pytest.mark.parametrize("budget", [1_500, 6_000, 40_000])
def test_every_call_of_a_long_session_is_within_budget_and_valid(
    clock: FakeClock, budget: int
) -> None:
    dag = engine(clock)
    messages = conversation(120, words=25)
    for end in range(2, len(messages) + 1):
        if messages[end - 1].role != "assistant":
            result = dag.assemble("s1", messages[:end], budget)
            assert result.tokens <= budget
            assert validity_violations(result.messages) == []
