"""A tool result larger than the model's window, end to end: a Runtime on the loopback
fake provider, a real LMDB store, an agent with a small window.

What the review found: the DAG engine (the default) already keeps every request within
the window (it cuts the largest message of the newest turn, with a ``ctx_expand``
marker) and the session answers the next message. But the result itself was recorded
whole, twice (``tool:completed`` and the tool's ``message:appended``): 5 MB of output
made 10 MB of log, 50 MB made 100 MB, a 1.1 GB process and a 10 s stall of the next
turn; and under the pipeline engine, which never cuts the newest turn, the request
carried the whole result (5 MB into a 32k window: a real provider refuses it, the turn
fails as ``context_overflow``). Now a call's result is cut at its tool's limit
(``max_result_bytes``, 50,000 bytes by default) with a marker saying how much.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.context import estimate_text_tokens
from stalwart.errors import ToolError, ToolRegistrationError
from stalwart.events import (
    ActivationBlocked,
    ContextAssembled,
    MessageAppended,
    SessionRequiresAction,
    ToolCall,
    ToolCompleted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import DEFAULT_MAX_RESULT_BYTES, ToolRegistry, run_tool
from tests._runtime_support import delivered, has, log_until, of, runtime_config, window_config

LINE = "2026-01-01 12:00:00 ok\n"  # 23 characters
LINES = 200_000  # 4.6 MB of text


def _log_text() -> str:
    return LINE * LINES


def _log_json() -> list[dict[str, Any]]:
    return [{"n": n, "level": "ok", "message": "all is well"} for n in range(LINES)]


def _request_tokens(body: dict[str, Any]) -> int:
    """What a request's messages cost, by the engine's own (high-side) estimate."""
    return estimate_text_tokens(json.dumps(body["messages"]))


def _record_size(event: ToolCompleted | MessageAppended) -> int:
    text = event.output if isinstance(event, ToolCompleted) else event.content
    return len(text.encode())


@pytest.mark.parametrize("result", [_log_text, _log_json], ids=["text", "json"])
# Was: DEFECT: a 4.6 MB result was recorded whole in tool:completed and again in its
# message:appended (9 MB of log for one call; 50 MB: 100 MB of log, 1.1 GB of memory).
def test_a_result_far_larger_than_the_window_is_recorded_cut_and_the_session_goes_on(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    result: Callable[[], Any],
) -> None:
    config = window_config(fake.base_url, window=8_192, engine="dag")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(result, name="dump_log")
        call = FakeToolCall(id="c1", name="dump_log")
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="The log says all is well."))
        session = rt.session("s1", channel="chat")
        session.send("what does the log say?")
        assert delivered(rt, chat, 1)[-1].text == "The log says all is well."
        fake.set_default(Answer(text="You are welcome."))  # a summary's answer too
        session.send("thanks")
        assert delivered(rt, chat, 2)[-1].text == "You are welcome."
    records = list(store.read_stream("session:s1"))
    [completed] = of(ToolCompleted, records)
    [tool_message] = [e for e in of(MessageAppended, records) if e.role == "tool"]
    assert tool_message.content == completed.output
    assert _record_size(completed) <= DEFAULT_MAX_RESULT_BYTES + 400  # the marker
    head = completed.output.split("\n[stalwart:")[0]
    whole = result()
    assert len(head) > 40_000
    assert (
        whole if isinstance(whole, str) else json.dumps(whole, separators=(",", ":"))
    ).startswith(head)
    assert "is longer than its limit of 50,000 bytes" in completed.output
    assert "Call the tool again with arguments that narrow it" in completed.output
    if result is _log_text:
        assert f"of its {len(_log_text()):,} characters" in completed.output
        assert f"of its {LINES:,} lines" in completed.output
        assert head.endswith("\n")  # cut on a whole line
    # the window: every request of both turns within the engine's budget
    for assembled in of(ContextAssembled, list(store.read_stream("context:s1"))):
        assert assembled.tokens_out <= assembled.budget


# Was: DEFECT: the pipeline engine sent the whole 4.6 MB result to a 32k-token model (a
# real provider refuses it: the turn failed as context_overflow, the result never read).
def test_under_the_pipeline_engine_no_request_carries_a_result_over_the_window(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    window = 32_768
    config = window_config(fake.base_url, window=window, engine="pipeline")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(_log_text, name="dump_log")
        call = FakeToolCall(id="c1", name="dump_log")
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="All is well."))
        session = rt.session("s1", channel="chat")
        session.send("what does the log say?")
        assert delivered(rt, chat, 1)[-1].text == "All is well."
        fake.set_default(Answer(text="Nothing else."))  # a summary's answer too
        session.send("anything else?")
        assert delivered(rt, chat, 2)[-1].text == "Nothing else."
    sizes = [_request_tokens(request.body) for request in fake.requests]
    assert len(sizes) >= 3
    assert max(sizes) < window, sizes
    with_result = fake.requests[1].body["messages"]
    [shown] = [m["content"] for m in with_result if m["role"] == "tool"]
    assert shown.startswith(LINE * 100)  # the model reads the head of the result


# Was: DEFECT: a ToolError's message reached the model and the log whole, however long
# (a tool that passes on an upstream error body: 2 MB in the session's message).
def test_a_tool_errors_long_message_is_cut_too() -> None:
    tools = ToolRegistry()

    @tools.register
    def fetch() -> str:
        """Fetch the page."""
        raise ToolError("upstream said: " + "<html>" * 400_000, error_class="unavailable")

    outcome = anyio.run(lambda: run_tool(tools, ToolCall(id="c1", name="fetch")))
    assert outcome.status == "error"
    assert outcome.error_class == "unavailable"
    assert outcome.text.startswith("The tool 'fetch' failed: upstream said: <html><html>")
    assert len(outcome.text.encode()) <= DEFAULT_MAX_RESULT_BYTES + 200
    whole = len("The tool 'fetch' failed: upstream said: ") + 6 * 400_000
    assert outcome.text.endswith(f"only the first 50,000 of its {whole:,} characters are shown.]")


# Was: DEFECT: a reconcile check's output (the effect a crash cut short, made text like a
# result) was recorded whole, as a result was.
def test_a_reconcile_checks_long_output_is_cut_like_a_result() -> None:
    tools = ToolRegistry()

    def found(key: str, arguments: dict[str, Any]) -> str:
        return "exported row\n" * 100_000

    @tools.register(reconcile=found)
    def export() -> str:
        """Export the rows."""
        raise AssertionError("the effect happened: the call is not run again")

    call = ToolCall(id="c1", name="export")
    outcome = anyio.run(lambda: run_tool(tools, call, reconcile=True))
    assert outcome.status == "ok"
    assert outcome.reconciled
    assert len(outcome.text.encode()) <= DEFAULT_MAX_RESULT_BYTES + 400
    assert "(3,846 of its 100,000 lines)" in outcome.text


def test_a_tool_or_its_registry_sets_its_own_limit() -> None:
    """``register(max_result_bytes=...)`` for one tool, ``ToolRegistry(max_result_bytes=...)``
    for the tools that name none; multi-byte text is cut on a whole character."""
    tools = ToolRegistry(max_result_bytes=1_000)

    @tools.register
    def small() -> str:
        """Small limit from the registry."""
        return "é" * 2_000  # 4,000 bytes

    @tools.register(max_result_bytes=10_000)
    def large() -> str:
        """Its own limit."""
        return "é" * 2_000

    def run(name: str) -> str:
        return anyio.run(lambda: run_tool(tools, ToolCall(id="c1", name=name))).text

    assert run("large") == "é" * 2_000
    cut = run("small")
    assert cut.startswith("é" * 500 + "\n[stalwart: the tool's result is longer than its limit")
    assert "only the first 500 of its 2,000 characters are shown" in cut


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "50000"])
def test_a_limit_that_is_not_a_positive_integer_is_refused(limit: Any) -> None:
    with pytest.raises(ToolRegistrationError) as caught:
        ToolRegistry().register(lambda: "", name="t", max_result_bytes=limit)
    assert caught.value.field == "max_result_bytes"
    assert caught.value.tool == "t"
    with pytest.raises(ToolRegistrationError) as caught:
        ToolRegistry(max_result_bytes=limit)
    assert caught.value.field == "max_result_bytes"


def test_many_results_of_one_turn_stay_within_the_window_and_the_session_goes_on(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Many calls each under the limit add up past the window within one turn: the DAG
    engine (the default) cuts the largest messages of the turn, with a ctx_expand marker,
    so every request stays within its budget, and the next message is answered. (The
    pipeline engine never cuts the newest turn: see docs/context-pipeline.md.)"""
    config = window_config(fake.base_url, window=8_192, engine="dag")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool
        def page(n: int) -> str:
            """One page of the report."""
            return f"page {n}: " + "figure " * 4_000  # 28 KB, under the limit

        for step in range(6):
            calls = tuple(
                FakeToolCall(id=f"c{step}-{k}", name="page", arguments={"n": step * 4 + k})
                for k in range(4)
            )
            fake.add(Answer(text="", tool_calls=calls))
        fake.add(Answer(text="The report is read."))
        session = rt.session("s1", channel="chat")
        session.send("read the whole report")
        assert delivered(rt, chat, 1)[-1].text == "The report is read."
        fake.set_default(Answer(text="It has 24 pages."))  # a summary's answer too
        session.send("how long is it?")
        assert delivered(rt, chat, 2)[-1].text == "It has 24 pages."
    assembled = of(ContextAssembled, list(store.read_stream("context:s1")))
    assert len(assembled) >= 8
    assert all(a.tokens_out <= a.budget for a in assembled)
    outputs = [e.output for e in of(ToolCompleted, list(store.read_stream("session:s1")))]
    assert len(outputs) == 24
    assert all("[stalwart:" not in text for text in outputs)


# Was: DEFECT: ctx_expand's page, bounded by expand_max_tokens, was cut again at 50,000 bytes (broken JSON, next_offset lost)  # noqa: E501
def test_the_recall_tools_limit_is_above_any_page_the_context_store_answers() -> None:
    from stalwart.actors._context_tools import context_tools
    from stalwart.config import ContextEngineSettings

    for pages in (8_000, 40_000):
        settings = ContextEngineSettings(expand_max_tokens=pages)
        tools = context_tools(None, "s1", None, settings=settings)  # type: ignore[arg-type]
        for name in ("ctx_search", "ctx_inspect", "ctx_expand"):
            tool = tools.get(name)
            assert tool is not None
            assert tool.max_result_bytes is not None
            assert tool.max_result_bytes >= max(DEFAULT_MAX_RESULT_BYTES, 8 * pages)


# Was: DEFECT: a custom tool's output the host submitted was recorded whole in tool:completed and sent to the model whole  # noqa: E501
def test_a_custom_tools_huge_output_reaches_the_model_cut_like_a_tools_own(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tools.register_custom("ask_crm", description="Look a customer up in the CRM.")
        call = FakeToolCall(id="k1", name="ask_crm", arguments={})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Found them."))
        rt.session("s1", channel="chat").send("who is a@b.c?")
        records = log_until(store, "session:s1", has(ActivationBlocked))
        [request] = of(SessionRequiresAction, records)
        huge = "customer record line\n" * 200_000  # 4.2 MB
        rt.submit_tool_result("s1", request.request_id, huge)
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "Found them."
    [completed] = of(ToolCompleted, list(store.read_stream("session:s1")))
    assert len(completed.output.encode()) <= DEFAULT_MAX_RESULT_BYTES + 1_000
    assert completed.output.startswith("customer record line\n")
    sent = fake.requests[1].body["messages"][-1]["content"]
    assert sent == completed.output
