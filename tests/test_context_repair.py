"""Provider validity for OpenAI and Anthropic: pairs together, synthetic results (issue 6)."""

from __future__ import annotations

from stalwart.context import SYNTHETIC_RESULT, ContextMessage, repair, validity_violations
from stalwart.events import ToolCall


def msg(mid: str, role: str, content: str = "", **extra: object) -> ContextMessage:
    return ContextMessage(message_id=mid, seq=0, role=role, content=content, **extra)  # type: ignore[arg-type]


def call(cid: str) -> ToolCall:
    return ToolCall(id=cid, name="f", arguments="{}")


def test_a_dangling_final_call_gets_a_marked_synthetic_result() -> None:
    fixed, changes = repair(
        [msg("u", "user", "hi"), msg("a", "assistant", tool_calls=(call("c"),))]
    )
    assert changes == 1
    assert fixed[-1].role == "tool"
    assert fixed[-1].tool_call_id == "c"
    assert fixed[-1].content == SYNTHETIC_RESULT
    assert fixed[-1].message_id == "synthetic:c"
    assert validity_violations(fixed) == []


def test_parallel_results_follow_their_calls_in_call_order() -> None:
    messages = [
        msg("u", "user", "go"),
        msg("a", "assistant", tool_calls=(call("c1"), call("c2"), call("c3"))),
        msg("r3", "tool", "3", tool_call_id="c3"),
        msg("r1", "tool", "1", tool_call_id="c1"),
        msg("r2", "tool", "2", tool_call_id="c2"),
    ]
    assert validity_violations(messages) == []  # any order within the block is valid
    fixed, _ = repair(messages)
    assert [m.message_id for m in fixed] == ["u", "a", "r1", "r2", "r3"]


def test_an_orphan_result_is_dropped_with_nothing_else() -> None:
    messages = [
        msg("u", "user", "go"),
        msg("r", "tool", "x", tool_call_id="gone"),
        msg("b", "assistant", "done"),
    ]
    assert validity_violations(messages)
    fixed, changes = repair(messages)
    assert [m.message_id for m in fixed] == ["u", "b"]
    assert changes == 1
    assert validity_violations(fixed) == []


def test_a_result_separated_from_its_call_is_moved_back() -> None:
    messages = [
        msg("u", "user", "go"),
        msg("a", "assistant", tool_calls=(call("c"),)),
        msg("u2", "user", "still there?"),
        msg("r", "tool", "x", tool_call_id="c"),
    ]
    assert validity_violations(messages, "openai")
    assert validity_violations(messages, "anthropic")
    fixed, _ = repair(messages)
    assert [m.message_id for m in fixed] == ["u", "a", "r", "u2"]
    assert validity_violations(fixed) == []


def test_anthropic_needs_a_user_turn_first_and_no_empty_turns() -> None:
    messages = [msg("s", "system", "sys"), msg("a", "assistant", "hello"), msg("e", "user", "")]
    problems = validity_violations(messages, "anthropic")
    assert any("first turn" in p for p in problems)
    fixed, _ = repair(messages)
    assert fixed[1].role == "user"
    assert fixed[1].message_id == "synthetic:opening"
    assert [m.message_id for m in fixed] == ["s", "synthetic:opening", "a"]
    assert validity_violations(fixed) == []


def test_the_checker_sees_unanswered_calls_and_results_not_first() -> None:
    unanswered = [
        msg("u", "user", "go"),
        msg("a", "assistant", tool_calls=(call("c"),)),
        msg("b", "assistant", "done"),
    ]
    assert any("not answered" in p for p in validity_violations(unanswered, "openai"))
    assert any("no tool_result" in p for p in validity_violations(unanswered, "anthropic"))
    text_first = [
        msg("u", "user", "go"),
        msg("a", "assistant", tool_calls=(call("c"),)),
        msg("u2", "user", "x"),
        msg("r", "tool", "y", tool_call_id="c"),
    ]
    assert any("must come first" in p for p in validity_violations(text_first, "anthropic"))
