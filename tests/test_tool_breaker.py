"""The tool retry breaker: classification, canonical arguments, the fold and its three rules."""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stalwart.errors import ToolError
from stalwart.events import (
    Event,
    RecordedEvent,
    ToolBlocked,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnStarted,
)
from stalwart.tools import (
    ToolBreakerState,
    apply_tool_breaker,
    blocked_text,
    canonical_arguments,
    classify_tool_error,
    decide_tool_call,
    fold_tool_breaker,
)

# -- classification -------------------------------------------------------------------


class ConnectTimeout(Exception):  # how httpx names one
    pass


class AccessDeniedError(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TimeoutError(), ("timeout", "retry")),
        (ConnectionRefusedError(), ("connection", "retry")),
        (ConnectionResetError(), ("connection", "retry")),
        (PermissionError(), ("permission_denied", "alternative")),
        (OSError(errno.EACCES, "denied"), ("permission_denied", "alternative")),
        (FileNotFoundError(), ("not_found", "alternative")),
        (OSError(errno.ENOENT, "gone"), ("not_found", "alternative")),
        (NotImplementedError(), ("not_supported", "alternative")),
        (ConnectTimeout(), ("timeout", "retry")),
        (AccessDeniedError(), ("permission_denied", "alternative")),
        (ValueError("bad date"), ("invalid_value", "surface")),
        (OSError(errno.ENOSPC, "full"), ("os_error", "surface")),
        (RuntimeError("boom"), ("exception", "surface")),
        (KeyError("k"), ("exception", "surface")),
        (ToolError("busy", error_class="rate_limited"), ("rate_limited", "retry")),
        (ToolError("flaky", error_class="mine", retryable=True), ("mine", "retry")),
        (ToolError("no"), ("tool_error", "surface")),
    ],
)
def test_errors_are_classified(exc: BaseException, expected: tuple[str, str]) -> None:
    assert classify_tool_error(exc) == expected


# -- canonical arguments --------------------------------------------------------------


def test_canonical_arguments_sort_keys_at_every_depth() -> None:
    assert canonical_arguments('{"b":1,"a":{"y":2,"x":1}}') == '{"a":{"x":1,"y":2},"b":1}'
    assert canonical_arguments('{"a": {"x": 1, "y": 2}, "b": 1}') == '{"a":{"x":1,"y":2},"b":1}'
    assert canonical_arguments('[{"b": 1, "a": 2}]') == '[{"a":2,"b":1}]'
    assert canonical_arguments("") == "{}"
    assert canonical_arguments("{not json") == "{not json"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=4)
    ),
    max_leaves=12,
)


def _shuffled(value: Any, data: st.DataObject) -> Any:
    """``value`` with every object's keys in a random order (the same JSON value)."""
    if isinstance(value, dict):
        keys = data.draw(st.permutations(list(value)))
        return {key: _shuffled(value[key], data) for key in keys}
    if isinstance(value, list):
        return [_shuffled(item, data) for item in value]
    return value


@given(value=st.dictionaries(st.text(max_size=3), json_values, max_size=5), data=st.data())
def test_key_order_never_matters_at_any_depth(value: dict[str, Any], data: st.DataObject) -> None:
    one = json.dumps(value)
    other = json.dumps(_shuffled(value, data), indent=data.draw(st.sampled_from([None, 2])))
    assert canonical_arguments(one) == canonical_arguments(other)
    assert json.loads(canonical_arguments(one)) == value


@given(value=json_values, data=st.data())
def test_the_breaker_counts_reordered_arguments_as_the_same_call(
    value: Any, data: st.DataObject
) -> None:
    arguments = {"q": value, "opts": {"b": 1, "a": [value]}}
    events: list[Event] = []
    for n in range(3):
        text = json.dumps(_shuffled(arguments, data))
        events += [start(f"c{n}", "search", text), fail(f"c{n}", "search")]
    blocked = decide_tool_call(fold_tool_breaker(events), "search", json.dumps(arguments))
    assert blocked is not None
    assert blocked.rule == "same_call"


# -- the rules ------------------------------------------------------------------------


def start(call_id: str, tool: str = "search", arguments: str = '{"q": "x"}') -> ToolStarted:
    return ToolStarted(call_id=call_id, tool=tool, arguments=arguments)


def fail(call_id: str, tool: str = "search", error_class: str = "timeout") -> ToolFailed:
    return ToolFailed(call_id=call_id, tool=tool, error_class=error_class)


def ok(call_id: str, tool: str = "search") -> ToolCompleted:
    return ToolCompleted(call_id=call_id, tool=tool, output="fine")


def failures(n: int, *, tool: str = "search", arguments: str = '{"q": "x"}', **kw: Any) -> list:
    events: list[Event] = []
    for i in range(n):
        call_id = f"{tool}-{arguments}-{i}"
        events += [start(call_id, tool, arguments), fail(call_id, tool, **kw)]
    return events


def test_same_call_blocks_at_the_third_consecutive_failure() -> None:
    assert decide_tool_call(fold_tool_breaker(failures(2)), "search", '{"q": "x"}') is None
    state = fold_tool_breaker(failures(3))
    blocked = decide_tool_call(state, "search", '{"q":"x"}', call_id="c9")
    assert blocked == ToolBlocked(
        call_id="c9",
        tool="search",
        rule="same_call",
        failures=3,
        threshold=3,
        arguments='{"q":"x"}',
    )
    assert decide_tool_call(state, "search", '{"q": "y"}') is None  # other arguments: fine


def test_same_tool_blocks_at_the_fifth_failure_whatever_the_arguments() -> None:
    events: list[Event] = []
    for n in range(4):
        events += failures(1, arguments=f'{{"q": {n}}}')
    assert decide_tool_call(fold_tool_breaker(events), "search", '{"q": "new"}') is None
    events += failures(1, arguments='{"q": 4}')
    blocked = decide_tool_call(fold_tool_breaker(events), "search", '{"q": "new"}')
    assert blocked is not None
    assert (blocked.rule, blocked.failures, blocked.threshold) == ("same_tool", 5, 5)
    assert decide_tool_call(fold_tool_breaker(events), "other", "{}") is None


def test_an_error_pattern_blocks_the_tool_at_the_second_occurrence() -> None:
    first = failures(1, arguments='{"path": "/a"}', error_class="permission_denied")
    assert decide_tool_call(fold_tool_breaker(first), "search", '{"path": "/c"}') is None
    both = first + failures(1, arguments='{"path": "/b"}', error_class="permission_denied")
    blocked = decide_tool_call(fold_tool_breaker(both), "search", '{"path": "/c"}')
    assert blocked is not None
    assert (blocked.rule, blocked.pattern, blocked.failures, blocked.threshold) == (
        "error_pattern",
        "permission_denied",
        2,
        2,
    )
    # two different errors that are not patterns do not trip it
    mixed = failures(1, arguments="{}", error_class="not_found") + failures(
        1, arguments='{"a": 1}', error_class="timeout"
    )
    assert decide_tool_call(fold_tool_breaker(mixed), "search", '{"b": 2}') is None


@pytest.mark.parametrize("error_class", ["invalid_arguments", "unknown_tool"])
def test_the_models_own_mistakes_never_block(error_class: str) -> None:
    state = fold_tool_breaker(failures(10, error_class=error_class))
    assert state == ToolBreakerState()
    assert decide_tool_call(state, "search", '{"q": "x"}') is None


def test_a_success_resets_the_call_the_tool_and_its_patterns() -> None:
    events = failures(2) + failures(2, arguments="{}", error_class="permission_denied")
    events += [start("good"), ok("good")]
    state = fold_tool_breaker(events)
    assert state.per_tool == {}
    assert state.patterns == {}
    assert state.same_call == {"search": {"{}": 2}}  # only the call that succeeded is reset
    events += failures(1)  # a failure after the success starts the count again
    assert decide_tool_call(fold_tool_breaker(events), "search", '{"q": "x"}') is None


def test_blocks_and_unmatched_events_are_handled() -> None:
    blocked = ToolBlocked(call_id="b", tool="search", rule="same_tool", failures=5, threshold=5)
    state = fold_tool_breaker([start("b"), blocked, TurnStarted(turn_id="t")])
    assert state == ToolBreakerState()
    # a failure whose start is not in the log counts for its tool, not for a call
    state = fold_tool_breaker([fail("ghost")])
    assert (state.per_tool, state.same_call) == ({"search": 1}, {})


def test_thresholds_are_knobs_and_zero_turns_a_rule_off() -> None:
    state = fold_tool_breaker(failures(3))
    assert decide_tool_call(state, "search", '{"q":"x"}', same_call=4) is None
    assert decide_tool_call(state, "search", '{"q":"x"}', same_call=0) is None
    tool_rule = decide_tool_call(state, "search", '{"q":"x"}', same_call=0, per_tool=3)
    assert tool_rule is not None
    assert tool_rule.rule == "same_tool"


def test_the_blocked_text_says_which_rule_and_what_may_help() -> None:
    same = blocked_text(
        ToolBlocked(call_id="c", tool="search", rule="same_call", failures=3, threshold=3)
    )
    assert "failed 3 times in a row with these same arguments (the limit is 3)" in same
    assert "try different arguments or another tool" in same
    pattern = blocked_text(
        ToolBlocked(
            call_id="c",
            tool="fs",
            rule="error_pattern",
            failures=2,
            threshold=2,
            pattern="permission_denied",
        )
    )
    assert "same error, permission denied (the limit is 2)" in pattern
    tool = blocked_text(
        ToolBlocked(call_id="c", tool="fs", rule="same_tool", failures=5, threshold=5)
    )
    assert "failed 5 times with no success in between" in tool
    assert "another tool" in tool


# -- fold algebra ---------------------------------------------------------------------

TOOLS = ["search", "fetch"]
ARGS = ['{"q": 1}', '{"q": 2}', '{"a": {"y": 1, "x": 2}}']
CLASSES = ["timeout", "permission_denied", "invalid_arguments", "not_found"]


@st.composite
def tool_logs(draw: st.DrawFn) -> list[RecordedEvent]:
    events: list[Event] = []
    for n in range(draw(st.integers(0, 25))):
        call_id = f"c{n}"
        tool = draw(st.sampled_from(TOOLS))
        outcome = draw(st.sampled_from(["ok", "fail", "blocked", "open"]))
        events.append(start(call_id, tool, draw(st.sampled_from(ARGS))))
        if outcome == "ok":
            events.append(ok(call_id, tool))
        elif outcome == "fail":
            events.append(fail(call_id, tool, draw(st.sampled_from(CLASSES))))
        elif outcome == "blocked":
            rule = draw(st.sampled_from(["same_call", "same_tool", "error_pattern"]))
            events.append(
                ToolBlocked(call_id=call_id, tool=tool, rule=rule, failures=3, threshold=3)
            )
    return [
        RecordedEvent(i, "session:s", i + 1, float(i), f"e{i}", None, None, 1, event)
        for i, event in enumerate(events)
    ]


@given(records=tool_logs(), data=st.data())
def test_folding_a_prefix_then_the_rest_equals_folding_all(
    records: list[RecordedEvent], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(records)))
    prefix = fold_tool_breaker(records[:cut])
    assert fold_tool_breaker(records[cut:], prefix) == fold_tool_breaker(records)
    state = ToolBreakerState()
    for record in records:
        state = apply_tool_breaker(state, record)
    assert state == fold_tool_breaker(record.event for record in records)


@given(records=tool_logs())
def test_the_fold_keeps_no_zero_counts_and_decisions_replay(records: list[RecordedEvent]) -> None:
    state = fold_tool_breaker(records)
    assert all(state.per_tool.values())
    assert all(n for counts in state.same_call.values() for n in counts.values())
    assert all(n for counts in state.patterns.values() for n in counts.values())
    for tool in TOOLS:
        for arguments in ARGS:
            decision = decide_tool_call(state, tool, arguments, call_id="next")
            if decision is not None:  # the event alone re-derives the decision
                again = decide_tool_call(state, decision.tool, decision.arguments, call_id="next")
                assert again == decision
