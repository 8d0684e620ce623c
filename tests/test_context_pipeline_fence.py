"""The pipeline engine's cache fence: what was sent before it is sent again unchanged,
until a recorded reason shapes it again."""

from __future__ import annotations

import itertools

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.context.pipeline import PipelineConfig, PipelineEngine, PipelineResult
from stalwart.context.pipeline._fence import over_threshold
from stalwart.events import ContextAssembled
from stalwart.runtime import Runtime
from stalwart.state import PipelineState, apply_pipeline_event
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import delivered, of

from .test_context_pipeline import Summaries, Transcript, pairs_ok

OBJECTIVE = "pipeline-objective"


def engine(**knobs: object) -> PipelineEngine:
    return PipelineEngine(
        PipelineConfig(**knobs),  # type: ignore[arg-type]
        summarizer=Summaries(),
        clock=FakeClock(1_800_000_000.0),
    )


def users(result: PipelineResult) -> list[str]:
    return [m.content for m in result.messages if m.role == "user"]


def turn_by_turn(
    eng: PipelineEngine, turns: int, *, caching: bool = True, budget: int = 1_000_000
) -> list[PipelineResult]:
    """One call per user turn, each after the turn's user message."""
    t = Transcript()
    out = []
    for n in range(turns):
        t.user(f"question {n}")
        out.append(eng.assemble(t.all, budget, provider="anthropic", caching=caching))
        t.assistant(f"answer {n}")
    return out


def assert_held(before: PipelineResult, after: PipelineResult) -> None:
    assert after.messages[: before.fence] == before.messages[: before.fence]


def test_the_window_slides_in_steps_and_what_was_sent_before_the_fence_stays() -> None:
    results = turn_by_turn(engine(history_turns=3, cache_fence_turns=3), 14)
    breaks = [r.cache_break for r in results]
    # the first call sets the fence; every 3 user turns the layers shape it again
    assert breaks[0] == "new"
    assert [i for i, b in enumerate(breaks) if b is not None] == [0, 3, 6, 9, 12]
    for before, after in itertools.pairwise(results):
        if after.cache_break is None:
            assert_held(before, after)
        assert after.fence > 0
    for result in results:
        questions = [u for u in users(result) if u.startswith("question")]
        assert len(questions) <= 3 + 3  # the window, and at most a step more while held
        assert pairs_ok(result.messages)
    # at a break the layers' output is sent whole: the window is back to 3 turns
    assert [u for u in users(results[12]) if u.startswith("question")] == [
        "question 10",
        "question 11",
        "question 12",
    ]


def test_a_non_caching_provider_gets_the_layers_output_every_call() -> None:
    results = turn_by_turn(engine(history_turns=3), 8, caching=False)
    for result in results:
        assert (result.fence, result.breakpoints, result.cache_break) == (0, (), None)
        assert len([u for u in users(result) if u.startswith("question")]) <= 3
    assert users(results[-1])[-1] == "question 7"


def test_no_fence_when_the_knob_is_zero() -> None:
    results = turn_by_turn(engine(history_turns=3, cache_fence_turns=0), 6)
    assert all(r.fence == 0 and r.cache_break is None for r in results)
    assert [u for u in users(results[-1]) if u.startswith("question")] == [
        "question 3",
        "question 4",
        "question 5",
    ]


def test_the_objective_is_restated_once_and_held_where_it_was_sent() -> None:
    results = turn_by_turn(engine(history_turns=2, cache_fence_turns=3), 11)
    for result in results:
        restated = [i for i, m in enumerate(result.messages) if m.message_id == OBJECTIVE]
        has_first = any(m.content == "question 0" for m in result.messages)
        assert len(restated) == (0 if has_first else 1)
        if restated and result.cache_break is not None:
            # placed by layer 10 just before the newest user message
            assert restated[0] == len(result.messages) - 2
    assert [r.cache_break for r in results[9:]] == ["step", None]
    # held: it stays where the break put it, the newer turns come after it
    assert [m.content for m in results[10].messages[-4:]] == [
        results[9].messages[-2].content,
        "question 9",
        "answer 9",
        "question 10",
    ]


def test_calls_inside_a_turn_keep_the_prefix_while_results_age() -> None:
    # the masker masks one more result with every new one; behind the fence it does
    # not, so every call reads the whole previous request from the cache
    knobs = {"observation_trigger_chars": 100, "observation_keep_window": 2}
    eng = engine(cache_fence_turns=2, **knobs)
    t = Transcript()
    t.user("look things up")
    results = []
    for n in range(6):
        t.pair("lookup", f'{{"q": {n}}}', "result " + "x" * 200)
        results.append(eng.assemble(t.all, 1_000_000, provider="anthropic"))
    t.assistant("done")
    t.user("and now?")
    results.append(eng.assemble(t.all, 1_000_000, provider="anthropic"))
    for before, after in itertools.pairwise(results):
        assert after.cache_break is None
        assert after.messages[: len(before.messages)] == before.messages
    assert not any(m.content.startswith("[MASKED_TOOL_RESULT") for m in results[-1].messages)
    fresh = engine(**knobs).assemble(t.all, 1_000_000, provider="anthropic", caching=False)
    assert len([m for m in fresh.messages if m.content.startswith("[MASKED_TOOL_RESULT")]) == 4
    # a step later the masks catch up
    t.assistant("ok")
    t.user("more?")
    caught_up = eng.assemble(t.all, 1_000_000, provider="anthropic")
    assert caught_up.cache_break == "step"
    assert (
        caught_up.messages
        == engine(**knobs).assemble(t.all, 1_000_000, provider="anthropic", caching=False).messages
    )


def test_thinking_stays_behind_the_fence_until_the_step() -> None:
    eng = engine(thinking_keep_turns=2, cache_fence_turns=4)
    t = Transcript()
    results = []
    for n in range(6):
        t.user(f"q{n}")
        results.append(eng.assemble(t.all, 1_000_000, provider="anthropic"))
        t.assistant(f"a{n}", thinking=[{"text": f"why {n}", "signature": f"sig{n}"}])

    def thinking(result: PipelineResult) -> list[str]:
        return [b.text for m in result.messages for b in m.thinking]

    assert results[3].cache_break is None
    assert thinking(results[3]) == ["why 0", "why 1", "why 2"]  # held, none cleaned
    assert results[4].cache_break == "step"
    assert thinking(results[4]) == ["why 3"]  # the newest turns only (turn > 5 - 2)


def test_a_new_provider_or_budget_or_summary_breaks_the_fence() -> None:
    eng = engine(history_turns=50)
    t = Transcript()
    t.user("q0")
    assert eng.assemble(t.all, 100_000, provider="anthropic").cache_break == "new"
    t.assistant("a0")
    t.user("q1")
    assert eng.assemble(t.all, 100_000, provider="anthropic").cache_break is None
    t.assistant("a1")
    t.user("q2")
    assert eng.assemble(t.all, 100_000, provider="openai").cache_break == "replay"
    t.assistant("a2")
    t.user("q3")
    assert eng.assemble(t.all, 90_000, provider="openai").cache_break == "budget"
    t.assistant("a3")
    t.user("q4")
    assert eng.assemble(t.all, 90_000, provider="openai").cache_break is None


def test_a_compaction_breaks_the_fence() -> None:
    eng = engine(history_turns=100, cache_fence_turns=100)
    t = Transcript()
    results = []
    for n in range(30):
        t.user(f"question {n} " + "word " * 60)
        results.append(eng.assemble(t.all, 2_000, provider="anthropic"))
        t.assistant(f"answer {n} " + "word " * 60)
    compacted = [r for r in results if r.compacted]
    assert compacted
    # the first compaction comes on a call whose held transcript stayed under the
    # threshold: its break is either the compaction or the threshold just before it
    assert all(r.cache_break in ("compaction", "threshold") for r in compacted)
    assert any(r.cache_break == "compaction" for r in compacted)
    for r in results:
        assert r.tokens_out <= r.budget


def test_a_held_transcript_that_reaches_the_threshold_is_shaped_again() -> None:
    # the window keeps 2 turns of ~150 tokens; held, 6 would pass 85% of 1,000
    eng = engine(history_turns=2, cache_fence_turns=100)
    t = Transcript(system=None)
    results = []
    for n in range(12):
        t.user(f"question {n} " + "word " * 70)
        results.append(eng.assemble(t.all, 1_000, provider="anthropic"))
        t.assistant(f"answer {n} " + "word " * 70)
    assert "threshold" in [r.cache_break for r in results]
    for r in results:
        assert r.tokens_out < 1_000 * 0.85 or r.cache_break is not None
        assert not r.compacted  # the freshly shaped transcript is small: nothing to summarize
        assert r.tokens_out <= r.budget


def test_an_engine_rebuilt_from_the_log_breaks_once_and_then_holds() -> None:
    first = engine(history_turns=3)
    t = Transcript()
    events = []
    for n in range(4):
        t.user(f"q{n}")
        events.extend(first.assemble(t.all, 50_000, provider="anthropic").events)
        t.assistant(f"a{n}")
    state = PipelineState()
    for event in events:
        state = apply_pipeline_event(state, event)
    assert state.fence > 0
    assert state.fence_input > 0
    assert state == first.state
    rebuilt = PipelineEngine.from_events(
        events, PipelineConfig(history_turns=3), summarizer=Summaries(), clock=FakeClock()
    )
    t.user("q4")
    again = rebuilt.assemble(t.all, 50_000, provider="anthropic")
    assert again.cache_break == "rebuilt"
    recorded = [e for e in again.events if isinstance(e, ContextAssembled)][-1]
    assert (recorded.cache_break, recorded.fence) == ("rebuilt", again.fence)
    t.assistant("a4")
    t.user("q5")
    assert rebuilt.assemble(t.all, 50_000, provider="anthropic").cache_break is None


def test_breakpoints_mark_the_start_where_the_previous_request_ended_and_the_end() -> None:
    results = turn_by_turn(engine(), 3)
    before, last = results[-2:]
    assert last.fence == len(last.messages)
    assert last.breakpoints == (0, len(before.messages) - 1, len(last.messages) - 1)
    assert results[0].breakpoints == (0, len(results[0].messages) - 1)  # a break: no held end


def test_a_result_that_comes_after_its_call_was_sent_breaks_the_fence() -> None:
    # two parallel calls, one answered when the call is assembled: repair gives the
    # other a placeholder result; when the real one comes the model must see it
    eng = engine()
    t = Transcript()
    t.user("q0")
    calls = [
        {"id": "c1", "name": "search", "arguments": '{"q": 1}'},
        {"id": "c2", "name": "search", "arguments": '{"q": 2}'},
    ]
    t.add("assistant", "", tool_calls=calls)
    t.add("tool", "first result", tool_call_id="c1", name="search")
    first = eng.assemble(t.all, 50_000, provider="anthropic")
    assert [m.message_id for m in first.messages if m.role == "tool"] == ["m3", "synthetic:c2"]
    t.add("tool", "second result", tool_call_id="c2", name="search")
    late = eng.assemble(t.all, 50_000, provider="anthropic")
    assert late.cache_break == "late_result"
    assert "second result" in [m.content for m in late.messages]
    assert not any(m.message_id.startswith("synthetic:") for m in late.messages)
    t.assistant("done")
    t.user("q1")
    assert eng.assemble(t.all, 50_000, provider="anthropic").cache_break is None


def test_damaged_input_stays_provider_valid_while_held() -> None:
    eng = engine(history_turns=2)
    t = Transcript()
    t.user("q0")
    eng.assemble(t.all, 50_000, provider="anthropic")
    # a call whose result never came, then the conversation goes on
    t.add("assistant", "", tool_calls=[{"id": "lost", "name": "search", "arguments": "{}"}])
    t.user("q1")
    held = eng.assemble(t.all, 50_000, provider="anthropic")
    t.assistant("a1")
    t.user("q2")
    again = eng.assemble(t.all, 50_000, provider="anthropic")
    assert again.cache_break is None
    assert pairs_ok(held.messages)
    assert pairs_ok(again.messages)
    assert_held(held, again)


def test_every_message_sent_is_one_the_session_holds_or_one_the_engine_wrote() -> None:
    results = turn_by_turn(engine(history_turns=2, cache_fence_turns=3), 10)
    written = ("pipeline-", "synthetic:")
    for result in results:
        for message in result.messages:
            assert message.message_id.startswith(("m", *written))


def test_a_running_runtime_marks_the_fence_for_the_anthropic_cache(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = parse_config(
        {
            "providers": {"main": {"kind": "anthropic", "base_url": fake.base_url}},
            "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
            "context_engine": {"version": "pipeline", "pipeline": {"history_turns": 2}},
        }
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        for n in range(4):
            fake.add(Answer(text=f"answer {n}"))
            session.send(f"question {n}")
            delivered(rt, chat, n + 1)
    assembled = of(ContextAssembled, list(store.read_stream("context:s1")))
    assert [a.cache_break for a in assembled] == ["new", None, None, None]
    bodies = [request.body for request in fake.requests]
    marked = [
        [
            block
            for message in body["messages"]
            for block in (message["content"] if isinstance(message["content"], list) else ())
            if "cache_control" in block
        ]
        for body in bodies
    ]
    assert all(marked)  # every request marks cache breakpoints
    # held: what the call before sent, but its newest user message, went out again
    before, after = (unmarked(body["messages"]) for body in bodies[-2:])
    assert assembled[-1].fence > 0
    assert after[: len(before) - 1] == before[:-1]


def unmarked(messages: list[dict[str, object]]) -> list[object]:
    """The messages without their ``cache_control`` marks (which move with the fence)."""

    def strip(content: object) -> object:
        if isinstance(content, list):
            return [{k: v for k, v in block.items() if k != "cache_control"} for block in content]
        return content

    return [{**message, "content": strip(message["content"])} for message in messages]


def test_a_held_transcript_gives_way_only_to_a_smaller_one_or_the_budget() -> None:
    # right after a compaction, rehydration fills the fresh transcript up to the budget:
    # holding is no bigger then, so it holds while it fits
    assert not over_threshold(1_800, 1_750, limit=1_700, budget=2_000)
    assert over_threshold(1_800, 1_600, limit=1_700, budget=2_000)
    assert over_threshold(2_100, 1_900, limit=1_700, budget=2_000)
    assert not over_threshold(1_699, 1_000, limit=1_700, budget=2_000)
