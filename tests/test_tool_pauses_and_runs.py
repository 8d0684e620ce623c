"""Tool calls, approval and custom tool pauses, the tool retry breaker, the webhook
channel and the session commands: defects a review found, each test failing on the code
before its fix for the reason its docstring names ("Harm"), and passing for the reason
it gives ("Correct").

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the fake
clock for deadlines, MemoryChannels, a real HTTP server on 127.0.0.1 for the webhook, and
real subprocesses for the command line (its argv bytes) and for a runtime whose I/O loop
dies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    SessionRequiresAction,
    ToolBlocked,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import GUARD, has, log_until, of, runtime_config


def config(base_url: str, **extra: Any) -> Config:
    return runtime_config(base_url, **extra)


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


def _tool_messages(body: dict[str, Any], call_id: str) -> list[dict[str, Any]]:
    return [
        m for m in body["messages"] if m.get("role") == "tool" and m.get("tool_call_id") == call_id
    ]


# -- approvals and custom tools in a durable session ----------------------------------------


def test_after_an_interrupt_the_next_message_is_answered_not_the_old_approval_asked_again(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: an operator interrupts a session that waits for approval of a refund
    ("wrong customer"). The user then asks something else; instead of an answer the
    session stops again with a new approval request for the very refund that was
    interrupted, so the old call survives the interrupt and the new message is never
    answered until someone approves or denies it.

    Correct (docs/sessions.md, "Interrupting a session"): the interrupt clears the
    pending request; "the next user message starts new work as usual": the model is
    called and answers it."""

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        return f"refunded {order}"

    call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="The weather is fine."))
    session = rt.session("s1", channel="chat")
    session.send("refund order 7")
    log_until(store, "session:s1", has(ActivationBlocked))
    rt.interrupt("s1", "wrong customer")
    session.send("how is the weather?")
    records = log_until(store, "session:s1", has((ActivationAcked, ActivationBlocked), 2))
    assert len(of(SessionRequiresAction, records)) == 1, "the interrupted call asked again"
    assert of(ActivationAcked, records)


def test_an_allowed_call_is_not_then_blocked_by_the_tool_breaker(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: a tool that needs confirmation has failed 3 times with the same arguments.
    The model calls it once more; the session pauses and the user is asked to approve
    it. The user allows it, and then the retry breaker blocks it: the call the user was
    asked about never runs. The user was asked a question whose answer did not matter.

    Correct: the breaker decides before the pause (a blocked call is answered at once
    and never asks a human), or an allowed call runs once with its stored input, as
    docs/sessions.md promises."""
    attempts: list[int] = []

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        attempts.append(order)
        raise ConnectionError("payment gateway down")

    calls = [FakeToolCall(id=f"c{n}", name="refund", arguments={"order": 7}) for n in range(4)]
    for call in calls:
        fake.add(Answer(text="", tool_calls=(call,)))
    fake.add(Answer(text="I could not refund it."))
    rt.session("s1", channel="chat").send("refund order 7")
    _answer_pauses(rt, store, [True] * 4)
    log_until(store, "session:s1", has(ActivationAcked))
    records = list(store.read_stream("session:s1"))
    allowed = len(of(SessionRequiresAction, records))
    blocked = of(ToolBlocked, records)
    assert not blocked or allowed == len(attempts), (
        f"{allowed} calls allowed by the user, {len(attempts)} ran, {len(blocked)} blocked "
        "after the user allowed them"
    )


# -- sub-agents: a tool that needs confirmation -----------------------------------------------


def test_a_sub_agent_cannot_run_a_tool_that_needs_confirmation_without_approval(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: a host registers ``refund`` with ``needs_confirmation=True``. A model-driven
    sub-agent run (``rt.spawn`` without ``work``, or the ``spawn_subagent`` tool) is
    offered the same tools; when its model calls ``refund`` the call runs at once, with
    no approval asked of anyone: the approval gate is skipped entirely outside a durable
    wake.

    Correct: a tool that needs confirmation never runs without a user's allow. A
    sub-session that cannot pause must not run it (refuse the call, or not offer it)."""
    runs: list[int] = []
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            runs.append(order)
            return f"refunded {order}"

        call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="done"))
        handle = rt.spawn("p1", "refund order 7", task_class="research", channel="chat")
        handle.result(GUARD)
    assert runs == [], "a tool that needs confirmation ran with nobody's approval"


def test_an_interrupt_after_an_allow_stops_the_allowed_call_for_good(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel, clock: FakeClock
) -> None:
    """Harm: an operator allows a refund from the command line (``stalwart session
    confirm``), realises it is the wrong customer and interrupts the session before a
    worker ran the resume. The interrupt reports the resume as cancelled, yet the next
    user message ("thanks, bye") runs the refund anyway: the allowed call outlives the
    interrupt that was meant to stop it.

    Correct (docs/sessions.md): an interrupt clears the pending request and cancels every
    queued activation, a resume included; nothing of the interrupted step runs later."""
    from stalwart.runtime import confirm

    runs: list[int] = []

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        runs.append(order)
        return f"refunded {order}"

    call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
    fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Bye."))
    session = rt.session("s1", channel="chat")
    session.send("refund order 7")
    records = log_until(store, "session:s1", has(ActivationBlocked))
    [request] = of(SessionRequiresAction, records)
    # the CLI's path: another process appends the answer; no worker has polled yet
    confirm(store, "s1", request.request_id, allow=True, ts=clock.now())
    cancelled = rt.interrupt("s1", "wrong customer")
    assert len(cancelled) == 1  # the resume
    session.send("thanks, bye")
    log_until(store, "session:s1", has(ActivationAcked))
    assert runs == [], "the interrupted, cancelled refund ran on the next message"


def _answer_pauses(
    rt: Runtime, store: EventStore, verdicts: list[bool]
) -> list[SessionRequiresAction]:
    """Answer each approval the session asks for, in turn, with ``verdicts``; stop early
    when the session ends its work without asking (the last turn acked)."""
    asked: list[SessionRequiresAction] = []
    for n, allow in enumerate(verdicts):
        records = log_until(
            store,
            "session:s1",
            lambda rs, n=n: (
                sum(isinstance(r.event, ActivationBlocked) for r in rs) > n
                or sum(isinstance(r.event, ActivationAcked) for r in rs) > 0
            ),
        )
        requests = of(SessionRequiresAction, records)
        if len(requests) <= n:
            break
        asked.append(requests[n])
        rt.confirm("s1", requests[n].request_id, allow=allow)
    return asked


def test_a_users_denials_do_not_count_as_tool_failures_in_the_breaker(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: the user denies five refunds the model proposes (wrong orders), then allows
    the right one. The tool never ran and never failed, but every denial is recorded as
    a ``tool:failed`` that the retry breaker counts, so the allowed call is blocked with
    "the tool failed 5 times with no success in between": the model is told something
    false, and the user can never get a refund done in this session (a blocked call
    never runs, so the count never resets).

    Correct: a denial is the user's decision, not a tool failure; like
    ``invalid_arguments`` it must not count toward a block, and the allowed call runs."""
    runs: list[int] = []

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        runs.append(order)
        return f"refunded {order}"

    for n in range(6):
        call = FakeToolCall(id=f"c{n}", name="refund", arguments={"order": n})
        fake.add(Answer(text="", tool_calls=(call,)))
    fake.add(Answer(text="Refunded."))
    rt.session("s1", channel="chat").send("refund my last order")
    _answer_pauses(rt, store, [False] * 5 + [True])
    records = log_until(store, "session:s1", has(ActivationAcked))
    assert of(ToolBlocked, records) == []
    assert runs == [5]


def test_an_approval_is_not_reused_for_a_later_call_that_has_the_same_call_id(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: call ids come from the provider. Some OpenAI-compatible servers number them
    per response (``call_0``), and a missing id is read as ``""`` for every call. The
    user approves ``refund(order=7)``; in a later turn the model calls
    ``refund(order=9999)`` under the same id, and it runs at once, with no approval: the
    earlier allow is applied to a different call with different arguments.

    Correct: an answer applies only to the request it answered (that call, in that
    step); every new call of a tool that needs confirmation pauses for its own approval."""
    runs: list[int] = []

    @rt.tool(needs_confirmation=True)
    def refund(order: int) -> str:
        """Refund an order."""
        runs.append(order)
        return f"refunded {order}"

    first = FakeToolCall(id="call_0", name="refund", arguments={"order": 7})
    again = FakeToolCall(id="call_0", name="refund", arguments={"order": 9999})
    fake.add(
        Answer(text="", tool_calls=(first,)),
        Answer(text="Refunded 7."),
        Answer(text="", tool_calls=(again,)),
        Answer(text="Refunded 9999."),
    )
    session = rt.session("s1", channel="chat")
    session.send("refund order 7")
    _answer_pauses(rt, store, [True])
    log_until(store, "session:s1", has(ActivationAcked))
    assert runs == [7]
    session.send("and the other one")
    log_until(
        store,
        "session:s1",
        lambda rs: (
            sum(isinstance(r.event, ActivationBlocked) for r in rs) >= 2
            or sum(isinstance(r.event, ActivationAcked) for r in rs) >= 2
        ),
    )
    assert runs == [7], "refund(9999) ran on the approval given to refund(7)"


# -- running tools ----------------------------------------------------------------------------


def test_a_hung_reconcile_check_is_bounded_by_the_tools_time_limit() -> None:
    """Harm: after a crash, a call that was cut short is first checked with its tool's
    ``reconcile``. When that check hangs (the payment API it asks does not answer), the
    call waits for it far past the tool's ``timeout_ms``: the check runs in a worker
    thread that cannot be cancelled and is not abandoned, so the cancel scope waits for
    it, and the wake is stuck on it.

    Correct (docs/tools.md): each call runs under its tool's own time limit; a sync
    function past it is abandoned and the call ends as ``timeout`` when its budget runs
    out, not when the thread finishes."""
    import threading
    import time

    import anyio

    from stalwart.events import ToolCall
    from stalwart.tools import ToolRegistry, run_tool

    release = threading.Event()

    def check(key: str, arguments: dict[str, Any]) -> str | None:
        release.wait(3.0)  # a remote check that does not answer
        return None

    tools = ToolRegistry()

    @tools.register(timeout_ms=200, reconcile=check)
    def refund(order: int) -> str:
        """Refund an order."""
        return "refunded"

    call = ToolCall(id="c1", name="refund", arguments='{"order": 7}')
    started = time.monotonic()
    try:
        outcome = anyio.run(lambda: run_tool(tools, call, reconcile=True))
    finally:
        release.set()
    elapsed = time.monotonic() - started
    assert outcome.status == "timeout"
    assert elapsed < 1.5, f"a 200 ms tool took {elapsed:.1f} s: its hung check held it"


# -- the webhook channel ----------------------------------------------------------------------


def test_a_webhook_closed_while_a_send_backs_off_raises_a_channel_error() -> None:
    """Harm: the runtime shuts down (or a host closes the channel) while a webhook send
    waits to retry a 503. The next attempt raises httpx's bare ``RuntimeError: Cannot
    send a request, as the client has been closed`` out of ``send``: callers that handle
    ``ChannelError`` (the dead-letter queue, the Agent) get an untyped exception, and
    the failure is recorded under the class name ``RuntimeError``.

    Correct (docs/channels.md): a failed send raises a typed ``ChannelError``; after
    ``aclose()`` that is ``ChannelError(kind="closed")``."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import anyio

    from stalwart.channels import OutboundMessage, WebhookChannel
    from stalwart.config import ChannelSettings
    from stalwart.errors import ChannelError

    class Busy(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(503)
            self.send_header("content-length", "0")
            self.end_headers()
            answered.set()

    answered = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    # full-jitter backoff waits anywhere in [0, 400 ms]: with three attempts, two short
    # waits used to spend them all before the close (a 503 error, not "closed")
    settings = ChannelSettings(
        kind="webhook", url=url, max_attempts=50, retry_base_ms=400, retry_cap_ms=400
    )
    message = OutboundMessage(conversation="c1", text="hello", idempotency_key="k1")
    raised: list[BaseException] = []

    async def main() -> None:
        channel = WebhookChannel("ops", settings)

        async def close_soon() -> None:
            while not answered.is_set():  # the first attempt gets its 503 ...
                await anyio.sleep(0.01)  # real-time: the server answers on its thread
            await anyio.sleep(0.1)  # real-time: ... and the send backs off (400 ms)
            await channel.aclose()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(close_soon)
                try:
                    await channel.send(message)
                except Exception as exc:
                    raised.append(exc)

    try:
        anyio.run(main)
    finally:
        server.shutdown()
        server.server_close()
    [error] = raised
    assert isinstance(error, ChannelError), f"{type(error).__name__}: {error}"
    assert error.kind == "closed"


# -- the session commands ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["session", "confirm", "\udcff", "r1", "--allow"],
        ["session", "tool-result", "\udcff", "r1", "--output", "x"],
        ["session", "interrupt", "\udcff"],
    ],
    ids=["confirm", "tool-result", "interrupt"],
)
def test_a_session_id_that_is_not_utf8_is_one_line_not_a_traceback(
    store_dir: Any, clock: FakeClock, args: list[str]
) -> None:
    """Harm: an operator pastes a session id with a stray byte that is not UTF-8 (a
    Latin-1 terminal, a copy from a binary log): ``stalwart session confirm`` (and
    ``tool-result``, ``interrupt``) dies with a 40-line ``UnicodeEncodeError`` traceback
    from the store's ``check_stream``, whose own docstring promises an
    ``InvalidStreamError``.

    Correct (the CLI's contract): a bad input is one line on stderr, ``stalwart: error:
    ...``, exit 1, no traceback, nothing appended."""
    import subprocess
    import sys

    from stalwart import store as store_module
    from stalwart.events import SessionCreated

    with store_module.open(store_dir, clock=clock) as opened:  # type: ignore[attr-defined]
        opened.append(
            "session:s1",
            [
                SessionCreated(),
                SessionRequiresAction(request_id="r1", kind="approval", tool="rm", arguments="{}"),
            ],
        )
    argv = [
        sys.executable,
        "-m",
        "stalwart",
        "--store",
        str(store_dir),
        *[a.encode("utf-8", "surrogateescape") for a in args],
    ]
    done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    err = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    assert done.returncode == 1
    assert err.startswith("stalwart: error: ")
    assert err.count("\n") == 1


_SYS_EXIT_CHILD = """
import argparse, json, sys
from concurrent.futures import CancelledError

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from tests._runtime_support import delivered, has, log_until
from tests.test_tool_pauses_and_runs import config
from stalwart.events import ToolStarted
from stalwart.runtime import Runtime
from stalwart.testing import Answer, FakeProvider, FakeToolCall

clock = FakeClock(start=1_800_000_000.0)
store = store_module.open(sys.argv[1], clock=clock)
chat = MemoryChannel("chat")
with FakeProvider() as fake:
    fake.set_default(Answer(text="default answer"))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool
        def report(flags: str) -> str:
            \"\"\"Run the report tool with command-line flags.\"\"\"
            parser = argparse.ArgumentParser(prog="report")
            parser.add_argument("--days", type=int)
            parser.parse_args(flags.split())  # --days x: argparse exits with status 2
            return "the report"

        call = FakeToolCall(id="c1", name="report", arguments={"flags": "--days x"})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="The flags were wrong."))
        rt.session("s1", channel="chat").send("run the report")
        log_until(store, "session:s1", has(ToolStarted))
        rt.session("s2", channel="chat").send("hello")
        try:
            answer = sorted(r.text for r in delivered(rt, chat, 2))
        except (RuntimeError, CancelledError) as exc:
            answer = f"the runtime's I/O loop died: {exc!r}"
print("RESULT " + json.dumps(answer), flush=True)
"""


def test_a_tool_that_calls_sys_exit_is_a_failed_call_not_a_dead_runtime(tmp_path: Any) -> None:
    """Harm: a tool wraps code that ends with ``SystemExit`` (an argparse error, a
    click command, a stray ``sys.exit``). ``run_tool`` only catches ``Exception``, so
    the ``SystemExit`` leaves the tool runner, and anyio's portal lets a base exception
    "fall through": it is raised in the runtime's one I/O event loop. The loop dies, and
    with it every session's model calls and channel sends: another session's message
    is never answered.

    Correct (stalwart/tools/_run.py: "Nothing a tool does is raised at the caller: every
    call ends as a ToolOutcome"): the call ends as an ``error`` the model reads, and the
    runtime goes on serving every session.

    (Run in a child process: the dead loop leaks its sockets, which would otherwise be
    reported against the rest of the test session.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _SYS_EXIT_CHILD, str(tmp_path / "store")],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        cwd=root,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-2000:]
    answered = json.loads(lines[-1].removeprefix("RESULT "))
    assert answered == ["The flags were wrong.", "default answer"], answered


def test_a_tool_whose_own_task_was_cancelled_does_not_lose_its_neighbours_results(
    rt: Runtime, store: EventStore, fake: FakeProvider, chat: MemoryChannel, clock: FakeClock
) -> None:
    """Harm: an async tool lets an ``asyncio.CancelledError`` of its own escape (it
    cancelled an inner task and awaited it, as HTTP clients and ``wait_for`` code do).
    ``run_tool`` does not catch it, the call's slot stays empty, and ``run_tools``
    silently drops it, returning fewer outcomes than calls. The Agent then fails the
    whole step as ``tools_broke``; on the retry the other call, which ran and succeeded
    (``lookup`` returned its answer), is reported to the model as "interrupted by a
    restart and may or may not have taken effect". Its real result is lost.

    Correct: every call ends as a ToolOutcome in the calls' order (an escaped
    cancellation that no caller asked for is an ``error`` of that call), and the
    neighbour's result reaches the model."""
    import asyncio

    @rt.tool
    async def flaky() -> str:
        """A tool whose inner request gets cancelled."""

        async def inner() -> None:
            await asyncio.sleep(10)

        task = asyncio.ensure_future(inner())
        await asyncio.sleep(0)
        task.cancel()
        await task
        return "unreachable"

    @rt.tool
    def lookup(order: int) -> str:
        """Look an order up."""
        return f"order {order}: shipped"

    calls = (
        FakeToolCall(id="c1", name="flaky", arguments={}),
        FakeToolCall(id="c2", name="lookup", arguments={"order": 7}),
    )
    fake.add(Answer(text="", tool_calls=calls), Answer(text="Order 7 has shipped."))
    rt.session("s1", channel="chat").send("where is order 7?")
    records = log_until(
        store,
        "session:s1",
        lambda rs: any(r.type in {"activation:acked", "activation:requeued"} for r in rs),
    )
    if not of(ActivationAcked, records):
        clock.advance(60.0)  # let the requeued wake run
        records = log_until(store, "session:s1", has(ActivationAcked))
    body = fake.requests[-1].body
    results = [m["content"] for m in _tool_messages(body, "c2")]
    assert results == ["order 7: shipped"], results
