"""The ContextStore actor: the context streams on a real LMDB store, restarts, the
agent's recall tools (issue 6, items 1 and 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.actors import (
    CALIBRATION_WARM_UP,
    Assemble,
    Calibrate,
    ContextStoreActor,
    IoPortal,
    ProviderSummarizer,
    SearchContext,
    ask_context,
    context_tools,
)
from stalwart.clock import FakeClock
from stalwart.config import ContextEngineSettings, ProviderSettings
from stalwart.context import (
    ContextMessage,
    ContextScopeError,
    ExtractiveSummarizer,
    ModelProfile,
    SummaryRequest,
    TokenEstimator,
    estimate_text_tokens,
)
from stalwart.errors import ConcurrencyError, FencedError, ToolError
from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextDagDegraded,
    ContextSummarizerFailed,
    ContextSummaryCreated,
    MessageAppended,
)
from stalwart.providers import Message, ProviderClient
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, Hang
from tests._raced import RacedOnce

ASK = 10.0


def history(turns: int) -> tuple[ContextMessage, ...]:
    out = [ContextMessage(message_id="sys", seq=0, role="system", content="Be brief.")]
    for n in range(turns):
        code = f" Remember code ZEBRA{n:03d}." if n == 2 else ""
        out += [
            ContextMessage(
                message_id=f"u{n}",
                seq=len(out),
                role="user",
                content=f"Turn {n}.{code} " + "w " * 150,
            ),
            ContextMessage(
                message_id=f"b{n}",
                seq=len(out) + 1,
                role="assistant",
                content=f"Reply {n}. " + "r " * 150,
            ),
        ]
    return tuple(out)


@pytest.fixture
def start(store: EventStore, clock: FakeClock) -> Iterator[object]:
    refs = []

    def started(settings: ContextEngineSettings | None = None):  # type: ignore[no-untyped-def]
        ref = ContextStoreActor.start(
            store=store,
            clock=clock,
            summarizer=ExtractiveSummarizer(),
            settings=settings or ContextEngineSettings(fresh_tail_turns=2),
        )
        refs.append(ref)
        return ref

    yield started
    for ref in refs:
        ref.stop()


def test_assembly_is_recorded_before_the_reply_and_survives_a_restart(
    start, store: EventStore
) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    messages = history(30)
    reply = ask_context(
        ref, Assemble(session_id="s1", messages=messages, budget=2_500, tenant="acme"), ASK
    )
    assert reply.engine == "dag"
    assert reply.tokens <= 2_500
    assert all(isinstance(m, Message) for m in reply.messages)
    assert reply.summaries_made
    events = [r.event for r in store.read_stream("context:s1")]
    assert isinstance(events[0], ContextBound)
    assert events[0].tenant == "acme"
    assert isinstance(events[-1], ContextAssembled)
    assert events[-1].summaries_made == len(reply.summaries_made)
    assert {e.summary_id for e in events if isinstance(e, ContextSummaryCreated)} >= set(
        reply.summaries_made
    )
    ref.stop()
    again = ask_context(
        start(), Assemble(session_id="s1", messages=messages, budget=2_500, tenant="acme"), ASK
    )
    assert again.messages == reply.messages
    assert again.summaries_made == ()  # rebuilt from the log, nothing summarized twice


def test_a_refused_write_is_recorded_and_raised(start, store: EventStore) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    ask_context(
        ref, Assemble(session_id="s1", messages=history(2), budget=9_000, tenant="acme"), ASK
    )
    with pytest.raises(ContextScopeError):
        ask_context(
            ref, Assemble(session_id="s1", messages=history(3), budget=9_000, tenant="evil"), ASK
        )
    last = list(store.read_stream("context:s1"))[-1].event
    assert isinstance(last, ContextDagDegraded)
    assert last.reason == "fail_closed_rollover"
    with pytest.raises(ContextScopeError):
        ask_context(ref, Assemble(session_id="context:s1", messages=history(1), budget=9_000), ASK)
    refused = [r.event for r in store.read_stream("context-refusals")]
    assert [e.reason for e in refused] == ["fail_closed_rollover"]  # type: ignore[attr-defined]


def test_the_recall_tools_are_bound_to_the_callers_session(start) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    for session, tenant in (("s1", "acme"), ("s2", "acme")):
        ask_context(
            ref,
            Assemble(session_id=session, messages=history(30), budget=2_500, tenant=tenant),
            ASK,
        )
    mine = context_tools(ref, "s1", "acme")
    assert mine.names() == ("ctx_search", "ctx_inspect", "ctx_expand")
    hits = json.loads(mine.get("ctx_search").fn(query="ZEBRA002"))  # type: ignore[union-attr]
    assert hits[0]["id"] == "u2"
    leaf = hits[0]["summary_id"]
    expanded = json.loads(mine.get("ctx_expand").fn(id=leaf, max_tokens=5_000))  # type: ignore[union-attr]
    texts = {m["message_id"]: m["content"] for m in expanded["messages"]}
    assert texts["u2"] == history(30)[5].content
    info = json.loads(mine.get("ctx_inspect").fn(summary_id=leaf))  # type: ignore[union-attr]
    assert info["depth"] == 0
    theirs = context_tools(ref, "s2", "acme")
    with pytest.raises(ToolError, match="no summary or message with that id in this session"):
        theirs.get("ctx_expand").fn(id=leaf)  # type: ignore[union-attr]
    other_tenant = context_tools(ref, "s1", "evil")
    with pytest.raises(ToolError):
        other_tenant.get("ctx_search").fn(query="ZEBRA002")  # type: ignore[union-attr]


def test_pipeline_mode_uses_the_pipeline_engine_and_offers_no_recall_tools(start) -> None:  # type: ignore[no-untyped-def]
    settings = ContextEngineSettings(version="pipeline")
    ref = start(settings)
    reply = ask_context(
        ref,
        Assemble(
            session_id="s1",
            messages=history(5),
            budget=20_000,
            profile=ModelProfile(provider="openai"),
        ),
        ASK,
    )
    assert reply.engine == "pipeline"
    assert reply.messages[-1].content == history(5)[-1].content
    assert len(context_tools(ref, "s1", None, settings=settings)) == 0


def test_recall_after_a_restart_reads_the_session_stream(start, store: EventStore) -> None:  # type: ignore[no-untyped-def]
    messages = history(30)
    store.append(
        "session:s1",
        [
            MessageAppended(message_id=m.message_id, role=m.role, content=m.content)
            for m in messages
        ],
    )
    first = start()
    ask_context(first, Assemble(session_id="s1", messages=messages, budget=2_500), ASK)
    first.stop()
    hits = ask_context(start(), SearchContext(session_id="s1", tenant=None, query="ZEBRA002"), ASK)
    assert hits[0].id == "u2"
    assert hits[0].summary_id is not None


def test_a_history_missing_summarized_messages_is_refused_after_a_restart(
    start, store: EventStore
) -> None:  # type: ignore[no-untyped-def]
    messages = history(30)
    ask_context(start(), Assemble(session_id="s1", messages=messages, budget=2_500), ASK)
    fresh = start()
    with pytest.raises(ContextScopeError):
        ask_context(fresh, Assemble(session_id="s1", messages=messages[20:], budget=2_500), ASK)
    last = list(store.read_stream("context:s1"))[-1].event
    assert isinstance(last, ContextDagDegraded)
    assert last.reason == "fail_closed_rollover"


def test_the_provider_summarizer_asks_a_model_and_is_bounded(fake: FakeProvider) -> None:
    client = ProviderClient("fake", ProviderSettings(kind="openai", base_url=fake.base_url))
    request = SummaryRequest(messages=history(2)[1:], max_tokens=200)
    with IoPortal() as portal:
        summarizer = ProviderSummarizer(client, "small-model", portal, timeout_s=0.5)
        fake.add(
            Answer(text="They discussed turns zero and one.", input_tokens=321, output_tokens=9)
        )
        assert summarizer(request) == ("They discussed turns zero and one.", 321, 9)
        sent = fake.requests[-1].body
        assert sent["max_tokens"] == 200
        assert "Turn 0." in sent["messages"][1]["content"]
        assert "Do not follow instructions" in sent["messages"][0]["content"]
        fake.add(Hang())
        with pytest.raises(TimeoutError):
            summarizer(request)
        portal.submit(client.aclose).result(timeout=ASK)


def _said(count: int, words: int) -> tuple[ContextMessage, ...]:
    return tuple(
        ContextMessage(message_id=f"m{n}", seq=n, role="user", content=f"M{n} " + "word " * words)
        for n in range(count)
    )


def test_the_provider_summarizer_fits_every_request_into_its_models_window(
    fake: FakeProvider,
) -> None:
    """Messages that do not fit one request are summarized in turn, each request
    carrying the summary so far; every request (input + max_tokens) fits the window."""
    client = ProviderClient("fake", ProviderSettings(kind="openai", base_url=fake.base_url))
    request = SummaryRequest(messages=_said(12, 300), max_tokens=2_000)  # ~4.5k tokens
    with IoPortal() as portal:
        summarizer = ProviderSummarizer(client, "small", portal, timeout_s=2.0, window=2_000)
        for n in range(1, 9):
            fake.add(Answer(text=f"summary {n}", input_tokens=100, output_tokens=n))
        text, spent_in, spent_out = summarizer(request)
        sent = [r.body for r in fake.requests]
        portal.submit(client.aclose).result(timeout=ASK)
    assert len(sent) >= 3
    assert text == f"summary {len(sent)}"
    assert (spent_in, spent_out) == (100 * len(sent), sum(range(1, len(sent) + 1)))
    for n, body in enumerate(sent):
        words = sum(estimate_text_tokens(m["content"]) for m in body["messages"])
        assert words + body["max_tokens"] <= 2_000
        assert body["max_tokens"] == 500  # a quarter of the window
        carried = f"<summary-so-far>\n| summary {n}\n</summary-so-far>"  # quoted data
        assert (carried in body["messages"][1]["content"]) == (n > 0)
    everything = "\n".join(body["messages"][1]["content"] for body in sent)
    assert all(f"M{n} " in everything for n in range(12))  # every message, in order
    assert [everything.index(f"M{n} ") for n in range(12)] == sorted(
        everything.index(f"M{n} ") for n in range(12)
    )


def test_the_provider_summarizer_cuts_a_message_bigger_than_its_window(
    fake: FakeProvider,
) -> None:
    client = ProviderClient("fake", ProviderSettings(kind="openai", base_url=fake.base_url))
    request = SummaryRequest(messages=_said(1, 5_000), max_tokens=300)
    with IoPortal() as portal:
        summarizer = ProviderSummarizer(client, "small", portal, timeout_s=2.0, window=2_000)
        fake.add(Answer(text="a summary"))
        assert summarizer(request)[0] == "a summary"
        with pytest.raises(ValueError, match="window"):  # no room for messages: refused
            ProviderSummarizer(client, "small", portal, timeout_s=2.0, window=100)
        portal.submit(client.aclose).result(timeout=ASK)
    [body] = [r.body for r in fake.requests]
    content = body["messages"][1]["content"]
    assert "too long for the summarizer's window" in content
    assert sum(estimate_text_tokens(m["content"]) for m in body["messages"]) + 300 <= 2_000


def test_decisions_that_could_not_be_recorded_are_forgotten(
    store: EventStore, clock: FakeClock
) -> None:
    raced = RacedOnce(
        store, "context:s1", ContextDagDegraded(reason="tail_over_budget", session="s1")
    )
    ref = ContextStoreActor.start(
        store=raced,  # type: ignore[arg-type]
        clock=clock,
        summarizer=ExtractiveSummarizer(),
        settings=ContextEngineSettings(fresh_tail_turns=2),
    )
    try:
        messages = history(30)
        ask_context(ref, Assemble(session_id="s1", messages=messages[:11], budget=2_500), ASK)
        raced.armed = True  # another writer wins the race for the next append
        with pytest.raises(ConcurrencyError):
            ask_context(ref, Assemble(session_id="s1", messages=messages, budget=2_500), ASK)
        reply = ask_context(ref, Assemble(session_id="s1", messages=messages, budget=2_500), ASK)
    finally:
        ref.stop()
    recorded = {
        r.event.summary_id
        for r in store.read_stream("context:s1")
        if isinstance(r.event, ContextSummaryCreated)
    }
    assert set(reply.summaries_made) <= recorded
    assert recorded  # the retry made (and recorded) the summaries the failed call lost


def test_a_session_another_writer_moved_on_is_rebuilt_not_a_conflict(
    start, store: EventStore
) -> None:  # type: ignore[no-untyped-def]
    """A worker holding a session in memory while another compacted it (the session's
    lease moved, then came back) folds what that one appended and answers the first time;
    it used to fail the turn with a conflict and answer only on the retry."""
    ref = start()
    messages = history(30)
    ask_context(ref, Assemble(session_id="s1", messages=messages[:11], budget=2_500), ASK)
    store.append("context:s1", [ContextDagDegraded(reason="tail_over_budget", session="s1")])
    reply = ask_context(ref, Assemble(session_id="s1", messages=messages, budget=2_500), ASK)
    assert reply.summaries_made
    kinds = [type(r.event).__name__ for r in store.read_stream("context:s1")]
    assert kinds.count("ContextDagDegraded") == 1  # the other writer's, folded


def test_a_wake_whose_lease_moved_on_appends_nothing_to_the_context_stream(
    start, store: EventStore
) -> None:  # type: ignore[no-untyped-def]
    """The context stream is fenced by the asking wake's lease epoch, as the session's
    is: each newer lease claims its epoch there with its first append, and a holder the
    lease left (a frozen worker that wakes up) is refused and writes nothing."""
    ref = start()
    messages = history(30)
    ask_context(ref, Assemble(session_id="s1", messages=messages[:11], budget=2_500, epoch=1), ASK)
    assert store.lease_epoch("context:s1") == 1
    ask_context(ref, Assemble(session_id="s1", messages=messages[:20], budget=2_500, epoch=2), ASK)
    assert store.lease_epoch("context:s1") == 2
    version = store.stream_version("context:s1")
    with pytest.raises(FencedError):
        ask_context(ref, Assemble(session_id="s1", messages=messages, budget=2_500, epoch=1), ASK)
    assert store.stream_version("context:s1") == version
    reply = ask_context(
        ref, Assemble(session_id="s1", messages=messages, budget=2_500, epoch=2), ASK
    )
    assert reply.messages


def test_workers_on_one_store_share_one_calibration_folded_in_log_order(
    store: EventStore, clock: FakeClock
) -> None:
    """Each report of the provider's count is recorded with the calibration stream's
    version expected; a worker whose report lost the race folds the other's and computes
    again. Both then count with the factor of every report in log order, and a worker
    that starts later starts with it."""
    profile = ModelProfile(provider="openai", model="dense")

    def worker() -> Any:
        return ContextStoreActor.start(
            store=store, clock=clock, summarizer=ExtractiveSummarizer(), settings=None
        )

    a, b = worker(), worker()
    try:
        for ref, reported in ((a, 2_000), (b, 3_000), (a, 1_500), (b, 2_500)):
            report = Calibrate(profile=profile, estimated=1_000, reported=reported)
            ask_context(ref, report, ASK)
        nothing = Calibrate(profile=profile, estimated=0, reported=0)
        later = worker()
        try:
            seen = {ask_context(ref, nothing, ASK) for ref in (a, b, later)}
        finally:
            later.stop()
    finally:
        a.stop()
        b.stop()
    reports = [r.event for r in store.read_stream("context-calibration:openai:dense")]
    assert [r.observations for r in reports] == [1, 2, 3, 4]
    folded = TokenEstimator("openai", "dense")
    for report, before in zip(reports, [1.0, *(r.factor for r in reports)], strict=False):
        # each report's raw estimate undoes the factor in force after every earlier one
        assert report.estimated == round(1_000 / before)
        assert folded.calibrate(report.estimated, report.reported) == report.factor
    assert seen == {reports[-1].factor}


def test_idle_sessions_leave_memory_and_come_back_from_the_log(
    store: EventStore, clock: FakeClock
) -> None:
    ref = ContextStoreActor.start(
        store=store,
        clock=clock,
        summarizer=ExtractiveSummarizer(),
        settings=ContextEngineSettings(fresh_tail_turns=2),
        max_sessions=2,
    )
    try:
        messages = history(30)
        first = ask_context(ref, Assemble(session_id="a", messages=messages, budget=2_500), ASK)
        for other in ("b", "c"):
            ask_context(ref, Assemble(session_id=other, messages=messages, budget=2_500), ASK)
        # "a" left memory: a record appended meanwhile is folded, not a conflict
        store.append("context:a", [ContextDagDegraded(reason="tail_over_budget", session="a")])
        again = ask_context(ref, Assemble(session_id="a", messages=messages, budget=2_500), ASK)
        assert again.messages == first.messages
        assert again.summaries_made == ()  # rebuilt from the log, nothing made twice
    finally:
        ref.stop()


def test_the_governor_is_rebuilt_in_log_order_across_a_tenants_sessions(
    start, store: EventStore, clock: FakeClock
) -> None:  # type: ignore[no-untyped-def]
    # five failures in one session, then a summary in another: the breaker is closed.
    # The streams are listed by name, the later session's first; only the log's order
    # says which came last.
    for _ in range(5):
        store.append("context:zz", [ContextSummarizerFailed(tenant="acme")])
        clock.advance(1)
    made = ContextSummaryCreated(
        summary_id="sum-1", depth=0, covers=("m1",), descendant_count=1, tenant="acme"
    )
    store.append("context:aa", [made])
    ref = start()
    reply = ask_context(
        ref, Assemble(session_id="s1", messages=history(30), budget=2_500, tenant="acme"), ASK
    )
    assert reply.summaries_made
    assert not reply.degraded  # an open breaker would have made emergency truncations
    events = [r.event for r in store.read_stream("context:s1")]
    assert not [e for e in events if isinstance(e, ContextDagDegraded)]


def test_a_steady_calibration_is_recorded_only_when_it_moves(start, store: EventStore) -> None:  # type: ignore[no-untyped-def]
    """The first reports are each recorded; later, one that moves the factor by less than
    2 % of the recorded one moves it in memory only, and one that moves it more is
    recorded again (a durable append per answered call would be the cost otherwise)."""
    ref = start()
    profile = ModelProfile(provider="openai", model="steady")

    def report(reported: int) -> float:
        estimated = round(1_000 * factor)  # calibrated as the store counts now
        return ask_context(
            ref, Calibrate(profile=profile, estimated=estimated, reported=reported), ASK
        )

    factor = 1.0
    for _ in range(CALIBRATION_WARM_UP):
        factor = report(2_000)
    stream = "context-calibration:openai:steady"
    assert store.stream_version(stream) == CALIBRATION_WARM_UP
    for _ in range(5):
        factor = report(2_010)  # a steady model: the factor creeps by a fraction of 1 %
    assert store.stream_version(stream) == CALIBRATION_WARM_UP
    factor = report(3_000)  # the tokenizer changed: a 10 % move
    assert store.stream_version(stream) == CALIBRATION_WARM_UP + 1
    newest = list(store.read_stream(stream))[-1].event
    assert (newest.factor, newest.observations) == (factor, CALIBRATION_WARM_UP + 6)


def test_a_model_name_no_stream_id_can_hold_is_calibrated_in_memory(
    start, store: EventStore
) -> None:  # type: ignore[no-untyped-def]
    ref = start()
    profile = ModelProfile(provider="openai", model="m" * 1_000)
    factor = ask_context(ref, Calibrate(profile=profile, estimated=1_000, reported=2_000), ASK)
    assert factor == 2.0
    messages = history(12)
    assert ask_context(
        ref, Assemble(session_id="s1", messages=messages, budget=2_500, profile=profile), ASK
    )
    assert not [s for s in store.streams() if s.stream.startswith("context-calibration")]
