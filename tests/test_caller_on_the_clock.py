"""A runtime's model calls keep their deadlines and backoffs on the runtime's Clock.

The stall budget, the makespan ceiling, the whole-call limit of a retry and the wait
before a retry all come from the runtime's ``Clock`` (through a scheduler timer on its
portal), as every other deadline does: on a ``FakeClock`` they fire when the test moves
time past them, never on their own. Real provider (a FakeProvider on 127.0.0.1), real
store, real runtime.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import pytest

from stalwart.actors import FAILED_TEXT, IoPortal, Scheduler, clock_timer
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.errors import CallSealedError, PromptTimeoutError
from stalwart.events import (
    ContextSummarizerFailed,
    PromptActivity,
    PromptRetryScheduled,
    PromptStarted,
    PromptTimeout,
)
from stalwart.providers import CallSeal, Message, ProviderRequest, TextDelta
from stalwart.runtime import ProviderLayer, Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, Fail, FakeProvider, Hang, Trickle
from tests._runtime_support import (
    GUARD,
    agent_settings,
    delivered,
    flush,
    has,
    log_until,
    of,
    runtime_config,
    until,
)

SESSION = "session:s1"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
#: the turn's own limit, far beyond every model deadline below
NO_EXECUTION_LIMIT = {"execution_timeout_ms": 36_000_000}


def _timeouts(store: EventStore) -> list[PromptTimeout]:
    return of(PromptTimeout, list(store.read_stream(SESSION)))


def _timed_out(store: EventStore) -> PromptTimeout:
    """The session's one ``execution:prompt_timeout``, once it is in the log."""
    (timeout,) = of(PromptTimeout, log_until(store, SESSION, has(PromptTimeout)))
    return timeout


def test_a_hung_call_is_cut_when_the_clock_passes_its_stall_budget_and_not_before(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A provider that accepts the request and never answers: the three-minute stall
    budget (the default) fires once the Clock has moved three minutes, in microseconds of
    real time, and the user is told. Before that moment, nothing is cut."""
    fake.set_default(Hang())
    cfg = runtime_config(
        fake.base_url,
        agents={"default": agent_settings(180_000)},
        supervision=NO_EXECUTION_LIMIT,
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        log_until(store, SESSION, has(PromptStarted))
        fake.wait_for(lambda requests: len(requests) == 1)
        clock.advance(179.9)
        flush(rt.portal)
        assert _timeouts(store) == []
        assert chat.messages == []
        clock.advance(0.2)
        timeout = _timed_out(store)
        assert timeout.limit == "stall"
        assert timeout.limit_ms == 180_000
        assert timeout.elapsed_ms == 180_100
        assert [m.text for m in delivered(rt, chat, 1)] == [FAILED_TEXT]
    assert len(fake.requests) == 1  # no retries configured


class _MovesTimeOnRecord:
    """The real store, with the clock moved by ``seconds`` as soon as the first event of
    type ``kind`` is durable, before its append returns: a host that moves its FakeClock
    the moment it sees that record, before the caller that wrote it has gone on."""

    def __init__(self, store: EventStore, clock: FakeClock, kind: type, seconds: float) -> None:
        self._store = store
        self._clock = clock
        self._kind = kind
        self._seconds = seconds
        self._moved = False

    def append(self, stream: str, events: Any, *args: Any, **kwargs: Any) -> Any:
        recorded = self._store.append(stream, events, *args, **kwargs)
        if not self._moved and any(isinstance(r.event, self._kind) for r in recorded):
            self._moved = True
            self._clock.advance(self._seconds)
        return recorded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_clock_moved_as_the_attempt_is_recorded_cuts_it_at_its_budget(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The clock passes the stall budget the moment ``prompt:started`` is durable
    (before the request has even left): the call is cut then, at its budget counted
    from its start, not a budget later."""
    fake.set_default(Hang())
    cfg = runtime_config(
        fake.base_url, agents={"default": agent_settings(60_000)}, supervision=NO_EXECUTION_LIMIT
    )
    moving = _MovesTimeOnRecord(store, clock, PromptStarted, 60)
    with Runtime(cfg, store=moving, clock=clock, channels={"chat": chat}) as rt:  # type: ignore[arg-type]
        rt.session("s1", channel="chat").send("hello")
        timeout = _timed_out(store)
        assert (timeout.limit, timeout.elapsed_ms) == ("stall", 60_000)
        assert [m.text for m in delivered(rt, chat, 1)] == [FAILED_TEXT]


def test_a_clock_moved_as_the_retry_is_recorded_ends_its_wait(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The clock passes a retry's 15 s wait the moment ``prompt:retry_scheduled`` is
    durable: the retry is made, because the wait was armed (counted from the decision)
    before the decision was recorded. Armed after, it would count 15 s from the moved
    clock, and the retry would wait for time that never comes."""
    fake.add(Fail(status=503, retry_after="15"))
    fake.set_default(Answer(text="after the wait"))
    agent = agent_settings(5_000, max_retries=1)
    cfg = runtime_config(fake.base_url, agents={"default": agent}, supervision=NO_EXECUTION_LIMIT)
    moving = _MovesTimeOnRecord(store, clock, PromptRetryScheduled, 15)
    with Runtime(cfg, store=moving, clock=clock, channels={"chat": chat}) as rt:  # type: ignore[arg-type]
        rt.session("s1", channel="chat").send("hello")
        assert [m.text for m in delivered(rt, chat, 1)] == ["after the wait"]
    assert len(fake.requests) == 2


def test_activity_moves_the_stall_budget_on_the_clock_until_the_makespan_ceiling(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A stream that keeps trickling deltas never stalls: each recorded activity (at the
    Clock's time) moves the 60 s stall budget on, and the stream is cut by the makespan
    ceiling (60 s x ``stall_ceiling_multiplier`` 3 = 180 s of Clock time) instead. (A
    stream that keeps trickling was cut at the ceiling before the deadlines moved to the
    Clock too: the next delta found it passed.)"""
    fake.set_default(Trickle(interval_ms=20))
    agent = agent_settings(60_000, stall_ceiling_multiplier=3)
    cfg = runtime_config(fake.base_url, agents={"default": agent}, supervision=NO_EXECUTION_LIMIT)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        (started,) = of(PromptStarted, log_until(store, SESSION, has(PromptStarted)))
        begun = clock.now()
        log_until(store, SESSION, has(PromptActivity))  # the first delta, at once
        for seen in (2, 3, 4):  # at 50, 100 and 150 s: each gap under the 60 s budget
            clock.advance(50)
            log_until(store, SESSION, has(PromptActivity, seen))
            assert _timeouts(store) == []
        clock.advance(50)  # 200 s: past the 180 s ceiling, 50 s after the last delta
        timeout = _timed_out(store)
        assert timeout.call_id == started.call_id
        assert timeout.limit == "makespan"
        assert timeout.limit_ms == 180_000
        assert timeout.elapsed_ms == round((clock.now() - begun) * 1000)
        assert [m.text for m in delivered(rt, chat, 1)] == [FAILED_TEXT]


def test_a_retry_waits_its_backoff_on_the_clock(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A 503 asking for 15 s: the retry is made once the Clock has moved 15 s (and not
    while it has not), and its answer reaches the user."""
    fake.add(Fail(status=503, retry_after="15"))
    fake.set_default(Answer(text="after the wait"))
    agent = agent_settings(5_000, max_retries=1)
    cfg = runtime_config(fake.base_url, agents={"default": agent}, supervision=NO_EXECUTION_LIMIT)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        (retry,) = of(PromptRetryScheduled, log_until(store, SESSION, has(PromptRetryScheduled)))
        assert retry.delay_ms == 15_000
        clock.advance(14.9)
        flush(rt.portal)
        assert len(fake.requests) == 1
        clock.advance(0.2)
        assert [m.text for m in delivered(rt, chat, 1)] == ["after the wait"]
    assert len(fake.requests) == 2


@pytest.mark.parametrize("hung_retry", [True, False], ids=["hung", "answered"])
def test_a_retry_has_the_whole_call_limit_on_the_clock(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    hung_retry: bool,
) -> None:
    """The retry of a failed first attempt has the shorter whole-call limit
    (``retry_prompt_timeout_ms``), on the Clock: a retry that hangs is cut when the Clock
    passes it; one that answers in time is not cut by the first attempt's timers."""
    fake.add(Fail(status=503, retry_after="1"))
    fake.set_default(Hang() if hung_retry else Answer(text="in time"))
    agent = agent_settings(180_000, max_retries=1) | {"retry_prompt_timeout_ms": 20_000}
    cfg = runtime_config(fake.base_url, agents={"default": agent}, supervision=NO_EXECUTION_LIMIT)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        log_until(store, SESSION, has(PromptRetryScheduled))
        clock.advance(1)
        log_until(store, SESSION, has(PromptStarted, 2))
        if not hung_retry:
            assert [m.text for m in delivered(rt, chat, 1)] == ["in time"]
            clock.advance(200)  # past every limit either attempt had
            flush(rt.portal)
            assert _timeouts(store) == []
            return
        fake.wait_for(lambda requests: len(requests) == 2)
        clock.advance(19.9)
        flush(rt.portal)
        assert _timeouts(store) == []
        clock.advance(0.2)
        timeout = _timed_out(store)
        assert (timeout.limit, timeout.limit_ms) == ("retry_deadline", 20_000)
        assert [m.text for m in delivered(rt, chat, 1)] == [FAILED_TEXT]


def test_a_hung_summary_fails_when_the_clock_passes_its_bound(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The context engine's summarizer call (the ``default`` agent's model) is bounded
    by ``summarizer_breaker.half_open_timeout_ms`` on the Clock too: a summary whose
    provider never answers fails when the clock passes 20 s, not before, and the turn
    goes on without it."""
    worker = agent_settings(model="worker", context_window=3_000, max_tokens=200)
    cfg = runtime_config(
        fake.base_url,
        agents={"default": agent_settings(model="summarizer"), "worker": worker},
        context_engine={
            "fresh_tail_turns": 2,
            "summarizer_breaker": {"half_open_timeout_ms": 20_000},
        },
        supervision=NO_EXECUTION_LIMIT,
    )
    fake.set_default(Hang())  # the summarizer's requests: the worker's are scripted
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", agent="worker", channel="chat")

        def summarizing() -> bool:
            return any(r.model == "summarizer" for r in fake.requests)

        turn = 0
        while not summarizing():
            assert turn < 12, "the engine never asked for a summary"
            fake.add(Answer(model="worker", text=f"noted {turn}. " + "words " * 150))
            session.send(f"fact {turn}: " + "detail " * 150)
            turn += 1
            until(lambda n=turn: len(chat.messages) >= n or summarizing())
        clock.advance(19.9)
        flush(rt.portal)
        assert not of(ContextSummarizerFailed, list(store.read_stream("context:s1")))
        clock.advance(0.2)
        failed = of(
            ContextSummarizerFailed, log_until(store, "context:s1", has(ContextSummarizerFailed))
        )
        assert failed[0].error_class == "TimeoutError"
        delivered(rt, chat, turn)  # the turn went on without the summary


def test_a_seal_waits_for_the_append_under_way_and_refuses_every_later_one() -> None:
    """The turn's seal of its model call: an append already under way lands before the
    seal returns (so before the turn's end), and every later one is refused; an attempt
    may not begin once the turn's time is up, even before the seal."""
    seal = CallSeal(not_after=100.0)
    assert seal.may_begin(99.9)
    assert not seal.may_begin(100.0)
    seal.enter()  # an append of the call, under way
    sealed = threading.Event()
    sealer = threading.Thread(target=lambda: seal.seal(GUARD) and sealed.set())
    sealer.start()
    assert not sealed.wait(0.2)  # real-time: the seal waits for the append under way
    seal.leave()
    sealer.join(GUARD)
    assert sealed.is_set()
    with pytest.raises(CallSealedError):
        seal.enter()
    assert not seal.may_begin(0.0)
    assert CallSeal().seal(0.0)  # nothing under way: at once


def test_a_delta_read_after_the_clock_passed_the_stall_budget_does_not_save_the_call(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """The clock passes a trickling call's 60 s stall budget just as the loop reads its
    next delta (the timer's cut is queued behind it on the loop). That delta came after
    the limit: the call is cut at the moment the clock got there, as the pure decision
    says, not given a new budget by the late delta (whose re-arming would make the
    queued cut stale)."""
    fake.set_default(Trickle(interval_ms=20))
    cfg = runtime_config(fake.base_url, agents={"default": agent_settings(60_000)})
    deltas = 0

    def on_event(event: object) -> None:
        nonlocal deltas
        if isinstance(event, TextDelta):
            deltas += 1
            if deltas == 3:  # on the loop, just before this delta's activity is looked at
                clock.advance(61)

    with IoPortal() as portal, Scheduler(clock) as scheduler:
        layer = ProviderLayer(cfg, store, clock=clock)
        caller = layer.caller(timer=partial(clock_timer, portal, scheduler, clock))
        try:
            future = portal.submit(partial(caller.call, on_event=on_event), SESSION, REQUEST)
            with pytest.raises(PromptTimeoutError):
                future.result(GUARD)
        finally:
            portal.submit(layer.aclose).result(GUARD)
    (timeout,) = _timeouts(store)
    assert (timeout.limit, timeout.elapsed_ms) == ("stall", 61_000)
