"""Tools, second review: argument checks, results, the retry breaker and a crash's
leftovers, tried adversarially against what docs/tools.md and docs/sessions.md promise.

Real parts: a real LMDB store in tmp_path, the fake provider over loopback HTTP, the
fake clock for deadlines, a MemoryChannel; tools are plain host functions. A test with a
``# Was: DEFECT:`` line failed on the code it was written against (fixed since).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import ToolRegistrationError
from stalwart.events import (
    ActivationLeased,
    ActivationReady,
    MessageAppended,
    SessionCreated,
    ToolBlocked,
    ToolCall,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, Fence
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import (
    ToolOutcome,
    ToolRegistry,
    decide_tool_call,
    fold_tool_breaker,
    outcome_event,
    run_tool,
    run_tools,
    started_event,
)
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    of,
    runtime_config,
    until,
)

#: The turn's execution timeout in these tests (``supervision.execution_timeout_ms``).
EXECUTION_MS = 60_000


def _config(base_url: str) -> Config:
    return runtime_config(base_url, supervision={"execution_timeout_ms": EXECUTION_MS})


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets a blocked sync tool's thread finish when the test is done."""
    event = threading.Event()
    yield event
    event.set()


# -- a crash's leftovers: a started call without a check is never run blindly ---------------


def _crashed_mid_step(store: EventStore, clock: FakeClock) -> None:
    """The log a process leaves when it dies while a step's two calls run: ``refund``
    (no reconcile check) and ``ship`` (with one)."""
    refund = ToolCall(id="c1", name="refund", arguments='{"order":7}')
    ship = ToolCall(id="c2", name="ship", arguments='{"order":7}')
    events = [
        SessionCreated(agent="default", channel="chat"),
        ActivationReady(activation_id="a1", kind="message", message_id="m1", text="refund 7"),
        ActivationLeased(activation_id="a1", owner="dead", epoch=1, expires_at=clock.now() - 1),
        TurnStarted(turn_id="t1", trigger="message"),
        MessageAppended(message_id="m1", role="user", content="refund 7", turn_id="t1"),
        MessageAppended(message_id="x", role="assistant", tool_calls=(refund, ship), turn_id="t1"),
        ToolStarted(
            call_id="c1",
            tool="refund",
            arguments='{"order":7}',
            idempotency_key="session:s1/c1",
            turn_id="t1",
        ),
        ToolStarted(
            call_id="c2",
            tool="ship",
            arguments='{"order":7}',
            idempotency_key="session:s1/c2",
            turn_id="t1",
        ),
    ]
    store.append("session:s1", events, fence=Fence(1, claim=True))


@pytest.mark.timeout(60)
def test_a_cut_short_call_surfaced_once_is_not_run_when_its_step_is_resumed_again(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    release: threading.Event,
) -> None:
    """docs/sessions.md: "a call whose start is recorded but not its completion is checked
    by the tool's own reconcile ...; a tool with no check is surfaced, not re-run".

    A crash cut a step of two calls short. The next wake records ``refund``'s
    ``tool:failed`` ``unreconciled`` at once and reconciles ``ship``, whose re-run hangs
    past the turn's execution timeout: the turn is aborted with neither call's result in
    the conversation. The user writes again; the wake resumes the step a second time."""
    # Was: DEFECT: the ledger's cut_short() was "started, no tool:completed/failed yet", and
    # the unreconciled tool:failed cleared it: the next resume ran refund (no check) blindly.
    _crashed_mid_step(store, clock)
    refunds: list[int] = []
    ships: list[int] = []

    def not_shipped(key: str, arguments: dict[str, Any]) -> str | None:
        return None  # the effect is absent: run the call

    fake.add(Answer(text="I could not confirm the refund."))
    with Runtime(_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool
        def refund(order: int) -> str:
            """Refund an order (a payment: never twice)."""
            refunds.append(order)
            return f"refunded {order}"

        @rt.tool(timeout_ms=3_600_000, reconcile=not_shipped)
        def ship(order: int) -> str:
            """Ship an order."""
            ships.append(order)
            release.wait(GUARD)  # the carrier's API hangs
            return f"shipped {order}"

        until(lambda: ships == [7])  # refund settled (surfaced with the results), ship running
        advance_until(clock, lambda: _last_turn_ended(store) == "aborted", 5.0)
        release.set()
        delivered(rt, chat, 1)  # the turn's failure notice
        rt.session("s1", channel="chat").send("did the refund go through?")
        delivered(rt, chat, 2)
    records = list(store.read_stream("session:s1"))
    assert of(ToolFailed, records)[0].error_class == "unreconciled"  # surfaced once
    # reconciled as absent and re-run by the first resumed wake; the execution timeout
    # that aborted that turn closed the call (unreconciled) with it, so the next wake
    # does not run it again beside the run still going (session 33)
    assert ships == [7]
    assert refunds == [], "a refund whose start was recorded was made again"


def _last_turn_ended(store: EventStore) -> str | None:
    ended = of(TurnCompleted, list(store.read_stream("session:s1")))
    return ended[-1].outcome if ended else None


# -- names: what providers accept, exactly --------------------------------------------------


@pytest.mark.parametrize("how", ["register", "register_custom"])
def test_a_name_with_a_trailing_newline_is_refused(how: str) -> None:
    """docs/tools.md: a name "must match ``^[a-zA-Z0-9_-]{1,64}$`` (what every provider
    accepts)". A name read from a file or an env var easily keeps its line break; a
    provider refuses the whole request that declares it, so every turn of every session
    fails, long after registration said yes."""
    # Was: DEFECT: build_tool (stalwart/tools/_registry.py) used NAME_PATTERN.match; "$" also
    # matches before a final "\n": "search\n" is accepted. Use fullmatch (or \Z).
    registry = ToolRegistry()
    add = (
        (lambda: registry.register(lambda query="": query, name="search\n"))
        if how == "register"
        else (lambda: registry.register_custom("search\n"))
    )
    with pytest.raises(ToolRegistrationError) as refused:
        add()
    assert refused.value.field == "name"


def test_a_name_differing_by_case_or_look_alike_letters_is_no_tool_of_ours() -> None:
    """A model that writes a registered name in another case, or with a look-alike letter,
    reads that there is no such tool and which ones there are; a look-alike name cannot
    be registered at all (it is not provider-safe)."""
    registry = ToolRegistry()

    @registry.register
    def search(query: str) -> str:
        return f"found {query}"

    with pytest.raises(ToolRegistrationError):
        registry.register(search, name="\u0455earch")  # Cyrillic dze, looks like "s"

    async def main() -> list[ToolOutcome]:
        with anyio.fail_after(GUARD):
            return [
                await run_tool(registry, ToolCall(id=f"c{n}", name=name, arguments='{"query":1}'))
                for n, name in enumerate(["Search", "\u0455earch", "search\n", "x" * 5_000])
            ]

    outcomes = anyio.run(main)
    assert {o.status for o in outcomes} == {"unknown_tool"}
    assert all("The available tools are: search." in o.text for o in outcomes)
    assert len(outcomes[-1].text) < 200  # a huge name is shortened, not echoed back whole


# -- arguments ------------------------------------------------------------------------------


def test_a_typed_kwargs_parameter_checks_the_arguments_it_takes() -> None:
    """docs/tools.md: stalwart "derives the JSON schema the model sees from their type
    hints, validates every call's arguments against it"; "A ``**kwargs`` parameter takes
    the arguments the signature does not name". ``**counts: int`` says each extra
    argument is an integer: a string for one must be ``invalid_arguments``, as it is for
    a named ``int`` parameter, not handed to code that adds it up."""
    # Was: DEFECT: signature_of (stalwart/tools/_schema.py) drops the **kwargs hint and
    # parse_arguments passes extras through unchecked; the tool gets "many" for an int.
    # Check extras against the hint (and give it as additionalProperties in the schema).
    registry = ToolRegistry()
    seen: list[dict[str, Any]] = []

    @registry.register
    def tally(label: str, **counts: int) -> int:
        seen.append(counts)
        return sum(counts.values())

    call = ToolCall(id="c1", name="tally", arguments='{"label": "q3", "apples": "many"}')

    async def main() -> ToolOutcome:
        with anyio.fail_after(GUARD):
            return await run_tool(registry, call)

    outcome = anyio.run(main)
    assert seen == [], f"the tool ran with {seen}"
    assert outcome.status == "invalid_arguments"


def test_arguments_that_are_not_json_or_not_an_object_are_the_models_to_fix() -> None:
    """Bad JSON, a JSON array, numbers past what JSON can carry, a missing or an extra
    argument: each ends as ``invalid_arguments`` saying where, the tool never runs, and
    none counts toward the retry breaker however often the model repeats it."""
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.register
    def lookup(order: int) -> str:
        runs.append(order)
        return "shipped"

    bad = ['{"order": 7', "[7]", '{"order": 1e400}', "{}", '{"order": 7, "sudo": true}', "null"]
    calls = [ToolCall(id=f"c{n}", name="lookup", arguments=text) for n, text in enumerate(bad)]

    async def main() -> tuple[ToolOutcome, ...]:
        with anyio.fail_after(GUARD):
            return await run_tools(registry, calls * 3, limit=2)

    outcomes = anyio.run(main)
    assert runs == []
    assert {o.status for o in outcomes} == {"invalid_arguments"}
    assert "unknown field `sudo`" in outcomes[4].text
    events = [
        e
        for c, o in zip(calls * 3, outcomes, strict=True)
        for e in (started_event(c), outcome_event(o))
    ]
    state = fold_tool_breaker(events)
    assert all(decide_tool_call(state, "lookup", text) is None for text in bad)


# -- results --------------------------------------------------------------------------------


def test_a_listing_of_file_names_that_are_not_utf8_is_a_result_not_an_error(
    tmp_path: Path,
) -> None:
    """docs/tools.md: what UTF-8 cannot carry in a result ("the lone surrogates Python
    gives a file name that is not UTF-8") is made valid Unicode "so the outcome can be
    recorded"; only a type JSON has no form for, a cycle or too deep a value is
    ``unencodable_result``. The commonest tool of all returns ``os.listdir()``: one file
    another system wrote with a Latin-1 name makes the whole listing an error, which the
    model cannot fix and which counts toward blocking the tool."""
    # Was: DEFECT: result_text (stalwart/tools/_run.py) scrubs surrogates only in a str result;
    # msgspec refuses them inside a list, so the listing fails. Scrub strings (and keys)
    # inside containers too, as for a str result.
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "q3.txt").write_text("ok")
    (folder / os.fsdecode(b"r\xe9sum\xe9.txt")).write_text("ok")  # a Latin-1 name
    registry = ToolRegistry()

    @registry.register
    def list_reports(path: str) -> list[str]:
        return sorted(os.listdir(path))

    call = ToolCall(
        id="c1", name="list_reports", arguments=msgspec.json.encode({"path": str(folder)}).decode()
    )

    async def main() -> ToolOutcome:
        with anyio.fail_after(GUARD):
            return await run_tool(registry, call)

    outcome = anyio.run(main)
    assert (outcome.status, outcome.error_class) == ("ok", None), outcome.text
    names = msgspec.json.decode(outcome.text)
    assert len(names) == 2
    assert "q3.txt" in names


def test_a_tool_raising_a_base_exception_does_not_lose_the_steps_other_results() -> None:
    """stalwart/tools/_run.py: "Nothing a tool does is raised at the caller: every call ends
    as a ToolOutcome"; docs/tools.md says the same of ``SystemExit`` and of a cancellation
    a tool let escape: "Neither reaches the runtime's event loop or the other calls of
    the step". Libraries do raise other ``BaseException`` subclasses (gevent's and
    eventlet's ``Timeout``, ``GeneratorExit``, a test framework's outcome)."""
    # Was: DEFECT: run_tool catches only (Exception, SystemExit): any other BaseException escapes,
    # the task group loses the neighbour's outcome, and the Agent fails the step as
    # tools_broke. Catch BaseException except the loop's own cancellation.
    registry = ToolRegistry()

    class Timeout(BaseException):  # what gevent.Timeout and eventlet.Timeout derive from
        pass

    @registry.register
    def legacy_fetch(url: str) -> str:
        raise Timeout("api_key=sk-live-123 timed out")

    @registry.register
    def lookup(order: int) -> str:
        return f"order {order}: shipped"

    calls = [
        ToolCall(id="c1", name="legacy_fetch", arguments='{"url": "http://x"}'),
        ToolCall(id="c2", name="lookup", arguments='{"order": 7}'),
    ]

    async def main() -> tuple[ToolOutcome, ...]:
        with anyio.fail_after(GUARD):
            return await run_tools(registry, calls, limit=2)

    try:
        fetched, looked_up = anyio.run(main)
    except BaseException as exc:  # what escaped is the finding
        pytest.fail(f"run_tools raised {type(exc).__name__} instead of two outcomes")
    assert fetched.status == "error"
    assert "sk-live" not in fetched.text
    assert looked_up.text == "order 7: shipped"


# -- a failing tool in a session: static words, a block, a log that replays -----------------

SECRET = "sk-live-5e3cr3t"


@pytest.mark.timeout(60)
def test_a_failing_tool_is_blocked_its_secret_stays_out_and_the_log_replays(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    logs: list[MutableMapping[str, Any]],
) -> None:
    """A tool whose exception text holds a key fails three times with the same arguments:
    the model reads a static sentence each time, the fourth call is blocked (``same_call``,
    3) and not run, the user's channel and every event and log line are free of the key,
    and ``replay --verify`` re-derives the block from the log."""
    runs: list[str] = []
    charge = [
        FakeToolCall(id=f"c{n}", name="charge", arguments={"card": "4242", "cents": 500})
        for n in range(4)
    ]
    fake.add(
        *(Answer(text="", tool_calls=(call,)) for call in charge),
        Answer(text="The payment service keeps failing; I stopped trying."),
    )
    with Runtime(_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(name="charge")
        def charge_card(card: str, cents: int) -> str:
            """Charge a card."""
            runs.append(card)
            raise RuntimeError(f"gateway 502 for key {SECRET} at /srv/pay/keys.toml")

        rt.session("s1", channel="chat").send("charge my card 5 dollars")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "The payment service keeps failing; I stopped trying."
    assert runs == ["4242"] * 3
    records = list(store.read_stream("session:s1"))
    [blocked] = of(ToolBlocked, records)
    assert (blocked.call_id, blocked.rule, blocked.failures) == ("c3", "same_call", 3)
    tool_texts = [e.content for e in of(MessageAppended, records) if e.role == "tool"]
    assert tool_texts[0] == ("The tool 'charge' failed: it raised an unexpected error.")
    assert "was blocked and not run" in tool_texts[3]
    everything = [msgspec.json.encode(r.event).decode() for r in store.read_all()]
    everything += [m.text for m in chat.messages] + [repr(line) for line in logs]
    assert not [text for text in everything if SECRET in text or "keys.toml" in text]
    report = verify_store(store, None)
    assert report.findings == ()
    assert report.checked["tool:blocked"] == 1
