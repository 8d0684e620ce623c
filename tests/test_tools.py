"""Tools: registration and schemas, validated execution, timeouts, bounded parallelism."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import anyio
import msgspec
import pytest

from stalwart.errors import ToolError, ToolRegistrationError
from stalwart.events import ToolBlocked, ToolCall, ToolCompleted, ToolFailed, ToolStarted
from stalwart.providers import ToolSpec as ProviderToolSpec
from stalwart.tools import (
    ToolRegistry,
    blocked_outcome,
    outcome_event,
    run_tool,
    run_tools,
    started_event,
)

pytestmark = pytest.mark.anyio

#: Far more than any single test needs: a test that hangs fails here, not at the global timeout.
GUARD = 5.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Point(msgspec.Struct):
    x: int
    y: int = 0


@dataclasses.dataclass
class Box:
    label: str
    corners: list[Point] = dataclasses.field(default_factory=list)


def _schema(fn: Any, **options: Any) -> dict[str, Any]:
    registry = ToolRegistry()
    registry.register(fn, **options)
    (spec,) = registry.specs()
    return spec.parameters


def call(name: str, arguments: str = "{}", id: str = "c1") -> ToolCall:
    return ToolCall(id=id, name=name, arguments=arguments)


# -- registration and schemas ---------------------------------------------------------


def test_schema_of_scalars_defaults_and_optionals() -> None:
    def search(
        query: str, limit: int = 10, ratio: float = 0.5, exact: bool = False, tag: str | None = None
    ) -> list[str]:
        return []

    assert _schema(search) == {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "default": 10},
            "ratio": {"type": "number", "default": 0.5},
            "exact": {"type": "boolean", "default": False},
            "tag": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        },
        "required": ["query"],
        "additionalProperties": False,
    }


def test_schema_of_containers_literals_and_nested_types_is_self_contained() -> None:
    def draw(
        points: list[Point],
        meta: dict[str, int],
        mode: Literal["fast", "exact"] = "fast",
        box: Box | None = None,
    ) -> None:
        """Draw shapes.

        The second paragraph is not part of the description.
        """

    registry = ToolRegistry()
    registry.register(draw)
    (spec,) = registry.specs()
    assert spec.description == "Draw shapes."
    properties = spec.parameters["properties"]
    point = {
        "title": "Point",
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
        "required": ["x"],
    }
    assert properties["points"] == {"type": "array", "items": point}
    assert properties["meta"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert properties["mode"] == {"enum": ["exact", "fast"], "default": "fast"}  # msgspec sorts
    box = properties["box"]["anyOf"][0]
    assert box["properties"]["corners"]["items"] == point
    assert spec.parameters["required"] == ["points", "meta"]
    assert "$defs" not in spec.parameters
    assert "$ref" not in msgspec.json.encode(spec.parameters).decode()


class Tree(msgspec.Struct):
    name: str
    children: list[Tree] = []


def test_a_recursive_type_keeps_its_definition_under_defs() -> None:
    def plant(tree: Tree) -> None:
        pass

    schema = _schema(plant)
    assert schema["properties"]["tree"]["properties"]["children"]["items"] == {
        "$ref": "#/$defs/Tree"
    }
    assert schema["$defs"]["Tree"]["properties"]["name"] == {"type": "string"}


def test_annotated_meta_gives_a_parameter_description() -> None:
    def fetch(url: Annotated[str, msgspec.Meta(description="The page to fetch")]) -> str:
        return url

    assert _schema(fetch)["properties"]["url"] == {
        "type": "string",
        "description": "The page to fetch",
    }


def test_an_explicit_schema_and_description_are_used_as_given() -> None:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}

    def search(q: str) -> str:
        """Ignored."""
        return q

    registry = ToolRegistry()
    registry.register(search, name="find", description="Find things.", parameters=parameters)
    (spec,) = registry.specs()
    assert (spec.name, spec.description, spec.parameters) == ("find", "Find things.", parameters)
    assert spec == ProviderToolSpec(**msgspec.structs.asdict(spec))  # one type for both


def test_register_works_as_a_decorator_with_and_without_options() -> None:
    registry = ToolRegistry()

    @registry.register
    def one() -> int:
        return 1

    @registry.register(name="two", timeout_ms=1_000, needs_confirmation=True)
    async def second() -> int:
        return 2

    assert one() == 1  # the function itself comes back
    assert registry.names() == ("one", "two")
    tool = registry.get("two")
    assert tool is not None
    assert (tool.is_async, tool.timeout_ms, tool.needs_confirmation) == (True, 1_000, True)
    assert registry.get("missing") is None
    assert "one" in registry
    assert len(registry) == 2


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "tool.name", "é", "<lambda>"])
def test_names_that_providers_refuse_are_refused(name: str) -> None:
    registry = ToolRegistry()
    with pytest.raises(ToolRegistrationError, match="not allowed") as caught:
        registry.register(lambda: None, name=name)
    assert caught.value.field == "name"


def test_a_lambda_needs_a_name_and_a_64_character_name_is_fine() -> None:
    registry = ToolRegistry()
    with pytest.raises(ToolRegistrationError, match="'<lambda>'"):
        registry.register(lambda: None)
    registry.register(lambda: None, name="x" * 64)
    assert registry.names() == ("x" * 64,)


def test_a_duplicate_name_is_refused() -> None:
    registry = ToolRegistry()
    registry.register(lambda: 1, name="same")
    with pytest.raises(ToolRegistrationError, match="'same' is already registered") as caught:
        registry.register(lambda: 2, name="same")
    assert (caught.value.field, caught.value.tool) == ("name", "same")


class Opaque:
    pass


def test_signatures_json_cannot_call_are_refused() -> None:
    def positional(a: int, /) -> None:
        pass

    def star(*values: int) -> None:
        pass

    def opaque(thing: Opaque) -> None:
        pass

    class Local:
        pass

    def local(thing: Local) -> None:  # a hint that cannot be resolved later
        pass

    registry = ToolRegistry()
    for fn in (positional, star):
        with pytest.raises(ToolRegistrationError, match="must accept a keyword"):
            registry.register(fn)
    with pytest.raises(ToolRegistrationError, match="no JSON schema") as caught:
        registry.register(opaque)
    assert caught.value.field == "parameters"
    registry.register(opaque, parameters={"type": "object"})  # given: names are still checked
    with pytest.raises(ToolRegistrationError, match="cannot resolve the type hints"):
        registry.register(local)


@pytest.mark.parametrize("bad", [None, 0, -5, 1.5, True])
def test_a_timeout_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ToolRegistrationError, match="timeout_ms") as caught:
        ToolRegistry().register(lambda: None, name="t", timeout_ms=bad)
    assert caught.value.field == "timeout_ms"


@pytest.mark.parametrize("bad", [{"type": "string"}, ["x"], {"type": "object", "x": object()}])
def test_an_explicit_schema_must_be_a_json_object_schema(bad: Any) -> None:
    with pytest.raises(ToolRegistrationError) as caught:
        ToolRegistry().register(lambda: None, name="t", parameters=bad)
    assert caught.value.field == "parameters"


# -- execution ------------------------------------------------------------------------


@pytest.fixture
def registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.register
    def add(a: int, b: int = 1) -> int:
        return a + b

    @registry.register
    async def greet(name: str, box: Box | None = None) -> str:
        await anyio.sleep(0)
        return f"hello {name}" + (f" in {box.label} {box.corners}" if box else "")

    @registry.register
    def nothing() -> None:
        pass

    @registry.register
    def opaque() -> object:
        return object()

    @registry.register
    def denied(path: str) -> str:
        raise PermissionError(13, "Permission denied", "/secret/token.txt")

    @registry.register
    def explained() -> str:
        raise ToolError("the calendar is read-only today", error_class="not_supported")

    @registry.register
    def extra(base: int, **rest: Any) -> dict[str, Any]:
        return {"base": base, **rest}

    return registry


async def test_a_sync_tool_runs_with_validated_arguments(registry: ToolRegistry) -> None:
    outcome = await run_tool(registry, call("add", '{"a": 2, "b": 40}'))
    assert (outcome.status, outcome.text, outcome.error_class) == ("ok", "42", None)
    assert (await run_tool(registry, call("add", '{"a": 2}'))).text == "3"


async def test_an_async_tool_gets_nested_values_as_their_types(registry: ToolRegistry) -> None:
    arguments = '{"name": "ada", "box": {"label": "b", "corners": [{"x": 1}]}}'
    outcome = await run_tool(registry, call("greet", arguments))
    assert outcome.text == "hello ada in b [Point(x=1, y=0)]"


async def test_results_are_text_or_json(registry: ToolRegistry) -> None:
    assert (await run_tool(registry, call("nothing"))).text == "null"
    assert (await run_tool(registry, call("nothing", ""))).status == "ok"  # empty means {}
    extra = await run_tool(registry, call("extra", '{"base": 1, "more": [1, 2]}'))
    assert extra.text == '{"base":1,"more":[1,2]}'
    opaque = await run_tool(registry, call("opaque"))
    assert (opaque.status, opaque.error_class) == ("error", "unencodable_result")


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ('{"a": "two"}', "Expected `int`, got `str` - at `$.a`"),
        ("{}", "missing required field `a`"),
        ('{"a": 1, "c": 2}', "unknown field `c`"),
        ('{"a": 1', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ('{"a": true}', "Expected `int`, got `bool`"),
    ],
)
async def test_invalid_arguments_are_an_outcome_never_an_exception(
    registry: ToolRegistry, arguments: str, reason: str
) -> None:
    outcome = await run_tool(registry, call("add", arguments))
    assert (outcome.status, outcome.error_class, outcome.action) == (
        "invalid_arguments",
        "invalid_arguments",
        "surface",
    )
    assert reason in outcome.text
    assert outcome.text.startswith("The arguments for tool 'add' are invalid:")


async def test_an_unknown_tool_names_the_available_ones(registry: ToolRegistry) -> None:
    outcome = await run_tool(registry, call("subtract"))
    assert outcome.status == "unknown_tool"
    assert outcome.text.startswith("There is no tool named 'subtract'. The available tools are:")
    assert "add, greet" in outcome.text


async def test_an_exception_is_classified_and_its_text_never_reaches_the_model(
    registry: ToolRegistry,
) -> None:
    outcome = await run_tool(registry, call("denied", '{"path": "x"}'))
    assert (outcome.status, outcome.error_class, outcome.action) == (
        "error",
        "permission_denied",
        "alternative",
    )
    assert outcome.text == (
        "The tool 'denied' failed: permission was denied. Try different arguments or another tool."
    )
    assert "secret" not in outcome.text


async def test_a_tool_error_speaks_to_the_model_in_its_own_words(registry: ToolRegistry) -> None:
    outcome = await run_tool(registry, call("explained"))
    assert outcome.text == "The tool 'explained' failed: the calendar is read-only today"
    assert (outcome.error_class, outcome.action) == ("not_supported", "alternative")


# -- timeouts -------------------------------------------------------------------------


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets an abandoned sync tool's thread finish when the test is done."""
    event = threading.Event()
    yield event
    event.set()


async def test_an_async_tool_past_its_timeout_is_cancelled() -> None:
    registry = ToolRegistry()
    cancelled = anyio.Event()

    @registry.register(timeout_ms=100)
    async def hang() -> str:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        return "never"

    with anyio.fail_after(GUARD):
        outcome = await run_tool(registry, call("hang"))
    assert (outcome.status, outcome.error_class, outcome.action) == ("timeout", "timeout", "retry")
    assert "time limit of 0.1 s" in outcome.text
    assert cancelled.is_set()
    assert 100 <= outcome.elapsed_ms < 100 + GUARD * 1000


async def test_a_sync_tool_that_overruns_is_abandoned_and_reported_promptly(
    release: threading.Event,
) -> None:
    registry = ToolRegistry()
    finished = threading.Event()

    @registry.register(timeout_ms=200)
    def stuck() -> str:
        release.wait(GUARD * 2)
        finished.set()
        return "late"

    started = anyio.current_time()
    with anyio.fail_after(GUARD):
        outcome = await run_tool(registry, call("stuck"))
    waited = anyio.current_time() - started
    assert outcome.status == "timeout"
    assert 0.2 <= waited < 2.0  # reported when its budget ran out, not when the thread ends
    assert not finished.is_set()  # the thread is still running in the background
    release.set()


async def test_each_tool_has_its_own_timeout() -> None:
    registry = ToolRegistry()

    @registry.register(timeout_ms=100)
    async def quick_limit() -> str:
        await anyio.sleep(0.3)
        return "late"

    @registry.register(timeout_ms=3_000)
    async def long_limit() -> str:
        await anyio.sleep(0.3)
        return "in time"

    with anyio.fail_after(GUARD):
        short, long = await run_tools(
            registry, [call("quick_limit", id="1"), call("long_limit", id="2")], limit=2
        )
    assert (short.status, long.status, long.text) == ("timeout", "ok", "in time")


# -- parallelism ----------------------------------------------------------------------


class Gauge:
    """Counts tools running at once (from tasks and threads alike)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)

    def leave(self) -> None:
        with self.lock:
            self.running -= 1


@pytest.mark.parametrize("limit", [1, 3])
async def test_at_most_limit_calls_run_at_once_and_outcomes_keep_the_calls_order(
    limit: int,
) -> None:
    registry = ToolRegistry()
    gauge = Gauge()

    @registry.register
    async def work(n: int) -> int:
        gauge.enter()
        try:
            await anyio.sleep(0.02 * (n % 3))  # later calls finish first, some at once
        finally:
            gauge.leave()
        return n

    @registry.register
    def blocking(n: int) -> int:
        gauge.enter()
        try:
            threading.Event().wait(0.02)
        finally:
            gauge.leave()
        return n

    calls = [call("work" if n % 2 else "blocking", f'{{"n": {n}}}', id=str(n)) for n in range(10)]
    with anyio.fail_after(GUARD):
        outcomes = await run_tools(registry, calls, limit=limit)
    assert [outcome.call_id for outcome in outcomes] == [str(n) for n in range(10)]
    assert [outcome.text for outcome in outcomes] == [str(n) for n in range(10)]
    assert gauge.peak == limit


async def test_run_tools_refuses_a_limit_below_one(registry: ToolRegistry) -> None:
    with pytest.raises(ValueError, match="limit"):
        await run_tools(registry, [call("nothing")], limit=0)


# -- events ---------------------------------------------------------------------------


async def test_outcomes_become_the_events_the_agent_appends(registry: ToolRegistry) -> None:
    done = await run_tool(registry, call("add", '{"a": 1}', id="c1"))
    assert outcome_event(done) == ToolCompleted(
        call_id="c1", tool="add", output="2", duration_ms=done.elapsed_ms
    )
    failed = await run_tool(registry, call("denied", '{"path": "p"}', id="c2"))
    assert outcome_event(failed) == ToolFailed(
        call_id="c2", tool="denied", error_class="permission_denied", retryable=False
    )
    invalid = await run_tool(registry, call("add", "{}", id="c3"))
    assert outcome_event(invalid) == ToolFailed(
        call_id="c3", tool="add", error_class="invalid_arguments"
    )
    blocked = ToolBlocked(call_id="c4", tool="add", rule="same_call", failures=3, threshold=3)
    outcome = blocked_outcome(call("add", id="c4"), blocked)
    assert (outcome.status, outcome_event(outcome)) == ("blocked", blocked)
    assert started_event(call("add", '{"a": 1}', id="c5"), turn_id="t1") == ToolStarted(
        call_id="c5", tool="add", arguments='{"a": 1}', turn_id="t1"
    )


async def test_a_timeout_is_a_retryable_timed_out_failure() -> None:
    registry = ToolRegistry()

    @registry.register(timeout_ms=100)
    async def hang() -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(GUARD):
        outcome = await run_tool(registry, call("hang", id="c9"))
    assert outcome_event(outcome) == ToolFailed(
        call_id="c9", tool="hang", error_class="timeout", retryable=True, timed_out=True
    )


async def test_with_an_explicit_schema_untyped_parameters_are_still_checked_by_name() -> None:
    registry = ToolRegistry()

    def describe(thing: Opaque, detail: int = 0) -> str:
        return f"{type(thing).__name__} {detail}"

    registry.register(describe, parameters={"type": "object"})
    assert (await run_tool(registry, call("describe", '{"thing": 1}'))).text == "int 0"
    missing = await run_tool(registry, call("describe", "{}"))
    assert missing.status == "invalid_arguments"
    assert "missing required field `thing`" in missing.text
