"""Tool results paired with their calls by position when a provider reuses call ids
(numbering them per response: ``call_0`` on every turn): both the context engine's
``repair`` and the request ``stalwart run`` builds from the log."""

from __future__ import annotations

from stalwart.actors import UNANSWERED_TOOL_TEXT, request_messages
from stalwart.context import SYNTHETIC_RESULT, repair, validity_violations
from stalwart.events import ToolCall
from stalwart.providers import Message
from tests.test_context_pipeline import Transcript


def _interrupted_then_reused() -> Transcript:
    """``read a`` left unanswered (an interrupted turn), then ``read b0`` under the same
    id, answered."""
    transcript = Transcript()
    transcript.user("read a")
    transcript.add(
        "assistant", "", tool_calls=[{"id": "call_0", "name": "read", "arguments": '{"f":"a"}'}]
    )
    transcript.user("never mind, read b0")
    transcript.add(
        "assistant", "", tool_calls=[{"id": "call_0", "name": "read", "arguments": '{"f":"b0"}'}]
    )
    transcript.add("tool", "contents of b0", tool_call_id="call_0", name="read")
    return transcript


# Was: DEFECT: repair gave a reused call id's result to the earliest call with that id (a later call's result answered an interrupted one)  # noqa: E501
def test_repair_gives_a_result_to_the_nearest_call_before_it() -> None:
    repaired, changes = repair(_interrupted_then_reused().all)
    assert not validity_violations(repaired)
    contents = [(m.role, m.content) for m in repaired if m.role in ("assistant", "tool")]
    assert contents == [
        ("assistant", ""),
        ("tool", SYNTHETIC_RESULT),  # read a: no result
        ("assistant", ""),
        ("tool", "contents of b0"),  # read b0: its own
    ]
    assert changes == 1


def test_a_result_recorded_after_a_user_message_still_finds_its_call() -> None:
    """A step paused for an approval: the user's message is recorded before its result."""
    transcript = Transcript()
    transcript.user("deploy")
    transcript.add("assistant", "", tool_calls=[{"id": "c1", "name": "deploy", "arguments": "{}"}])
    transcript.user("and tell me when done")
    transcript.add("tool", "deployed", tool_call_id="c1", name="deploy")
    repaired, _ = repair(transcript.all)
    assert not validity_violations(repaired)
    assert [m.content for m in repaired][-3:] == ["", "deployed", "and tell me when done"]


# Was: DEFECT: the request `stalwart run` sends gave a reused call id's result to the earliest call with that id  # noqa: E501
def test_the_request_from_the_log_answers_each_call_with_its_own_result() -> None:
    def call(args: str) -> ToolCall:
        return ToolCall(id="call_0", name="read", arguments=args)

    log = (
        Message(role="user", content="read a"),
        Message(role="assistant", content="", tool_calls=(call('{"f":"a"}'),)),
        Message(role="user", content="never mind, read b0"),
        Message(role="assistant", content="", tool_calls=(call('{"f":"b0"}'),)),
        Message(role="tool", content="contents of b0", tool_call_id="call_0"),
    )
    sent = request_messages(log)
    assert [(m.role, m.content) for m in sent] == [
        ("user", "read a"),
        ("assistant", ""),
        ("tool", UNANSWERED_TOOL_TEXT),
        ("user", "never mind, read b0"),
        ("assistant", ""),
        ("tool", "contents of b0"),
    ]
