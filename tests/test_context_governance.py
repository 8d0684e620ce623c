"""Summarizer spend caps, the summarizer breaker, fail-closed rollover and the operator-only
engine version (issue 6, items 1, 3 and 4)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings, apply_agent_patch, parse_config
from stalwart.context import (
    ContextMessage,
    ContextScopeError,
    DagEngine,
    ExtractiveSummarizer,
    Summarizer,
    SummaryRequest,
)
from stalwart.errors import ConfigError
from stalwart.events import (
    ContextDagDegraded,
    ContextSummarizerFailed,
    ContextSummaryCreated,
    Event,
    RecordedEvent,
)
from stalwart.state import GovernorState, apply_governor, decide_summarizer

SECRET = "the-password-is-swordfish"


def turns(count: int) -> list[ContextMessage]:
    out = []
    for n in range(count):
        out += [
            ContextMessage(
                message_id=f"u{n}",
                seq=2 * n,
                role="user",
                turn=n,
                content=f"{SECRET} question {n} " + "w " * 120,
            ),
            ContextMessage(
                message_id=f"b{n}",
                seq=2 * n + 1,
                role="assistant",
                turn=n,
                content=f"answer {n} " + "v " * 120,
            ),
        ]
    return out


class Flaky:
    """Raises while ``broken``; otherwise answers like the stand-in, ``delay`` s later."""

    def __init__(self, clock: FakeClock) -> None:
        self.broken = True
        self.calls = 0
        self.delay = 0.0
        self.clock = clock
        self.standin = ExtractiveSummarizer()

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        self.clock.advance(self.delay)
        if self.broken:
            raise TimeoutError("upstream timed out")
        return self.standin(request)


def engine(clock: FakeClock, summarizer: Summarizer, **spend: int) -> DagEngine:
    settings = ContextEngineSettings(fresh_tail_turns=2)
    settings = msgspec.structs.replace(
        settings, summarizer_spend=msgspec.structs.replace(settings.summarizer_spend, **spend)
    )
    return DagEngine(settings, summarizer=summarizer, clock=clock)


def feed(dag: DagEngine, clock: FakeClock, messages: list[ContextMessage]) -> list[Event]:
    events: list[Event] = []
    for end in range(2, len(messages) + 1, 2):
        clock.advance(1)
        result = dag.assemble("s1", messages[:end], 1_500, tenant="acme")
        assert result.tokens <= 1_500
        events += result.events
    return events


def of(kind: type[Any], events: list[Event]) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


def test_the_spend_cap_degrades_to_marked_truncation_without_content(clock: FakeClock) -> None:
    dag = engine(clock, ExtractiveSummarizer(), max_tokens_per_tenant_per_hour=2_500)
    events = feed(dag, clock, turns(40))
    summaries = of(ContextSummaryCreated, events)
    assert any(s.fallback is None for s in summaries)
    fallbacks = [s for s in summaries if s.fallback == "emergency-truncation"]
    assert fallbacks
    assert all(s.input_tokens == 0 and s.output_tokens == 0 for s in fallbacks)
    degraded = of(ContextDagDegraded, events)
    assert [d.reason for d in degraded] == ["spend_cap"]  # once per episode
    event = degraded[0]
    assert event.knob == "context_engine.summarizer_spend.max_tokens_per_tenant_per_hour"
    assert event.limit == 2_500
    assert event.tenant == "acme"
    assert event.until is not None
    assert event.duration_ms > 0
    assert SECRET not in msgspec.json.encode(event).decode()
    shown = dag.assemble("s1", turns(40), 1_500, tenant="acme").messages
    marked = [m for m in shown if "fallback=emergency-truncation]" in m.content.splitlines()[0]]
    assert marked


def test_a_cap_of_zero_disables_the_window(clock: FakeClock) -> None:
    dag = engine(
        clock,
        ExtractiveSummarizer(),
        max_tokens_per_tenant_per_hour=0,
        max_tokens_per_tenant_per_day=0,
    )
    events = feed(dag, clock, turns(40))
    assert not of(ContextDagDegraded, events)
    assert all(s.fallback is None for s in of(ContextSummaryCreated, events))


def test_the_spend_window_rolls(clock: FakeClock) -> None:
    state = GovernorState(tenant="t")
    made = ContextSummaryCreated(
        summary_id="s",
        depth=0,
        covers=("m",),
        descendant_count=1,
        input_tokens=900,
        output_tokens=100,
        tenant="t",
    )
    record = RecordedEvent(
        position=1,
        stream="context:x",
        version=1,
        ts=1_000.0,
        id="e",
        causation_id=None,
        correlation_id=None,
        schema=1,
        event=made,
    )
    state = apply_governor(state, record)
    knobs = {"per_hour": 1_000, "per_day": 0, "failure_threshold": 5, "reset_timeout_ms": 60_000}
    assert decide_summarizer(state, 1_100.0, projected=1, **knobs).reason == "spend_cap"
    assert decide_summarizer(state, 4_601.0, projected=1, **knobs).allowed


def test_the_breaker_opens_after_five_failures_and_never_retries_inline(clock: FakeClock) -> None:
    flaky = Flaky(clock)
    dag = engine(clock, flaky)
    events = feed(dag, clock, turns(30))
    failures = of(ContextSummarizerFailed, events)
    assert len(failures) == 5
    assert flaky.calls == 5  # one call per failing turn, none repeated inline
    assert all(f.error_class == "TimeoutError" and f.tenant == "acme" for f in failures)
    degraded = of(ContextDagDegraded, events)
    assert [d.reason for d in degraded] == ["breaker_open"]
    assert degraded[0].used == 5
    assert degraded[0].limit == 5
    assert SECRET not in msgspec.json.encode(degraded[0]).decode()
    # while open: emergency truncations, no summarizer call at all
    assert any(s.fallback for s in of(ContextSummaryCreated, events))


def test_after_the_reset_timeout_one_trial_closes_or_reopens_it(clock: FakeClock) -> None:
    flaky = Flaky(clock)
    dag = engine(clock, flaky)
    messages = turns(60)
    feed(dag, clock, messages[:40])
    assert flaky.calls == 5
    clock.advance(61)
    flaky.delay = 31.0  # the trial answers, but after the 30 s half-open window
    flaky.broken = False
    events = feed(dag, clock, messages[:48])
    assert [f.error_class for f in of(ContextSummarizerFailed, events)] == ["trial_timeout"]
    assert flaky.calls == 6  # open again: one trial only
    clock.advance(61)
    flaky.delay = 0.0
    events = feed(dag, clock, messages)
    assert not of(ContextSummarizerFailed, events)
    assert any(s.fallback is None for s in of(ContextSummaryCreated, events))


def test_a_malformed_session_id_is_refused_and_recorded(clock: FakeClock) -> None:
    dag = engine(clock, ExtractiveSummarizer())
    for bad in ("session:abc", "context:abc", "", "a b", "tab\there", "x" * 200):
        with pytest.raises(ContextScopeError) as caught:
            dag.assemble(bad, turns(1), 1_000)
        assert [e.reason for e in caught.value.events] == ["fail_closed_rollover"]
    assert dag.sessions == {}
    for good in ("telegram:12345", "9f3c2a", "user@example.com/thread-7"):
        assert dag.assemble(good, turns(1), 1_000).tokens <= 1_000


def test_another_tenant_or_a_rewritten_history_is_refused_not_merged(clock: FakeClock) -> None:
    dag = engine(clock, ExtractiveSummarizer())
    dag.assemble("s1", turns(2), 10_000, tenant="acme")
    with pytest.raises(ContextScopeError) as caught:
        dag.assemble("s1", turns(3), 10_000, tenant="other")
    refusal = caught.value.events[0]
    assert isinstance(refusal, ContextDagDegraded)
    assert refusal.reason == "fail_closed_rollover"
    assert refusal.session == "s1"
    rewritten = [*turns(2)[:3], msgspec.structs.replace(turns(2)[3], content="else"), *turns(3)[4:]]
    with pytest.raises(ContextScopeError):
        dag.assemble("s1", rewritten, 10_000, tenant="acme")
    older = ContextMessage(message_id="late", seq=0, role="user", content="from elsewhere")
    with pytest.raises(ContextScopeError):
        dag.assemble("s1", [*turns(2), older], 10_000, tenant="acme")
    assert [m.message_id for m in dag.sessions["s1"].messages] == ["u0", "b0", "u1", "b1"]
    assert str(caught.value) == "the session belongs to another tenant"


def test_only_an_operator_sets_the_engine_version() -> None:
    config = parse_config({"context_engine": {"version": "pipeline"}})
    assert config.context_engine.version == "pipeline"
    assert parse_config({}).context_engine.version == "dag"
    for patch in ({"context_engine": {"version": "pipeline"}}, {"context_engine": None}):
        with pytest.raises(ConfigError) as caught:
            apply_agent_patch(config, patch)
        assert caught.value.key == "context_engine.version"
    patched = apply_agent_patch(config, {"context_engine": {"fresh_tail_turns": 4}})
    assert patched.context_engine.fresh_tail_turns == 4
    assert patched.context_engine.version == "pipeline"
    with pytest.raises(ConfigError, match="'dag', 'pipeline'"):
        parse_config({"context_engine": {"version": "lossy"}})


def test_an_agent_patch_keeps_what_the_log_record_leaves_out() -> None:
    """The patch was merged into ``to_record()``, which drops URL secrets for the log: a
    patched config lost its provider's query string (``?api-version=``) and user info,
    and its store URL's password."""
    base_url = "https://user:pw@llm.example/v1?api-version=2024-06-01"
    store = "postgresql://app:hunter2@db/agents"
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "store": {"location": store},
        }
    )
    patched = apply_agent_patch(config, {"context_engine": {"fresh_tail_turns": 4}})
    assert patched.providers["main"].base_url == base_url
    assert patched.store.location == store
