"""Properties of the DAG engine over random sessions and budgets (issue 6, done means)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    ModelProfile,
    validity_violations,
)
from stalwart.events import ContextSummaryCreated, RecordedEvent, ToolCall
from stalwart.state import CONTEXT_DAG, GovernorState, apply_governor, fold

# a step: a user message, or an assistant answer, or a call with results (some missing:
# a crash between call and result), texts of random sizes (identical texts included)
TEXT = st.sampled_from(["ok", "same text", "hello " * 30, "data " * 200, "é漢字 " * 40, ""])
STEP = st.tuples(st.sampled_from(["user", "answer", "call", "calls", "dangling"]), TEXT)
PROFILES = st.sampled_from(
    [
        ModelProfile(provider="anthropic", caching=True),
        ModelProfile(provider="openai", caching=False, small=True),
        ModelProfile(provider="openai", caching=False),
    ]
)


def build(steps: list[tuple[str, str]]) -> list[ContextMessage]:
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="rules")]

    def add(role: str, content: str = "", **extra: object) -> None:
        out.append(
            ContextMessage(
                message_id=f"m{len(out)}",
                seq=len(out),
                role=role,  # type: ignore[arg-type]
                content=content,
                ts=float(len(out)),
                **extra,
            )
        )

    for kind, text in steps:
        if kind == "user":
            add("user", text or "?")
        elif kind == "answer":
            add("assistant", text)
        else:
            count = 2 if kind == "calls" else 1
            calls = tuple(
                ToolCall(id=f"c{len(out)}.{n}", name="tool", arguments='{"q": 1}')
                for n in range(count)
            )
            add("assistant", "", tool_calls=calls)
            for call in calls if kind != "dangling" else ():
                add("tool", text, tool_call_id=call.id)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(STEP, min_size=1, max_size=80),
    budget=st.integers(min_value=1_200, max_value=20_000),
    tail=st.integers(min_value=1, max_value=8),
    fanout=st.integers(min_value=2, max_value=5),
    profile=PROFILES,
    every=st.integers(min_value=1, max_value=7),
)
def test_assembly_is_valid_within_budget_and_expansion_is_lossless(
    steps: list[tuple[str, str]],
    budget: int,
    tail: int,
    fanout: int,
    profile: ModelProfile,
    every: int,
) -> None:
    messages = build(steps)
    settings_ = ContextEngineSettings(fresh_tail_turns=tail, condensed_min_fanout=fanout)
    dag = DagEngine(settings_, summarizer=ExtractiveSummarizer(), clock=FakeClock())
    for end in [*range(1, len(messages), every), len(messages)]:
        result = dag.assemble("s", messages[:end], budget, tenant="t", profile=profile)
        assert validity_violations(result.messages) == []
        # within budget unless one single message alone is larger than it (then clipped)
        assert result.tokens <= budget
        assert result.messages[0].role == "system"
        assert len(result.breakpoints) <= 4
    session = dag.sessions["s"]
    # expanding every top-level summary, then the rest, gives back the stored messages
    rebuilt: list[ContextMessage] = []
    for root in session.roots:
        after, offset = None, 0
        while True:
            part = dag.expand("s", root, tenant="t", after=after, offset=offset)
            for index, piece in enumerate(part.messages):
                if index == 0 and part.offset:
                    rebuilt[-1] = ContextMessage(
                        **{**_fields(rebuilt[-1]), "content": rebuilt[-1].content + piece.content}
                    )
                else:
                    rebuilt.append(piece)
            if part.next_after is None:
                break
            after, offset = part.next_after, part.next_offset
    covered = messages[session.pinned : session.pinned + len(rebuilt)]
    assert rebuilt == covered
    assert len(rebuilt) == session.covered - session.pinned


def _fields(message: ContextMessage) -> dict[str, object]:
    return {name: getattr(message, name) for name in message.__struct_fields__}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=5, max_size=60), cut=st.floats(min_value=0, max_value=1))
def test_folding_a_prefix_then_the_rest_equals_folding_all(
    steps: list[tuple[str, str]], cut: float
) -> None:
    messages = build(steps)
    dag = DagEngine(
        ContextEngineSettings(fresh_tail_turns=1, condensed_min_fanout=2),
        summarizer=ExtractiveSummarizer(),
        clock=FakeClock(),
    )
    events = []
    for end in range(1, len(messages) + 1):
        events += dag.assemble("s", messages[:end], 1_500, tenant="t").events
    records = [
        RecordedEvent(
            position=i + 1,
            stream="context:s",
            version=i + 1,
            ts=float(i),
            id=str(i),
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=event,
        )
        for i, event in enumerate(events)
    ]
    split = int(len(records) * cut)
    whole = fold(CONTEXT_DAG, "context:s", records)
    halves = fold(
        CONTEXT_DAG, "context:s", records[split:], fold(CONTEXT_DAG, "context:s", records[:split])
    )
    assert halves == whole
    assert list(whole.roots) == dag.sessions["s"].roots
    governor = GovernorState(tenant="t")
    for record in records:
        governor = apply_governor(governor, record)
    assert governor.spend == tuple(
        (r.ts, r.event.input_tokens + r.event.output_tokens)
        for r in records
        if isinstance(r.event, ContextSummaryCreated) and not r.event.fallback
    )
