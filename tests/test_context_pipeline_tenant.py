"""Pipeline mode binds a session to its tenant, as the DAG engine does: the first
assembly records ``context:bound``, and an assembly for another tenant is refused and
recorded (``context:dag_degraded``, ``fail_closed_rollover``), before a restart and after."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pykka import ActorRef

from stalwart.actors import Assemble, ContextStoreActor, ask_context
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings
from stalwart.context import ContextMessage, ContextScopeError, ExtractiveSummarizer, ModelProfile
from stalwart.context.pipeline import PipelineEngine
from stalwart.events import ContextBound, ContextCompacted, ContextDagDegraded
from stalwart.state import CONTEXT_PIPELINE, PipelineState, apply_pipeline_event
from stalwart.store import EventStore, load_state

ASK = 10.0
PROFILE = ModelProfile(provider="openai")
Ref = ActorRef[ContextStoreActor]
SECRET = "the acme merger closes on friday"


def _history(turns: int) -> tuple[ContextMessage, ...]:
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be brief.")]
    for n in range(turns):
        out += [
            ContextMessage(
                message_id=f"u{n}", seq=len(out), role="user", turn=n + 1,
                content=f"Turn {n}: {SECRET}. " + "w " * 400,
            ),
            ContextMessage(
                message_id=f"b{n}", seq=len(out) + 1, role="assistant", turn=n + 1,
                content=f"Reply {n}. " + "r " * 400,
            ),
        ]  # fmt: skip
    return tuple(out)


@pytest.fixture
def start(store: EventStore, clock: FakeClock) -> Iterator[Callable[[], Ref]]:
    refs: list[Ref] = []

    def started() -> Ref:
        ref = ContextStoreActor.start(
            store=store,
            clock=clock,
            summarizer=ExtractiveSummarizer(),
            settings=ContextEngineSettings(version="pipeline"),
        )
        refs.append(ref)
        return ref

    yield started
    for ref in refs:
        ref.stop()


def _assemble(tenant: str | None, messages: tuple[ContextMessage, ...], budget: int) -> Assemble:
    return Assemble(
        session_id="s1", messages=messages, budget=budget, tenant=tenant, profile=PROFILE
    )


# Was: DEFECT: pipeline mode ignored Assemble.tenant: another tenant naming a session got
# the session's compaction summary (the first tenant's words) in its own request.
def test_another_tenant_is_refused_and_the_refusal_recorded(start, store: EventStore) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    history = _history(20)
    mine = ask_context(ref, _assemble("acme", history, 4_000), ASK)
    records = list(store.read_stream("context:s1"))
    assert isinstance(records[0].event, ContextBound)
    assert records[0].event.tenant == "acme"
    assert any(isinstance(r.event, ContextCompacted) for r in records)  # a summary exists
    before = store.stream_version("context:s1")

    theirs = (history[0], ContextMessage(message_id="e1", seq=1, role="user", content="hi"))
    for asker in (ref, start()):  # the running store, and one rebuilt from the log
        with pytest.raises(ContextScopeError, match="belongs to another tenant"):
            ask_context(asker, _assemble("evil", theirs, 4_000), ASK)
        last = list(store.read_stream("context:s1"))[-1].event
        assert isinstance(last, ContextDagDegraded)
        assert (last.reason, last.tenant, last.session) == ("fail_closed_rollover", "evil", "s1")
    assert store.stream_version("context:s1") == before + 2  # two refusals, nothing else

    # the owner goes on, in the running store and after a restart
    for asker in (ref, start()):
        again = ask_context(asker, _assemble("acme", history, 4_000), ASK)
        assert again.engine == "pipeline"
        assert again.messages[-1].content == mine.messages[-1].content


# Was: DEFECT: a session with no tenant could be taken over by a tenant (None is a scope too).
def test_a_session_bound_to_no_tenant_refuses_a_tenant(start) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    ask_context(ref, _assemble(None, _history(3), 20_000), ASK)
    with pytest.raises(ContextScopeError):
        ask_context(ref, _assemble("acme", _history(3), 20_000), ASK)


def test_the_fold_keeps_the_first_binding(store: EventStore) -> None:
    state = PipelineState()
    state = apply_pipeline_event(state, ContextBound(session="s1", tenant="acme"))
    state = apply_pipeline_event(state, ContextBound(session="s1", tenant="evil"))
    assert (state.bound, state.tenant) == (True, "acme")
    store.append("context:s1", [ContextBound(session="s1", tenant="acme")])
    folded = load_state(store, "context:s1", CONTEXT_PIPELINE)
    assert (folded.bound, folded.tenant) == (True, "acme")


def test_a_standalone_engine_binds_once_and_refuses_without_running_a_layer() -> None:
    engine = PipelineEngine(summarizer=ExtractiveSummarizer(), clock=FakeClock(), session="s1")
    first = engine.assemble(_history(2), 20_000, provider="openai", tenant="acme")
    assert [type(e) for e in first.events][:1] == [ContextBound]
    second = engine.assemble(_history(3), 20_000, provider="openai", tenant="acme")
    assert not any(isinstance(e, ContextBound) for e in second.events)
    assembled = engine.state.assemblies
    with pytest.raises(ContextScopeError) as caught:
        engine.assemble(_history(3), 20_000, provider="openai", tenant="evil")
    assert [e.reason for e in caught.value.events] == ["fail_closed_rollover"]  # type: ignore[attr-defined]
    assert engine.state.assemblies == assembled  # nothing ran
