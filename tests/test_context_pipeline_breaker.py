"""The pipeline engine's per-layer breaker: 3 strikes, a half-open retry, kept across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.context import SummaryRequest
from stalwart.context.pipeline import PipelineConfig, PipelineEngine, PipelineResult
from stalwart.events import (
    ContextAssembled,
    ContextCompacted,
    ContextLayerDisabled,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
)
from stalwart.state import CONTEXT_PIPELINE, LayerBreaker, fold
from stalwart.store import EventStore, NewEvent

from .test_context_pipeline import Transcript, _long

STREAM = "context:s1"
#: a window the session's transcript fills to about 90%: past the compaction threshold
#: (85%), so the layer needs its summarizer, but within the budget, where the layer's
#: stand-in would leave the oldest turns out (and no summary would be needed for a while);
#: every turn is kept (no history window), so the fill only grows, slowly
BUDGET = 4_250
CONFIG = PipelineConfig(history_turns=1_000)


class FlakySummarizer:
    """A summarizer whose provider is down until told otherwise."""

    def __init__(self) -> None:
        self.down = True
        self.calls = 0

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        if self.down:
            raise ConnectionError("provider unreachable")
        return "summary", 10, 5


class Session:
    """An engine whose events really go to the log, as its owner appends them."""

    def __init__(self, store: EventStore, clock: FakeClock, summarizer: FlakySummarizer) -> None:
        self.store = store
        self.clock = clock
        self.summarizer = summarizer
        self.transcript = _long(14)
        self.engine = PipelineEngine(CONFIG, summarizer=summarizer, clock=clock, session="s1")

    def turn(self, text: str = "keep going") -> PipelineResult:
        self.transcript.user(text)
        result = self.engine.assemble(self.transcript.all, BUDGET, provider="openai")
        now = self.clock.now()
        self.store.append(STREAM, [NewEvent(event=e, ts=now) for e in result.events])
        return result

    def restart(self) -> PipelineEngine:
        return PipelineEngine.from_events(
            self.store.read_stream(STREAM), CONFIG, summarizer=self.summarizer, clock=self.clock
        )


@pytest.fixture
def session(lmdb_store: EventStore, clock: FakeClock) -> Session:
    return Session(lmdb_store, clock, FlakySummarizer())


def _disabled(result: PipelineResult) -> list[ContextLayerDisabled]:
    return [e for e in result.events if isinstance(e, ContextLayerDisabled)]


def test_a_layer_that_raises_is_skipped_and_the_turn_goes_on(session: Session) -> None:
    result = session.turn()
    assert result.layers_failed == ("compaction",)
    assert "objective_reinforcement" not in result.layers_failed
    assert result.messages  # the other layers ran; the transcript is still assembled
    assert _disabled(result) == []
    assert session.engine.state.breaker("compaction").failures == 1


def test_three_failures_in_a_row_disable_the_layer_with_a_warning(session: Session) -> None:
    session.turn()
    session.turn()
    with structlog.testing.capture_logs() as logs:
        third = session.turn()
    (event,) = _disabled(third)
    assert (event.layer, event.failures, event.error) == ("compaction", 3, "ConnectionError")
    assert event.retry_at == session.clock.now() + 600.0
    warning = next(e for e in logs if e["event"] == "Context layer disabled by circuit breaker")
    assert warning["log_level"] == "warning"
    assert warning["layer"] == "compaction"
    assert warning["errorKind"] == "internal"
    assert "provider unreachable" not in str(logs)  # the class name, never the message
    calls = session.summarizer.calls
    session.clock.advance(599.0)
    skipped = session.turn()
    assert session.summarizer.calls == calls  # disabled: not even tried
    assert skipped.layers_failed == ()
    assert "compaction" not in skipped.layers_fired


class FlakyReader:
    """A filesystem that refuses reads until told otherwise."""

    def __init__(self) -> None:
        self.down = True

    def __call__(self, path: str) -> str | None:
        if self.down:
            raise PermissionError(path)
        return None


def test_a_success_between_failures_resets_the_count(clock: FakeClock) -> None:
    summarizer = FlakySummarizer()
    summarizer.down = False
    reader = FlakyReader()
    engine = PipelineEngine(summarizer=summarizer, clock=clock, reader=reader)
    t = _long(14)

    def turn() -> PipelineResult:
        t.user("more")
        return engine.assemble(t.all, 1_000, provider="openai")

    assert turn().layers_failed == ("rehydration",)  # rehydration runs on every
    assert turn().layers_failed == ("rehydration",)  # run once a summary is in force
    reader.down = False
    assert turn().layers_failed == ()
    assert engine.state.breaker("rehydration") == LayerBreaker()
    reader.down = True
    turn()
    second = turn()
    assert _disabled(second) == []  # 2 failures since the success, not 4
    assert engine.state.breaker("rehydration").failures == 2
    (event,) = _disabled(turn())
    assert (event.layer, event.failures, event.error) == ("rehydration", 3, "PermissionError")


def test_the_half_open_trial_re_enables_a_recovered_layer(session: Session) -> None:
    for _ in range(3):
        session.turn()
    session.clock.advance(600.0)
    session.summarizer.down = False
    result = session.turn()
    kinds = [type(e) for e in result.events]
    assert kinds == [
        ContextLayerHalfOpened,
        ContextLayerEnabled,
        ContextCompacted,
        ContextAssembled,
    ]
    assert "compaction" in result.layers_fired
    assert session.engine.state.breaker("compaction") == LayerBreaker()


def test_a_failed_trial_disables_it_again_for_another_cooldown(session: Session) -> None:
    for _ in range(3):
        session.turn()
    session.clock.advance(600.0)
    result = session.turn()
    assert isinstance(result.events[0], ContextLayerHalfOpened)
    (event,) = _disabled(result)
    assert event.failures == 4
    assert event.retry_at == session.clock.now() + 600.0
    assert session.engine.state.breaker("compaction").status == "open"


def test_a_restart_keeps_the_layer_disabled(
    session: Session, store_dir: Path, clock: FakeClock
) -> None:
    for _ in range(3):
        session.turn()
    session.store.close()
    reopened = store_module.open(store_dir, clock=clock)
    try:
        session.store = reopened
        engine = session.restart()
        assert engine.state == session.engine.state
        folded = fold(CONTEXT_PIPELINE, STREAM, reopened.read_stream(STREAM))
        assert folded.breakers == engine.state.breakers
        assert engine.state.breaker("compaction").status == "open"
        session.engine = engine
        calls = session.summarizer.calls
        result = session.turn()
        assert session.summarizer.calls == calls
        assert result.layers_failed == ()
    finally:
        reopened.close()


def test_a_restart_in_the_middle_of_a_streak_keeps_counting(session: Session) -> None:
    session.turn()
    session.turn()
    session.engine = session.restart()
    assert session.engine.state.breaker("compaction").failures == 2
    assert _disabled(session.turn()) != []


def test_a_reader_that_raises_trips_the_rehydration_layer(clock: FakeClock) -> None:
    def broken(path: str) -> str | None:
        raise PermissionError(path)

    summaries: list[SummaryRequest] = []

    def summarize(request: SummaryRequest) -> tuple[str, int, int]:
        summaries.append(request)
        return "summary", 1, 1

    engine = PipelineEngine(summarizer=summarize, clock=clock, reader=broken)
    t: Transcript = _long(14)
    for _ in range(3):
        t.user("more")
        result = engine.assemble(t.all, 1_000, provider="openai")
        assert result.layers_failed == ("rehydration",)
    assert [e.layer for e in result.events if isinstance(e, ContextLayerDisabled)] == [
        "rehydration"
    ]


def test_a_summarizer_outage_does_not_undo_the_compaction_in_force(clock: FakeClock) -> None:
    summarizer = FlakySummarizer()
    summarizer.down = False
    engine = PipelineEngine(summarizer=summarizer, clock=clock)
    t = _long(14)
    t.user("more")
    first = engine.assemble(t.all, 1_000, provider="openai")
    assert first.compacted
    summarizer.down = True
    for _ in range(8):  # failing, then disabled: the summary stays applied all along
        t.user("more " + "x" * 4_000)  # over the budget: compaction is tried each turn
        result = engine.assemble(t.all, 1_000, provider="openai")
        assert any(m.message_id.startswith("pipeline-summary:") for m in result.messages)
        assert engine.state.summary is not None
        assert engine.state.summary.covers.isdisjoint(m.message_id for m in result.messages)
    assert engine.state.breaker("compaction").status == "open"
