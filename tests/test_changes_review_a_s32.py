"""Review of the day's changes, part A (store, providers, runtime actors, tool threads).

Real parts: real subprocesses (one that forks) for the tool threads; an LMDB directory
in ``tmp_path``, the IoPortal, the Scheduler on a FakeClock and a MemoryChannel for the
dead-letter queue.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from stalwart.actors import Drain
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import AnnouncementDeadLetterDelivered as Delivered
from stalwart.events import AnnouncementSendFailed, Event, ProviderRecovered
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, until
from tests.test_deadletter_health_review_s32 import (
    T0,
    _delivered,
    _enqueue,
    _keys,
    _replays,
    _state,
    queue,  # noqa: F401 (the fixture)
)

_FORKING_HOST = """
    import os

    import anyio

    from stalwart.events import ToolCall
    from stalwart.tools import ToolRegistry, run_tool

    tools = ToolRegistry()


    @tools.register(timeout_ms=10_000)
    def add(a: int, b: int) -> int:
        \"\"\"Add two numbers.\"\"\"
        return a + b


    async def once() -> str:
        call = ToolCall(id="c1", name="add", arguments='{"a": 1, "b": 2}')
        outcome = await run_tool(tools, call)
        return f"{outcome.status} {outcome.text}"


    print("parent", anyio.run(once), flush=True)  # its thread idles on, waiting for work
    pid = os.fork()
    if pid == 0:
        print("child", anyio.run(once), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
"""


# Was: DEFECT: a forked child's sync tool waited for the parent's idle threads (absent there)
def test_a_sync_tool_runs_in_a_child_forked_after_the_parent_ran_one(tmp_path: Path) -> None:
    """The tool threads are reused while they idle; a child forked meanwhile (a
    multiprocessing worker on Linux) has none of them, and must start its own."""
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(_FORKING_HOST))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=60,  # real-time: waits for a real process (and its child) to end
        check=False,
    )
    assert done.stdout.splitlines() == ["parent ok 3", "child ok 3"], done.stderr
    assert done.returncode == 0, done.stderr


_THREADLESS_HOST = """
    import threading

    import anyio

    from stalwart.events import ToolCall
    from stalwart.tools import ToolRegistry, run_tool

    tools = ToolRegistry()
    ran = []


    @tools.register(timeout_ms=10_000)
    def note(text: str) -> str:
        \"\"\"Note a text (an effect: an email sent, a row written).\"\"\"
        ran.append(text)
        return text


    async def call(text: str) -> str:
        arguments = '{"text": "%s"}' % text
        outcome = await run_tool(tools, ToolCall(id=text, name="note", arguments=arguments))
        return outcome.status


    async def main() -> None:
        threading.stack_size(1 << 60)  # no thread can start with such a stack
        print("first", await call("first"), flush=True)
        threading.stack_size(0)
        print("second", await call("second"), flush=True)
        print("ran", *ran, flush=True)


    anyio.run(main)
"""


# Was: DEFECT: a sync tool whose thread could not start failed, then ran on the next call's thread
def test_a_sync_tool_that_could_not_start_never_runs_later(tmp_path: Path) -> None:
    """A call told that its tool failed (no thread could be started for it: the process
    at its thread limit) must not run that tool afterwards: the model, told it failed,
    may well call it again, and the effect would happen twice."""
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(_THREADLESS_HOST))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=60,  # real-time: waits for a real process to end
        check=False,
    )
    assert done.stdout.splitlines() == ["first error", "second ok", "ran second"], done.stderr
    assert done.returncode == 0, done.stderr


# Was: DEFECT: a drain sent a conversation's later replies after an earlier one's send failed
def test_a_drain_holds_a_conversations_later_replies_back_behind_one_that_failed(
    queue: Any,  # noqa: F811 (the fixture)
    lmdb_store: EventStore,
    clock: FakeClock,
) -> None:
    """docs/resilience.md: "a later reply is never shown before an earlier one that is
    still to come". A drain sent reply 2 and 3 once reply 1's send ended, whatever its
    outcome: reply 1 failed, and the user read 2 and 3 before it (retried a minute
    later). Now they are held back (``held_back``) and follow reply 1's retry."""
    chat = MemoryChannel("chat")
    ref = queue(chat)
    for name in ("1", "2", "3"):
        _enqueue(ref, name)
    chat.fail_next(1)
    lmdb_store.append("provider:openai", [NewEvent(event=ProviderRecovered(provider="openai"))])
    ref.tell(Drain("openai"))

    def outcomes() -> list[Event]:
        events = [r.event for r in lmdb_store.read_stream("deadletter")]
        return [e for e in events if isinstance(e, AnnouncementSendFailed | Delivered)]

    until(lambda: len(outcomes()) >= 3, GUARD, what="the drain's outcomes")  # real-time: portal
    assert _keys(chat.messages) == []
    classes = [e.error_class for e in outcomes() if isinstance(e, AnnouncementSendFailed)]
    assert classes == ["server_error", "held_back", "held_back"]
    # held back is no attempt: replies 2 and 3 keep theirs, and follow reply 1 at once
    assert [e.attempts for e in _state(ref).entries] == [1, 0, 0]
    clock.set(T0 + 60)  # reply 1's second retry is due
    state = _delivered(ref, 3)
    assert state.entries == ()
    assert _keys(chat.messages) == ["a-1", "a-2", "a-3"]
    _replays(lmdb_store)
    report = verify_store(lmdb_store, None)  # the queue's retries (the recovery: by hand)
    assert report.checked["announcement:dead_letter_retried"] == 6
    assert [f for f in report.findings if f.stream == "deadletter"] == []
