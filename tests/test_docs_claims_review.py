"""A claims audit of docs/resilience.md, docs/scheduler.md, docs/tools.md and
docs/channels.md: each test pins one documented claim no other test pinned, on real
parts (an LMDB store in tmp_path, the fake provider over loopback HTTP, a FakeClock
driving every deadline, MemoryChannels, a Scheduler and an IoPortal).

A test that fails names the defect in its docstring ("Defect"), what the document
says ("Claim") and where the cause lies.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any, cast

import anyio
import pytest

from stalwart.actors import (
    TIMED_OUT_SENTENCE,
    DeadLetterActor,
    Enqueue,
    HealthReport,
    InFlight,
    IoPortal,
    PollHealth,
    ProviderHealthActor,
    QueueState,
    Scheduler,
    clock_timer,
    failure_notice,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings, HealthSettings, parse_config
from stalwart.errors import ConfigError
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
    SubagentCompleted,
    ToolCall,
    ToolFailed,
    ToolStarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import (
    ToolRegistry,
    classify_tool_error,
    decide_tool_call,
    fold_tool_breaker,
    run_tools,
)
from tests._runtime_support import GUARD, has, log_until, of, until

# -- docs/tools.md ----------------------------------------------------------------------------


def test_a_sub_agent_calling_a_tool_that_needs_approval_is_told_no_one_can_approve(
    rt: Runtime, store: EventStore, fake: FakeProvider
) -> None:
    """Claim (docs/tools.md:65-68): where nobody can be asked (a sub-agent run's model), a
    call to a ``needs_confirmation`` tool is not run; the model reads that it needs a
    person (``tool:failed`` ``needs_human``), so the run goes on instead of waiting for an
    approval nobody will give."""
    ran: list[int] = []

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        ran.append(order)
        return "refunded"

    call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="I could not refund it."))
    rt.session("p1", channel="chat")
    handle = rt.spawn("p1", "refund order 7", task_class="code", announce=False)
    stream = f"session:{handle.run_id}"
    records = log_until(store, stream, has(SubagentCompleted))
    [failed] = of(ToolFailed, records)
    assert (failed.call_id, failed.error_class) == ("c1", "needs_human")
    assert ran == []
    [completed] = of(SubagentCompleted, records)
    assert (completed.outcome, completed.result) == ("succeeded", "I could not refund it.")
    tool_message = fake.requests[-1].body["messages"][-1]
    assert tool_message["role"] == "tool"
    assert "approval" in tool_message["content"]


def test_a_calls_time_limit_starts_when_it_gets_its_turn_not_while_it_waits(
    clock: FakeClock,
) -> None:
    """Claim (docs/tools.md:129-130): ``run_tools`` runs at most ``limit`` calls at once,
    and "a call's timeout starts when it gets its turn". Under a FakeClock timer (what the
    runtime's Agents pass), a call that waits 5 s for its turn behind a slow one still has
    its whole 1 s limit when it runs."""
    registry = ToolRegistry()
    entered = threading.Event()
    release = anyio.Event()

    @registry.register(timeout_ms=10_000)
    async def slow() -> str:
        entered.set()
        await release.wait()
        return "slow done"

    @registry.register(timeout_ms=1_000)
    async def quick() -> str:
        return "quick done"

    calls = [ToolCall(id="a", name="slow", arguments=""), ToolCall(id="b", name="quick")]
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        timer = partial(clock_timer, portal, scheduler, clock)

        async def go() -> Any:
            return await run_tools(registry, calls, limit=1, clock=clock, timer=timer)

        outcomes = portal.submit(go)
        assert entered.wait(GUARD)
        clock.advance(5)  # 'quick' has waited 5 s for its turn: more than its own limit
        assert not outcomes.done()
        portal.call_soon(release.set)
        slow_outcome, quick_outcome = outcomes.result(GUARD)
    assert (slow_outcome.status, slow_outcome.text) == ("ok", "slow done")
    assert (quick_outcome.status, quick_outcome.text) == ("ok", "quick done")


def test_a_wrapped_first_docstring_paragraph_becomes_a_one_line_description() -> None:
    """Claim (docs/tools.md:62): the description defaults to the first paragraph of the
    docstring, on one line."""
    registry = ToolRegistry()

    @registry.register
    def search(query: str) -> list[str]:
        """Search the team's
        documents, newest first.

        Only the first paragraph becomes the description.
        """
        return []

    [spec] = registry.specs()
    assert spec.description == "Search the team's documents, newest first."


class BackendForbidden(Exception):  # how an SDK may name a 403
    pass


class AuthenticationFailed(Exception):
    pass


class Unauthorized(Exception):
    pass


class ItemNotFound(Exception):
    pass


class RateLimitExceeded(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (NotADirectoryError(), ("not_found", "alternative")),
        (BackendForbidden(), ("permission_denied", "alternative")),
        (Unauthorized(), ("unauthorized", "alternative")),
        (AuthenticationFailed(), ("unauthorized", "alternative")),
        (ItemNotFound(), ("not_found", "alternative")),
        (RateLimitExceeded(), ("rate_limited", "retry")),
        (OSError(errno.ETIMEDOUT, "timed out"), ("timeout", "retry")),
        (OSError(errno.EPERM, "not permitted"), ("permission_denied", "alternative")),
        (SystemExit(2), ("exited", "surface")),
    ],
)
def test_the_error_class_table_rows_no_other_test_names(
    exc: BaseException, expected: tuple[str, str]
) -> None:
    """Claim (docs/tools.md:172-185): the error-class table, for the rows
    tests/test_tool_breaker.py leaves out. A wrong class sends the model the wrong advice
    and moves the wrong breaker count."""
    assert classify_tool_error(exc) == expected


def _failed_calls(tool: str, arguments: str, error_class: str, count: int) -> list[Any]:
    events: list[Any] = []
    for n in range(count):
        call_id = f"{tool}-{n}"
        events.append(ToolStarted(call_id=call_id, tool=tool, arguments=arguments))
        events.append(ToolFailed(call_id=call_id, tool=tool, error_class=error_class))
    return events


def test_the_most_specific_rule_is_checked_first() -> None:
    """Claim (docs/tools.md:204-211): the three rules are checked "the most specific first":
    ``same_call``, then ``error_pattern``, then ``same_tool``. The rule named in
    ``tool:blocked`` (and the sentence the model reads) is the most specific one reached."""
    state = fold_tool_breaker(_failed_calls("fs", '{"p": "/x"}', "permission_denied", 2))
    both = decide_tool_call(state, "fs", '{"p":"/x"}', same_call=2, per_pattern=2, per_tool=2)
    assert both is not None
    assert both.rule == "same_call"
    other_args = decide_tool_call(state, "fs", '{"p":"/y"}', same_call=2, per_pattern=2, per_tool=2)
    assert other_args is not None
    assert (other_args.rule, other_args.pattern) == ("error_pattern", "permission_denied")


@pytest.mark.parametrize("error_class", ["denied", "unreconciled", "interrupted", "needs_human"])
def test_calls_that_were_not_run_never_count_toward_a_block(error_class: str) -> None:
    """Claim (docs/tools.md:217-221): calls that were not run (a user's denial, a call a
    crash cut short, one an interrupt closed, one that needed a human nobody could ask)
    never count: five of them in a row, with the same arguments, block nothing."""
    state = fold_tool_breaker(_failed_calls("refund", '{"order": 7}', error_class, 5))
    assert decide_tool_call(state, "refund", '{"order":7}') is None
    assert (state.same_call, state.per_tool, state.patterns) == ({}, {}, {})


# -- docs/resilience.md: the dead-letter queue -------------------------------------------------


@pytest.fixture
def parts(clock: FakeClock) -> Iterator[tuple[Scheduler, IoPortal]]:
    with Scheduler(clock) as scheduler, IoPortal() as portal:
        yield scheduler, portal


def test_an_announcement_queued_again_keeps_its_one_entry(
    lmdb_store: EventStore, clock: FakeClock, parts: tuple[Scheduler, IoPortal]
) -> None:
    """Claim (docs/resilience.md:129-132): "An announcement already queued with retries
    left is not queued again: the ``ask`` replies with its entry's id", so a sender that
    tries again, or a resend that fails again, does not make the user receive it twice.
    Checked with the queue's retries failing in between: one entry, one delivery."""
    scheduler, portal = parts
    chat = MemoryChannel("chat")
    ref = DeadLetterActor.start(
        store=lmdb_store, clock=clock, scheduler=scheduler, portal=portal,
        channels={"chat": chat}, settings=DeadLetterSettings(),
    )  # fmt: skip
    try:
        enqueue = Enqueue("ann-1", "chat", "conv-1", "the late answer", "server_error")
        first = ref.ask(enqueue, timeout=GUARD)
        assert ref.ask(enqueue, timeout=GUARD) == first
        chat.fail_next(1)
        clock.advance(30)  # the first retry, which fails
        until(lambda: not ref.ask(InFlight(), timeout=GUARD) and chat.attempted)
        again = ref.ask(enqueue, timeout=GUARD)  # e.g. a resend that failed again
        assert again == first
        other = ref.ask(Enqueue("ann-2", "chat", "conv-1", "other", "timeout"), timeout=GUARD)
        assert other != first
        clock.advance(60)  # the second retry of ann-1 (and the first of ann-2)
        records = log_until(lmdb_store, "deadletter", has(AnnouncementDeadLetterDelivered, 2))
        queued = of(AnnouncementDeadLettered, records)
        assert [q.announcement_id for q in queued] == ["ann-1", "ann-2"]
        assert sorted(m.text for m in chat.messages) == ["other", "the late answer"]
    finally:
        ref.stop(block=True, timeout=GUARD)


def test_a_held_queue_looks_again_when_no_drain_ever_comes(
    lmdb_store: EventStore, clock: FakeClock, parts: tuple[Scheduler, IoPortal]
) -> None:
    """Claim (docs/resilience.md:150-152): while a provider is degraded no scheduled retry
    is spent, "and the queue looks again every ``retry_base_ms`` in case a recovery never
    comes". A degradation that ends without a ``Drain`` (the listener missed it) must not
    leave the entry waiting for its one-hour expiry."""
    scheduler, portal = parts
    chat = MemoryChannel("chat")
    degraded = threading.Event()
    degraded.set()
    ref = DeadLetterActor.start(
        store=lmdb_store, clock=clock, scheduler=scheduler, portal=portal,
        channels={"chat": chat}, settings=DeadLetterSettings(), any_degraded=degraded.is_set,
    )  # fmt: skip
    try:
        ref.ask(Enqueue("ann-1", "chat", "conv-1", "the late answer", "timeout"), timeout=GUARD)
        for _ in range(10):  # five minutes degraded: nothing is tried, nothing spent
            clock.advance(30)
        ref.ask(QueueState(), timeout=GUARD)
        assert chat.attempted == []
        assert not of(AnnouncementDeadLetterRetried, list(lmdb_store.read_stream("deadletter")))
        degraded.clear()  # recovered, but no Drain reaches the queue
        clock.advance(30)  # one retry_base_ms later the queue looks again
        until(lambda: chat.messages)
        assert [m.text for m in chat.messages] == ["the late answer"]
        [retried] = of(AnnouncementDeadLetterRetried, list(lmdb_store.read_stream("deadletter")))
        assert (retried.attempt, retried.reason) == (1, "backoff")
    finally:
        ref.stop(block=True, timeout=GUARD)


# -- docs/scheduler.md -------------------------------------------------------------------------


def test_a_callback_that_cancels_a_timer_due_in_the_same_tick_stops_it(clock: FakeClock) -> None:
    """Claim (docs/scheduler.md:48-49): a callback may cancel timers. A watchdog's callback
    that cancels the ghost timer due at the same advance must stop it from firing."""
    fired: list[str] = []
    with Scheduler(clock) as scheduler:
        later = scheduler.schedule(clock.now() + 2, lambda at: fired.append("later"))

        def first(at: float) -> None:
            fired.append("first")
            assert later.cancel()

        scheduler.schedule(clock.now() + 1, first)
        clock.advance(5)
        assert fired == ["first"]
        assert later.state == "cancelled"
        assert scheduler.pending() == 0


# -- docs/channels.md --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_attempts", 101), ("max_attempts", 0), ("retry_cap_ms", 0), ("timeout_ms", -1)],
)
def test_a_webhook_knob_out_of_range_names_its_key(field: str, value: int) -> None:
    """Claim (docs/channels.md:166, 174-175): ``max_attempts`` is 1..100; out-of-range
    values are a ConfigError that names the key (``channels.ops.<knob>``)."""
    entry = {"kind": "webhook", "url": "https://hooks.example/x", field: value}
    with pytest.raises(ConfigError) as info:
        parse_config({"channels": {"ops": entry}})
    assert info.value.key == f"channels.ops.{field}"
    assert f"channels.ops.{field}" in str(info.value)


# -- docs/resilience.md: the sub-agent failure notice ------------------------------------------


def test_the_failure_notice_quotes_at_most_60_characters_of_the_task() -> None:
    """Claim (docs/resilience.md, failure notice): the notice quotes the task in at most
    60 characters: a longer one as its first 57 and "...", white space runs as one space.
    (The document used to promise "the first 60 characters", three more than shown.)"""
    task = "Research the quarterly revenue numbers of every subsidiary and write a report"
    notice = failure_notice(task, "timed_out", 120_000)
    assert notice == f'Sub-agent task "{task[:57]}...": {TIMED_OUT_SENTENCE} (ran 2m 00s)'
    short = failure_notice("Sum   the\ninvoices", "timed_out", 120_000)
    assert short.startswith('Sub-agent task "Sum the invoices": ')


# -- docs/resilience.md: provider health -------------------------------------------------------


def test_failures_after_the_recovering_success_degrade_again_in_the_same_catch_up(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    """Claim (docs/resilience.md:59-62): a recovery forgives the episode's failures "but
    not those recorded after the success that recovered it: folded together with it (one
    catch-up), they degrade the provider again at once, as they would have one by one".
    An outage that resumes right after one lucky success must not read as healthy."""
    stream = "provider:main"

    def record(*events: Any) -> None:
        lmdb_store.append(stream, [NewEvent(event=e, ts=clock.now()) for e in events])

    def failed(agent: str) -> ProviderCallFailed:
        return ProviderCallFailed(
            provider="main", model="m1", agent=agent, error_class="server_error"
        )

    with Scheduler(clock) as scheduler:
        ref = ProviderHealthActor.start(
            lmdb_store, clock, scheduler, "main", HealthSettings(), (), None, follow=False
        )
        try:
            record(failed("a"), failed("b"))
            degraded = cast(HealthReport, ref.ask(PollHealth(), timeout=GUARD))
            assert degraded.status == "degraded"
            clock.advance(1)
            # one catch-up: a success, then the outage again from two agents
            record(
                ProviderCallSucceeded(provider="main", model="m1", agent="a"),
                failed("a"),
                failed("b"),
            )
            report = cast(HealthReport, ref.ask(PollHealth(), timeout=GUARD))
            decisions = [
                r.event
                for r in lmdb_store.read_stream(stream)
                if isinstance(r.event, (ProviderDegraded, ProviderRecovered))
            ]
            assert [type(d).__name__ for d in decisions] == [
                "ProviderDegraded",
                "ProviderRecovered",
                "ProviderDegraded",
            ]
            assert (decisions[1].rule, decisions[2].rule) == ("success", "agents")
            assert report.status == "degraded"
        finally:
            ref.stop(block=True, timeout=GUARD)
