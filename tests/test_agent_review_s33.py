"""Review s33 of the Agent actor (a session's turn loop): defects proven by tests that
failed before their fix (each carries a ``# Was: DEFECT:`` line).

Real parts throughout: an LMDB store in ``tmp_path``, the fake provider over loopback
HTTP, the runtime on a ``FakeClock`` that no test advances unless it says so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from stalwart.actors import EMPTY_ANSWER_TEXT, TIMEOUT_TEXT, UNRECONCILED_TEXT
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationBlocked,
    ExecutionAborted,
    MessageAppended,
    SessionRequiresAction,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import (
    GUARD,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
    settled,
    until,
)


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end of the test: a sync tool blocked on it ends (its thread is left
    running by the timeout that abandoned it)."""
    event = threading.Event()
    try:
        yield event
    finally:
        event.set()


# Was: DEFECT: an execution timeout left its running calls open; the next message ran them again
def test_a_call_the_execution_timeout_cut_short_is_closed_with_its_turn_never_run_again(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    released: threading.Event,
) -> None:
    # the aborted turn recorded no result for its running call, so the next wake (an
    # unrelated message) took the call for one a crash cut short: it asked the tool's
    # check (the call was still running on its thread, so "not done") and ran the payment
    # a second time, concurrently, after the user had been told "so I stopped"
    config = runtime_config(fake.base_url, supervision={"execution_timeout_ms": 20_000})
    payments: list[int] = []
    checks: list[str] = []
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

        def paid(key: str, arguments: dict[str, object]) -> str | None:
            checks.append(key)
            return None  # the payment provider has not seen it (yet)

        @rt.tool(timeout_ms=120_000, reconcile=paid)
        def pay(amount: int) -> str:
            """Pay an amount."""
            payments.append(amount)
            if len(payments) == 1:  # the first payment hangs past the turn's limit
                released.wait(GUARD)
            return "paid"

        call = FakeToolCall(id="c1", name="pay", arguments={"amount": 5})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="It is sunny."))
        session = rt.session("s1", channel="chat")
        session.send("pay 5")
        log_until(store, "session:s1", has(ToolStarted))
        until(lambda: payments, what="the payment to be running")  # on its tool thread
        clock.advance(21)  # the turn's limit passes while the payment runs (not the lease's)
        assert [m.text for m in delivered(rt, chat, 1)] == [TIMEOUT_TEXT]
        settled(store, "s1")
        session.send("how is the weather?")
        assert delivered(rt, chat, 2)[1].text == "It is sunny."
        settled(store, "s1")
        assert (payments, checks) == ([5], [])
    records = list(store.read_stream("session:s1"))
    aborted = next(i for i, r in enumerate(records) if isinstance(r.event, ExecutionAborted))
    ended = next(i for i, r in enumerate(records) if isinstance(r.event, TurnCompleted))
    closing = records[aborted:ended]
    [failed] = of(ToolFailed, closing)
    assert (failed.call_id, failed.error_class) == ("c1", "unreconciled")
    [result] = [e for e in of(MessageAppended, closing) if e.role == "tool"]
    assert (result.tool_call_id, result.content) == ("c1", UNRECONCILED_TEXT)
    assert len(of(ToolFailed, records)) == 1  # the next wake found nothing to resume
    report = verify_store(store, None)  # replay --verify: every decision follows
    assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]


# Was: DEFECT: a call with invalid arguments paused the session for an approval it could not use
def test_a_call_whose_arguments_cannot_run_asks_no_human_and_the_model_reads_why(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # the Agent paused for the first call of a tool that needs a person whatever its
    # arguments: the operator was asked to approve `{"order": "seven"}` (or JSON cut
    # short), and an approval then ran nothing (`invalid_arguments`) and asked again for
    # the model's corrected call; a host tool's request carried input it could not use
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            return "refunded"

        rt.tools.register_custom("lookup", description="Look an order up.")
        wrong = (
            FakeToolCall(id="c1", name="refund", arguments={"order": "seven"}),
            FakeToolCall(id="c2", name="lookup", arguments='{"order": 7'),
        )
        right = FakeToolCall(id="c3", name="refund", arguments={"order": 7})
        fake.add(Answer(text="", tool_calls=wrong), Answer(text="", tool_calls=(right,)))
        rt.session("s1", channel="chat").send("refund order 7")
        records = log_until(store, "session:s1", has(ActivationBlocked))
    [request] = of(SessionRequiresAction, records)
    assert (request.tool, request.arguments) == ("refund", '{"order":7}')
    failed = {e.call_id: e.error_class for e in of(ToolFailed, records)}
    assert failed == {"c1": "invalid_arguments", "c2": "invalid_arguments"}
    [step] = [r.body["messages"] for r in fake.requests][1:]
    results = [m for m in step if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == ["c1", "c2"]
    assert all("invalid" in m["content"] for m in results)


# Was: DEFECT: an answer of only blank lines was sent to the user as a blank message
def test_an_answer_of_only_whitespace_is_no_answer(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # `response.text or EMPTY_ANSWER_TEXT` let "\n\n" through: the user saw an empty
    # message (a chat platform refuses one: the send failed and went to the dead letters)
    fake.add(Answer(text="\n \n\n", chunks=1))
    rt.session("s1", channel="chat").send("hello?")
    [reply] = delivered(rt, chat, 1)
    assert reply.text == EMPTY_ANSWER_TEXT
    settled(store, "s1")
    messages = of(MessageAppended, list(store.read_stream("session:s1")))
    [answer] = [e for e in messages if e.role == "assistant"]
    assert answer.content == "\n \n\n"  # the model's own words stay as they came
