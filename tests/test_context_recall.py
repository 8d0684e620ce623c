"""ctx_search, ctx_inspect and ctx_expand over one session's lossless store (issue 6)."""

from __future__ import annotations

import pytest

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    Bm25Index,
    ContextMessage,
    ContextScopeError,
    DagEngine,
    ExtractiveSummarizer,
)
from stalwart.events import ToolCall


def session(turns: int = 60) -> list[ContextMessage]:
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be useful.")]
    for n in range(turns):
        seq = len(out)
        fact = f" The locker code is LOCK-{n:04d}." if n % 10 == 3 else ""
        call = ToolCall(id=f"c{n}", name="fetch", arguments=f'{{"page": {n}}}')
        out += [
            ContextMessage(
                message_id=f"u{n}", seq=seq, role="user", content=f"Step {n}.{fact} " + "a " * 60
            ),
            ContextMessage(message_id=f"a{n}", seq=seq + 1, role="assistant", tool_calls=(call,)),
            ContextMessage(
                message_id=f"r{n}",
                seq=seq + 2,
                role="tool",
                tool_call_id=f"c{n}",
                content=f"page {n} body " + "b " * 80,
            ),
        ]
    return out


@pytest.fixture
def dag(clock: FakeClock) -> DagEngine:
    engine = DagEngine(
        ContextEngineSettings(fresh_tail_turns=3, expand_max_tokens=500),
        summarizer=ExtractiveSummarizer(),
        clock=clock,
    )
    messages = session()
    for end in range(2, len(messages) + 1, 3):
        engine.assemble("s1", messages[:end], 2_000, tenant="acme")
    engine.assemble("s2", session(5), 50_000, tenant="acme")
    return engine


def test_bm25_ranks_rarer_and_denser_matches_first() -> None:
    index = Bm25Index()
    index.add("a", "refund refund refund for the order")
    index.add("b", "the order was shipped")
    index.add("c", "unrelated text entirely")
    assert [doc for doc, _ in index.search("refund order")] == ["a", "b"]
    assert index.search("nothing-like-it") == []
    scores = index.scores("order", ["a", "b", "c"])
    assert scores["c"] == 0.0
    assert scores["b"] > scores["a"]  # shorter document, same term frequency


def test_search_finds_a_summarized_fact_and_where_it_is_shown(dag: DagEngine) -> None:
    hits = dag.search("s1", "LOCK-0013", tenant="acme")
    assert hits[0].kind == "message"
    assert hits[0].id == "u13"
    assert hits[0].summary_id is not None
    assert "LOCK-0013" in hits[0].snippet
    assert hits[0].in_context_as in dag.sessions["s1"].roots


def test_expand_returns_the_stored_messages_byte_for_byte_within_the_grant(dag: DagEngine) -> None:
    hit = dag.search("s1", "LOCK-0023", tenant="acme")[0]
    assert hit.summary_id is not None
    stored = {m.message_id: m for m in session()}
    seen: dict[str, str] = {}
    after, offset = None, 0
    while True:
        part = dag.expand(
            "s1", hit.summary_id, tenant="acme", max_tokens=120, after=after, offset=offset
        )
        assert part.tokens <= 120
        for index, piece in enumerate(part.messages):
            if index == 0 and part.offset:
                seen[piece.message_id] += piece.content
            else:
                seen[piece.message_id] = piece.content
                assert piece.tool_calls == stored[piece.message_id].tool_calls
        if part.next_after is None:
            break
        after, offset = part.next_after, part.next_offset
    assert seen["u23"] == stored["u23"].content
    start, end = dag.sessions["s1"].spans[hit.summary_id]
    assert list(seen) == [m.message_id for m in session()[start:end]]
    assert all(seen[k] == stored[k].content for k in seen)


def test_the_grant_is_capped_by_expand_max_tokens(dag: DagEngine) -> None:
    root = dag.sessions["s1"].roots[0]
    part = dag.expand("s1", root, tenant="acme", max_tokens=10**9)
    assert part.tokens <= 500
    assert part.next_after is not None


def test_inspect_says_what_a_summary_covers(dag: DagEngine) -> None:
    sessionstate = dag.sessions["s1"]
    root = sessionstate.roots[0]
    info = dag.inspect("s1", root, tenant="acme")
    assert info.top_level
    assert info.descendant_count == sessionstate.spans[root][1] - sessionstate.spans[root][0]
    assert info.first_seq <= info.last_seq
    if info.depth:
        child = dag.inspect("s1", info.covers[0], tenant="acme")
        assert child.parent == root
        assert not child.top_level


def test_another_sessions_or_tenants_ids_are_refused_alike(dag: DagEngine) -> None:
    root = dag.sessions["s1"].roots[0]
    refusals = [
        lambda: dag.expand("s2", root, tenant="acme"),
        lambda: dag.inspect("s2", root, tenant="acme"),
        lambda: dag.expand("s1", root, tenant="other"),
        lambda: dag.search("s1", "LOCK", tenant="other"),
        lambda: dag.expand("nope", root, tenant="acme"),
        lambda: dag.expand("s1", "u3", tenant="acme", after="u0-in-another-summary"),
    ]
    messages = set()
    for refuse in refusals:
        with pytest.raises(ContextScopeError) as caught:
            refuse()
        messages.add(str(caught.value))
    assert messages == {"no summary or message with that id in this session"}
