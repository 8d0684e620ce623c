"""Replay re-derives the pipeline layer breaker's decisions from the log."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.cli._replay import default_knobs
from stalwart.clock import FakeClock
from stalwart.context.pipeline import PipelineConfig, PipelineEngine
from stalwart.events import (
    ContextLayerDisabled,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
    RuntimeStarted,
)
from stalwart.state import VERIFIERS, VerifyReport, verify
from stalwart.store import EventStore, NewEvent

from .test_context_pipeline_breaker import BUDGET, CONFIG, STREAM, FlakySummarizer, Session


@pytest.fixture
def session(lmdb_store: EventStore, clock: FakeClock) -> Session:
    return Session(lmdb_store, clock, FlakySummarizer())


def _verify(store: EventStore) -> VerifyReport:
    return verify(store.read_all(), VERIFIERS, defaults=default_knobs())


def _disable(session: Session) -> None:
    for _ in range(3):
        session.turn()


def test_a_disabled_layer_and_its_trials_verify_clean(session: Session) -> None:
    _disable(session)
    session.clock.advance(600.0)
    session.turn()  # the trial fails: disabled again
    session.clock.advance(600.0)
    session.summarizer.down = False
    session.turn()  # the trial succeeds: enabled
    report = _verify(session.store)
    assert report.clean, report.findings
    assert report.checked == {
        "context:layer_disabled": 2,
        "context:layer_enabled": 1,
        "context:layer_half_opened": 2,
    }
    assert "context:layer_disabled" not in report.unchecked


def test_a_layer_disabled_too_early_is_a_mismatch(session: Session) -> None:
    session.turn()  # one failure
    now = session.clock.now()
    forged = ContextLayerDisabled(
        layer="compaction",
        failures=2,
        error="ConnectionError",
        cooldown_s=600.0,
        retry_at=now + 600,
    )
    session.store.append(STREAM, [NewEvent(event=forged, ts=now)])
    (finding,) = _verify(session.store).findings
    assert (finding.kind, finding.tag) == ("mismatch", "context:layer_disabled")
    assert "had failed 1 times in a row" in finding.message
    assert "context_engine.pipeline.layer_failure_limit" in finding.message


def test_a_trial_before_the_cooldown_ends_is_a_mismatch(session: Session) -> None:
    _disable(session)
    session.clock.advance(300.0)
    session.store.append(STREAM, [ContextLayerHalfOpened(layer="compaction")])
    session.store.append(STREAM, [ContextLayerEnabled(layer="objective_reinforcement")])
    findings = _verify(session.store).findings
    assert [(f.kind, f.tag) for f in findings] == [
        ("mismatch", "context:layer_half_opened"),
        ("mismatch", "context:layer_enabled"),
    ]
    assert "its retry is due at" in findings[0].message


def test_the_limit_in_force_is_the_recorded_config(session: Session) -> None:
    config: dict[str, Any] = {"context_engine": {"pipeline": {"layer_failure_limit": 2}}}
    session.store.append("runtime", [RuntimeStarted(config=config, stalwart_version="test")])
    session.engine = PipelineEngine(
        PipelineConfig(layer_failure_limit=2, history_turns=CONFIG.history_turns),
        summarizer=session.summarizer,
        clock=session.clock,
        session="s1",
    )
    session.turn()
    second = session.turn()
    assert any(isinstance(e, ContextLayerDisabled) for e in second.events)
    assert _verify(session.store).clean
    # the same log checked against the defaults alone (3 failures) is a mismatch
    events = [r for r in session.store.read_all() if r.stream != "runtime"]
    report = verify(events, VERIFIERS, defaults=default_knobs())
    assert [f.tag for f in report.findings] == ["context:layer_disabled"]


def test_a_record_stamped_after_its_decision_is_checked_at_the_decision(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    # a log written before the breaker's events carried the assembly's time: the record
    # is appended a little after the decision, its retry_at tells when it was made
    old = Session(lmdb_store, clock, FlakySummarizer())
    for _ in range(2):
        old.turn()
    old.transcript.user("once more")
    result = old.engine.assemble(old.transcript.all, BUDGET, provider="openai")
    clock.advance(0.25)  # the append's clock reading
    lmdb_store.append(STREAM, list(result.events))
    report = verify(lmdb_store.read_all(), VERIFIERS, defaults=default_knobs())
    assert report.clean, report.findings
    assert report.checked == {"context:layer_disabled": 1}
