"""Tools, review of session 32: a registry read while a host registers, dicts keyed by
numbers, a sync tool that never returns, and an async ``reconcile`` check, tried against
what docs/tools.md and docs/sessions.md promise.

Real parts: plain host functions through the public ``run_tool``, a real subprocess for
the exit of a process, a Runtime on a real LMDB store in tmp_path with the fake provider
over loopback HTTP and the fake clock. A test with a ``# Was: DEFECT:`` line failed on
the code it was written against (fixed since).
"""

from __future__ import annotations

import http
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.errors import ToolError
from stalwart.events import MessageAppended, ToolCall, ToolFailed
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import ToolRegistry, run_tool
from tests._runtime_support import delivered, of, runtime_config


def _tool(index: int) -> Any:
    def lookup(key: str) -> str:
        """Look a key up."""
        return key

    lookup.__name__ = f"lookup_{index}"
    return lookup


# Was: DEFECT: specs() iterated the live dict: a registration meanwhile raised RuntimeError
def test_tools_registered_while_specs_are_read_never_break_the_read() -> None:
    """docs/embedding.md: "tools registered later are offered from the next model call
    on". A host registers tools (``rt.tool``) on its own thread while the Agents build
    their requests (``specs()``) on theirs: every read must succeed and see a registry as
    it was at some moment, never raise "dictionary changed size during iteration"."""
    tools = ToolRegistry()
    for index in range(100):
        tools.register(_tool(index))
    later = [_tool(index) for index in range(100, 2_100)]
    errors: list[BaseException] = []

    def register_all() -> None:
        for fn in later:
            tools.register(fn)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows
    try:
        writer = threading.Thread(target=register_all)
        writer.start()
        reads = 0
        while writer.is_alive() or reads == 0:
            try:
                names = [spec.name for spec in tools.specs()]
            except RuntimeError as exc:
                errors.append(exc)
                break
            assert names == [f"lookup_{index}" for index in range(len(names))]
            reads += 1
        writer.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(tools.specs()) == 2_100


# Was: DEFECT: a dict[int, ...] parameter refused the JSON object keys its own schema asks for
def test_a_dict_keyed_by_numbers_takes_the_object_its_schema_asks_for() -> None:
    """docs/tools.md: dicts are supported, and the Struct that validates the arguments is
    the one that makes the schema, "so the two never disagree". ``dict[int, str]`` is
    ``{"type": "object", "additionalProperties": ...}``; JSON can only send its keys as
    text, so the model's ``{"1": "a"}`` is what the schema asks for and must arrive as
    ``{1: "a"}``, for a named parameter and for a typed ``**kwargs`` alike."""
    tools = ToolRegistry()

    @tools.register
    def rename(columns: dict[int, str]) -> dict[str, str]:
        """Rename columns by their position."""
        return {f"{key}:{type(key).__name__}": value for key, value in columns.items()}

    @tools.register
    def tally(**groups: dict[int, int]) -> int:
        """Add up the counts of each group, keyed by size."""
        return sum(size * count for group in groups.values() for size, count in group.items())

    schema = tools.get("rename").parameters  # type: ignore[union-attr]
    assert schema["properties"]["columns"]["type"] == "object"

    async def main() -> tuple[Any, ...]:
        renamed = ToolCall(id="c1", name="rename", arguments='{"columns": {"1": "id"}}')
        counted = ToolCall(id="c2", name="tally", arguments='{"a": {"2": 3}, "b": {"5": 1}}')
        wrong = ToolCall(id="c3", name="rename", arguments='{"columns": {"one": "id"}}')
        return (
            await run_tool(tools, renamed),
            await run_tool(tools, counted),
            await run_tool(tools, wrong),
        )

    renamed, counted, wrong = anyio.run(main)
    assert (renamed.status, renamed.text) == ("ok", '{"1:int":"id"}')
    assert (counted.status, counted.text) == ("ok", "11")
    assert wrong.status == "invalid_arguments"  # a key that is no number is still refused
    assert "Expected `int`, got `str`" in wrong.text


_HANGING_HOST = """
    import sys
    import threading

    import anyio

    from stalwart.events import ToolCall
    from stalwart.tools import ToolRegistry, run_tool

    tools = ToolRegistry()


    @tools.register(timeout_ms=200)
    def read_socket() -> str:
        \"\"\"Read from a peer that never answers.\"\"\"
        threading.Event().wait()  # a blocking read with no timeout of its own
        return "never"


    async def main() -> None:
        outcome = await run_tool(tools, ToolCall(id="c1", name="read_socket", arguments="{}"))
        print(outcome.status, flush=True)


    anyio.run(main)
    print("main returned", flush=True)
"""


# Was: DEFECT: an abandoned sync tool's non-daemon thread kept its process from exiting
def test_a_process_whose_sync_tool_hangs_for_ever_still_exits(tmp_path: Path) -> None:
    """docs/tools.md: a sync tool past its limit "is abandoned (a Python thread cannot be
    stopped: it runs on in the background and its result is dropped)". A host whose tool
    blocks for ever (a socket read with no timeout) must still be able to finish: its
    main returns, and the process exits, leaving the abandoned thread behind."""
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(_HANGING_HOST))
    child = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        out, err = child.communicate(timeout=60)  # real-time: waits for a real process to exit
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    assert out.split("\n")[:2] == ["timeout", "main returned"], err
    assert child.returncode == 0, err


def _exporter(check: Any, runs: list[int]) -> ToolRegistry:
    tools = ToolRegistry()

    @tools.register(reconcile=check)
    def export(report: int) -> str:
        """Export a report to the drive."""
        runs.append(report)
        return f"exported {report}"

    return tools


# Was: DEFECT: an async reconcile check was never awaited: the call failed unencodable_result
def test_an_async_reconcile_check_is_awaited_like_an_async_tool() -> None:
    """docs/sessions.md: a call a crash cut short "is checked by the tool's own
    reconcile(key, arguments): an output means the effect happened, None means it did not
    and the call runs". Tools may be async, and so is the natural check of an async tool
    (it asks the same API): its answer is what it returns when awaited."""
    seen: list[tuple[str, dict[str, Any]]] = []
    runs: list[int] = []

    async def not_there(key: str, arguments: dict[str, Any]) -> str | None:
        await anyio.sleep(0)
        seen.append((key, arguments))
        return None

    async def already_there(key: str, arguments: dict[str, Any]) -> str | None:
        await anyio.sleep(0)
        return "drive://reports/7"

    call = ToolCall(id="c1", name="export", arguments='{"report": 7}')

    async def main() -> tuple[Any, Any]:
        ran = await run_tool(_exporter(not_there, runs), call, reconcile=True)
        found = await run_tool(_exporter(already_there, runs), call, reconcile=True)
        return ran, found

    ran, found = anyio.run(main)
    assert (ran.status, ran.text, ran.reconciled) == ("ok", "exported 7", False)
    assert seen == [("c1", {"report": 7})]
    assert (found.status, found.text, found.reconciled) == ("ok", "drive://reports/7", True)
    assert runs == [7]  # the effect that was there already was not made twice


# Was: DEFECT: a ToolError whose error_class was HTTPStatus.NOT_FOUND could not be recorded
@pytest.mark.timeout(60)
def test_a_tool_error_classed_by_an_http_status_is_recorded_and_answered(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """docs/tools.md: "A ToolError names its own class". A host classes it with what
    its HTTP client gave (``HTTPStatus.NOT_FOUND``, or the status code itself): the call
    fails with that class as text, the model reads the tool's own words and answers. The
    ``tool:failed`` must read back: an ``int`` where the event has a ``str`` was refused
    by the append, the Agent crashed mid-step and the user heard nothing."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        def fetch_page(url: str) -> str:
            """Fetch a page."""
            raise ToolError("the page is gone", error_class=http.HTTPStatus.NOT_FOUND)

        def fetch_feed(url: str) -> str:
            """Fetch a feed."""
            raise ToolError("the feed is gone", error_class=410)  # type: ignore[arg-type]

        rt.tool(fetch_page)
        rt.tool(fetch_feed)
        calls = (
            FakeToolCall(id="c1", name="fetch_page", arguments={"url": "https://a.example"}),
            FakeToolCall(id="c2", name="fetch_feed", arguments={"url": "https://b.example"}),
        )
        fake.add(Answer(text="", tool_calls=calls), Answer(text="Both are gone."))
        rt.session("s1", channel="chat").send("fetch them")
        assert [m.text for m in delivered(rt, chat, 1)] == ["Both are gone."]
    records = list(store.read_stream("session:s1"))
    failed = of(ToolFailed, records)
    assert [(e.tool, e.error_class) for e in failed] == [
        ("fetch_page", "404"),
        ("fetch_feed", "410"),
    ]
    read = [e.content for e in of(MessageAppended, records) if e.role == "tool"]
    assert read == [
        "The tool 'fetch_page' failed: the page is gone",
        "The tool 'fetch_feed' failed: the feed is gone",
    ]
