"""Relevance-first selection, the cache fence and token counting (issue 6, items 2 and 7)."""

from __future__ import annotations

import msgspec
import pytest

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings, RelevanceSettings, SummarizerBreakerSettings
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    ModelProfile,
    SummaryRequest,
    ThinkingBlock,
    TokenEstimator,
    estimate_message_tokens,
    estimate_text_tokens,
    estimate_tokens,
    request_budget,
)
from stalwart.events import ToolCall, ToolSpec

CACHING = ModelProfile(provider="anthropic", caching=True)
SMALL = ModelProfile(provider="openai", caching=False, small=True)
FRONTIER = ModelProfile(provider="openai", caching=False)
TOPICS = ("volcano", "penguin", "saxophone", "glacier", "origami")


def topical(turns: int) -> list[ContextMessage]:
    """Turns each about one topic; the last asks about the first topic again."""
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Help.")]
    for n in range(turns):
        topic = TOPICS[n % len(TOPICS)]
        out += [
            ContextMessage(
                message_id=f"u{n}",
                seq=len(out),
                role="user",
                content=f"Tell me about the {topic} " + "x " * 80,
            ),
            ContextMessage(
                message_id=f"b{n}",
                seq=len(out) + 1,
                role="assistant",
                content=f"The {topic} is notable. " + "y " * 80,
            ),
        ]
    out.append(
        ContextMessage(
            message_id="last",
            seq=len(out),
            role="user",
            content="Back to the volcano: what did you say?",
        )
    )
    return out


def unavailable(request: SummaryRequest) -> tuple[str, int, int]:
    raise ConnectionError("no summarizer here")


def engine(clock: FakeClock, forced: bool | None = None) -> DagEngine:
    """An engine whose summarizer always fails (and whose breaker never opens), so the
    raw history contends for the budget."""
    settings = ContextEngineSettings(
        fresh_tail_turns=1,
        relevance=RelevanceSettings(first_by_default=forced, recent_user_turns=1),
        summarizer_breaker=SummarizerBreakerSettings(failure_threshold=1_000),
    )
    return DagEngine(settings, summarizer=unavailable, clock=clock)


def kept_topics(messages: tuple[ContextMessage, ...]) -> list[str]:
    return [t for m in messages if m.role == "user" for t in TOPICS if t in m.content]


def test_small_models_without_a_cache_keep_the_relevant_history(clock: FakeClock) -> None:
    messages = topical(30)
    result = engine(clock).assemble("s", messages, 1_200, profile=SMALL)
    assert result.relevance_first
    assert result.evicted
    topics = kept_topics(result.messages[1:-1])
    assert topics
    assert set(topics) == {"volcano"}
    seqs = [m.seq for m in result.messages]
    assert seqs == sorted(seqs)  # chronological order restored


def test_recency_first_otherwise_and_never_on_a_caching_profile(clock: FakeClock) -> None:
    messages = topical(30)
    for profile, forced in ((FRONTIER, None), (CACHING, True), (CACHING, None)):
        result = engine(clock, forced).assemble(
            f"s{id(profile)}{forced}", messages, 1_200, profile=profile
        )
        assert not result.relevance_first
        history = [m for m in result.messages[1:-1] if m.role == "user"]
        assert history[-1].message_id == "u29"  # the newest history is what stays
    forced_on = engine(clock, True).assemble("f", messages, 1_200, profile=FRONTIER)
    assert forced_on.relevance_first
    forced_off = engine(clock, False).assemble("g", messages, 1_200, profile=SMALL)
    assert not forced_off.relevance_first


def test_the_prefix_before_the_fence_holds_between_calls(clock: FakeClock) -> None:
    dag = DagEngine(
        ContextEngineSettings(fresh_tail_turns=2), summarizer=ExtractiveSummarizer(), clock=clock
    )
    messages = topical(300)
    previous = None
    stable = total = 0
    for end in range(3, len(messages), 2):
        result = dag.assemble("s", messages[:end], 3_000, profile=CACHING)
        assert len(result.breakpoints) <= 4
        assert result.breakpoints[0] == 0
        assert result.breakpoints[-1] == len(result.messages) - 1
        assert result.fence - 1 in result.breakpoints
        if previous is not None:
            total += 1
            prefix, fence = previous
            stable += result.messages[:fence] == prefix[:fence]
        previous = (result.messages, result.fence)
    assert any(f > 1 for f in [previous[1]])  # condensed summaries sit before the fence
    assert stable / total >= 0.95


def test_nothing_time_dependent_is_rendered_before_the_fence(clock: FakeClock) -> None:
    dag = DagEngine(
        ContextEngineSettings(fresh_tail_turns=2), summarizer=ExtractiveSummarizer(), clock=clock
    )
    messages = topical(200)
    first = dag.assemble("s", messages, 3_000, profile=CACHING)
    clock.advance(86_400 * 3)
    second = dag.assemble("s", messages, 3_000, profile=CACHING)
    assert second.messages == first.messages


def test_tokens_count_calls_results_thinking_and_images() -> None:
    text = ContextMessage(message_id="t", seq=0, role="assistant", content="hello there")
    call = msgspec.structs.replace(
        text,
        tool_calls=(
            ToolCall(id="c1", name="search", arguments='{"query": "long arguments here"}'),
        ),
    )
    thinking = msgspec.structs.replace(text, thinking=(ThinkingBlock(text="let me think " * 20),))
    image = msgspec.structs.replace(text, images=("data:image/png;base64,AAAA",))
    base = estimate_message_tokens(text)
    assert estimate_message_tokens(call) > base + 10
    assert estimate_message_tokens(thinking) > base + 50
    assert estimate_message_tokens(image) >= base + 1_000
    result = ContextMessage(
        message_id="r", seq=1, role="tool", tool_call_id="c1", content="x" * 400
    )
    assert estimate_message_tokens(result) > 100
    assert estimate_tokens([text, call]) == base + estimate_message_tokens(call)
    assert estimate_text_tokens("日本語のテキスト") >= 8  # about a token per character


def test_calibration_follows_reported_usage() -> None:
    estimator = TokenEstimator("openai", "gpt-x")
    assert estimator.factor == 1.0
    for _ in range(20):
        estimator.calibrate(1_000, 1_300)
    assert estimator.factor == pytest.approx(1.3)
    estimator.calibrate(1_000, 100_000)  # one absurd report moves it a little, bounded
    assert estimator.factor < 2.0
    estimator.calibrate(0, 10)
    message = ContextMessage(message_id="m", seq=0, role="user", content="a" * 3_600)
    assert estimator.message(message) == pytest.approx(
        estimator.raw(message) * estimator.factor, abs=1
    )


def test_a_calibrated_estimator_shrinks_what_fits(clock: FakeClock) -> None:
    dag = engine(clock)
    messages = topical(40)
    before = dag.assemble("s", messages, 1_400, profile=FRONTIER)
    for _ in range(30):
        dag.calibrate(FRONTIER, 1_000, 1_500)
    after = dag.assemble("s", messages, 1_400, profile=FRONTIER)
    assert after.tokens <= 1_400
    assert sum(estimate_message_tokens(m) for m in after.messages) < sum(
        estimate_message_tokens(m) for m in before.messages
    )


def test_the_request_budget_leaves_room_for_the_reply_and_the_tools() -> None:
    spec = ToolSpec(
        name="search",
        description="Search the documents.",
        parameters={"type": "object", "properties": {"q": {"type": "string"}}},
    )
    bare = request_budget(128_000, max_output_tokens=4_096)
    assert bare == 128_000 - 4_096
    with_tools = request_budget(128_000, max_output_tokens=4_096, tools=[spec, spec])
    assert bare - with_tools > 2 * 20
    calibrated = TokenEstimator("anthropic")
    calibrated.calibrate(100, 200)
    assert request_budget(
        128_000, max_output_tokens=4_096, tools=[spec], estimator=calibrated
    ) < request_budget(128_000, max_output_tokens=4_096, tools=[spec])
    assert request_budget(1_000, max_output_tokens=5_000) == 1


def test_engine_calibration_converges_on_the_true_ratio(clock: FakeClock) -> None:
    dag = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock)
    messages = topical(10)
    for _ in range(40):
        result = dag.assemble("s", messages, 100_000, profile=FRONTIER)
        raw = sum(estimate_message_tokens(m) for m in result.messages)
        dag.calibrate(FRONTIER, result.tokens, reported=int(raw * 1.25))
    assert dag.estimator(FRONTIER).factor == pytest.approx(1.25, rel=0.02)
