"""Tools, third review: what a tool raises on its worker thread, a crash's reconcile
check, and parameter names, tried against what docs/tools.md promises.

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the
fake clock, a MemoryChannel; tools are plain host functions. A test with a
``# Was: DEFECT:`` line failed on the code it was written against (fixed since).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.errors import ToolRegistrationError
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    MessageAppended,
    RecordedEvent,
    SessionCreated,
    ToolCall,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, Fence
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import ToolRegistry, run_tool
from tests._runtime_support import GUARD, advance_until, delivered, log_until, of, runtime_config


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets a blocked check's thread finish when the test is done."""
    event = threading.Event()
    yield event
    event.set()


# -- what a tool raises must end its call, never the runtime's event loop -------------------


def _raises(kind: type[BaseException], sync: bool) -> Any:
    if sync:

        def quit_repl() -> str:
            """Leave the interactive console."""
            raise kind

        return quit_repl

    async def quit_repl_async() -> str:
        """Leave the interactive console."""
        raise kind

    return quit_repl_async


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kind", "sync"),
    [(KeyboardInterrupt, True), (KeyboardInterrupt, False), (GeneratorExit, True)],
)
def test_a_tool_raising_an_interrupt_ends_its_call_not_every_session(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    kind: type[BaseException],
    sync: bool,
) -> None:
    """docs/tools.md: "None of them reaches the runtime's event loop or the other calls of
    the step". A tool (a console or REPL wrapper, a library's own handler) raises
    ``KeyboardInterrupt`` or ``GeneratorExit``. Neither can be the runtime's: Ctrl-C is
    delivered to the main thread only, and a sync tool's worker thread closes no
    coroutine. The call ends as an ``error``, its session answers, another still works."""
    # Was: DEFECT: run_tool re-raised both; the portal's task group died with them: every
    # session of the process stopped ("This portal is not running"), stop() raised too.
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        tool = _raises(kind, sync)
        rt.tool(tool, name="quit_repl")
        call = FakeToolCall(id="c1", name="quit_repl", arguments={})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="The console is closed."))
        rt.session("s1", channel="chat").send("close the console")
        assert [m.text for m in delivered(rt, chat, 1)] == ["The console is closed."]
        fake.add(Answer(text="Still here."))
        rt.session("s2", channel="chat").send("are you there?")
        assert delivered(rt, chat, 2)[-1].text == "Still here."
    failed = of(ToolFailed, list(store.read_stream("session:s1")))
    assert [(e.tool, e.error_class) for e in failed] == [("quit_repl", "exception")]


def test_a_sync_tools_generator_exit_is_an_outcome_of_run_tool() -> None:
    """The same through the public :func:`run_tool` on a host's own event loop."""
    # Was: DEFECT: the tool's GeneratorExit, raised on its worker thread, escaped run_tool.
    tools = ToolRegistry()

    @tools.register
    def close_cursor() -> str:
        """Close the cursor."""
        raise GeneratorExit

    outcome = anyio.run(lambda: run_tool(tools, ToolCall(id="c1", name="close_cursor")))
    assert (outcome.status, outcome.error_class) == ("error", "exception")
    assert outcome.text == "The tool 'close_cursor' failed: it raised an unexpected error."


# -- a crash's reconcile check: its output is recorded like a result --------------------------


def _crashed_while_exporting(store: EventStore, clock: FakeClock) -> None:
    """The log a process leaves when it dies while ``export`` runs."""
    export = ToolCall(id="c1", name="export", arguments='{"report":7}')
    events = [
        SessionCreated(agent="default", channel="chat"),
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="export 7"),
        ActivationLeased(activation_id="a1", owner="dead", epoch=1, expires_at=clock.now() - 1),
        TurnStarted(turn_id="t1", trigger="message"),
        MessageAppended(message_id="m1", role="user", content="export 7", turn_id="t1"),
        MessageAppended(message_id="x", role="assistant", tool_calls=(export,), turn_id="t1"),
        ToolStarted(
            call_id="c1",
            tool="export",
            arguments='{"report":7}',
            idempotency_key="session:s1/c1",
            turn_id="t1",
        ),
    ]
    store.append("session:s1", events, fence=Fence(1, claim=True))


def _settled(records: list[RecordedEvent]) -> bool:
    return any(isinstance(r.event, ActivationAcked | ActivationRequeued) for r in records)


@pytest.mark.timeout(60)
def test_a_reconcile_checks_undecodable_file_name_does_not_crash_the_agent(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """docs/sessions.md: after a crash a call cut short is checked by its tool's
    ``reconcile``, whose answer is the call's output. A check that answers with the file
    the export wrote, named by ``os.listdir`` (a name that is not UTF-8 has lone
    surrogates), is recorded like a tool's own ``str`` result: made valid Unicode."""
    # Was: DEFECT: run_tool passed str(found) on unscrubbed; the Agent could not encode its
    # tool:completed and crashed (activation:requeued agent_crashed) on every resume.
    _crashed_while_exporting(store, clock)
    runs: list[int] = []

    def exported(key: str, arguments: dict[str, Any]) -> str | None:
        return "wrote report-\udcff.csv"  # what os.listdir gives for b"report-\xff.csv"

    fake.add(Answer(text="The report is exported."))
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        @rt.tool(reconcile=exported)
        def export(report: int) -> str:
            """Export a report to the shared drive."""
            runs.append(report)
            return f"exported {report}"

        records = log_until(store, "session:s1", _settled)
    assert [e.error_class for e in of(ActivationRequeued, records)] == []
    done = of(ToolCompleted, records)
    assert [(e.output, e.reconciled) for e in done] == [("wrote report-\ufffd.csv", True)]
    assert runs == [], "the effect was found: the call is not run again"


def test_a_reconcile_checks_non_text_answer_is_json_like_a_result() -> None:
    """A check that answers with what the effect left (a record, not text) gives the
    model the same JSON a tool's own result of that value would."""
    # Was: DEFECT: str(found) gave the model Python's repr ({'id': 7, 'ok': True}).
    tools = ToolRegistry()

    def check(key: str, arguments: dict[str, Any]) -> Any:
        return {"id": 7, "ok": True}

    @tools.register(reconcile=check)
    def export(report: int) -> str:
        """Export a report."""
        return "ran"

    call = ToolCall(id="c1", name="export", arguments='{"report":7}')
    outcome = anyio.run(lambda: run_tool(tools, call, reconcile=True))
    assert (outcome.status, outcome.text, outcome.reconciled) == ("ok", '{"id":7,"ok":true}', True)


def _requests_text(fake: FakeProvider, call_id: str) -> list[str]:
    """What the model read for ``call_id`` in the latest request it got."""
    body = fake.requests[-1].body
    return [
        m["content"]
        for m in body["messages"]
        if m.get("role") == "tool" and m.get("tool_call_id") == call_id
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raises", "hangs"])
def test_a_reconcile_check_that_cannot_tell_surfaces_the_call_never_offers_a_retry(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    release: threading.Event,
    how: str,
) -> None:
    """docs/sessions.md: a call a crash cut short is checked by its tool's ``reconcile``;
    where nothing can say whether the effect happened, the call is "surfaced, not re-run:
    tool:failed unreconciled, and the model reads that the call may or may not have taken
    effect". A check that raises (the drive's API is down) or hangs past the tool's
    limit cannot say: the model must not read "Trying again may work" for an export that
    may have been made (a second one is a duplicate; for a payment, a double charge)."""
    # Was: DEFECT: the check's ConnectionError / its time limit became the call's own
    # connection / timeout failure (retryable): the model read "Trying again may work".
    _crashed_while_exporting(store, clock)
    runs: list[int] = []

    def exported(key: str, arguments: dict[str, Any]) -> str | None:
        if how == "raises":
            raise ConnectionError("drive.internal:443 refused (token sk-live-123)")
        release.wait(GUARD)  # the drive's API hangs
        return None

    fake.add(Answer(text="I cannot tell whether the export ran."))
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        @rt.tool(timeout_ms=5_000, reconcile=exported)
        def export(report: int) -> str:
            """Export a report to the shared drive."""
            runs.append(report)
            return f"exported {report}"

        records = advance_until(clock, lambda: _acked(store), 1.0)
    failed = of(ToolFailed, records)
    assert [(e.error_class, e.retryable, e.timed_out) for e in failed] == [
        ("unreconciled", False, how == "hangs")
    ]
    (text,) = _requests_text(fake, "c1")
    assert "may or may not have taken effect" in text
    assert "sk-live" not in text
    assert "Trying again" not in text
    assert runs == []


def _acked(store: EventStore) -> list[RecordedEvent] | None:
    records = list(store.read_stream("session:s1"))
    return records if _settled(records) else None


# -- parameter names a msgspec Struct cannot hold ---------------------------------------------


@pytest.mark.parametrize("parameter", ["__cursor", "__dict__", "__slots__"])
def test_a_parameter_name_no_struct_can_hold_is_a_registration_error(parameter: str) -> None:
    """docs/tools.md: "A registration that cannot work raises ToolRegistrationError at
    once, with field naming what was wrong". ``def page(query, __cursor=None)`` (PEP 484's
    old spelling of a positional-only parameter) cannot become an arguments Struct."""
    # Was: DEFECT: msgspec.defstruct's own RuntimeError / TypeError / ValueError escaped
    # register() raw ("Failed to get offset for '__cursor'").
    namespace: dict[str, Any] = {}
    exec(f"def page(query: str, {parameter}: int = 0) -> str:\n    return query", namespace)
    with pytest.raises(ToolRegistrationError) as caught:
        ToolRegistry().register(namespace["page"])
    assert (caught.value.field, caught.value.tool) == ("signature", "page")
