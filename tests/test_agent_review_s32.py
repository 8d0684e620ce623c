"""Review s32 of the Agent actor (a session's turn loop): defects proven by tests that
failed before their fix (each carries a ``# Was: DEFECT:`` line).

Real parts throughout: an LMDB store in ``tmp_path``, the fake provider over loopback
HTTP, the runtime on a ``FakeClock`` that no test advances unless it says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from stalwart.actors import UNANSWERED_TOOL_TEXT, UserMessage
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    MessageAppended,
    SessionRequiresAction,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import delivered, has, log_until, of, runtime_config, settled


def _pairing_problems(messages: list[dict[str, Any]]) -> list[str]:
    """What OpenAI's Chat Completions refuses in a request's messages: a tool result that
    does not follow the assistant message calling it (only results between them), a call
    answered twice, a call with no result before the next message of another role."""
    problems: list[str] = []
    waiting: list[str] = []  # the calls of the last assistant message not answered yet
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if call_id not in waiting:
                problems.append(f"#{index}: result {call_id!r} follows no call of its own")
            else:
                waiting.remove(call_id)
            continue
        if waiting:
            problems.append(f"#{index}: calls {waiting} have no result before it")
        calls = message.get("tool_calls") or []
        waiting = [call["id"] for call in calls] if message["role"] == "assistant" else []
    if waiting:
        problems.append(f"the end: calls {waiting} have no result")
    return problems


def _paused_then_written_to(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Session ``s1``: a refund that needs an approval pauses it, the user writes while
    it waits, the operator allows it; the wake that answers records the user's message
    before the step's result (the message joins when its wake starts, never mid-turn)."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            return "refunded"

        call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refund done."))
        session = rt.session("s1", channel="chat")
        session.send("refund order 7")
        records = log_until(store, "session:s1", has(ActivationBlocked))
        session.send("any news?")
        [request] = of(SessionRequiresAction, records)
        rt.confirm("s1", request.request_id, allow=True)
        log_until(store, "session:s1", has(ActivationAcked))
        settled(store, "s1")
        assert delivered(rt, chat, 2)[1].text == "Refund done."


# Was: DEFECT: `run --session` sent a result recorded after a later user message as an orphan
def test_run_session_sends_each_result_right_after_its_call_wherever_the_log_holds_it(
    tmp_path: Path, store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # request_messages answered the call with UNANSWERED_TOOL_TEXT where the user's
    # message came, then sent the real result after that message, where no call precedes
    # it: OpenAI refuses such a request (400), Anthropic too, so every later
    # `stalwart run --session s1` failed with "every configured model failed"
    _paused_then_written_to(store, clock, fake, chat)
    roles = [
        (e.role, e.content) for e in of(MessageAppended, list(store.read_stream("session:s1")))
    ]
    assert roles[1:4] == [("assistant", ""), ("user", "any news?"), ("tool", "refunded")]
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[store]\nlocation = "{tmp_path / "store"}"\n\n'
        f'[providers.main]\nkind = "openai"\nbase_url = "{fake.base_url}"\n\n'
        '[agents.default]\nprovider = "main"\nmodel = "m1"\nmax_retries = 0\n'
    )
    fake.add(Answer(text="You are welcome."))
    result = CliRunner().invoke(cli, ["run", "--config", str(config), "--session", "s1", "thanks"])
    assert (result.exit_code, result.stdout) == (0, "You are welcome.\n")
    sent: list[dict[str, Any]] = fake.requests[-1].body["messages"]
    assert _pairing_problems(sent) == []
    [result_sent] = [m for m in sent if m["role"] == "tool"]
    assert (result_sent["tool_call_id"], result_sent["content"]) == ("c1", "refunded")
    assert UNANSWERED_TOOL_TEXT not in [m["content"] for m in sent]
    assert [m["content"] for m in sent if m["role"] == "user"] == [
        "refund order 7",
        "any news?",
        "thanks",
    ]


# Was: DEFECT: a UserMessage told to a durable session's Agent waited for the worker's next poll
def test_a_user_message_told_to_a_durable_agent_is_run_at_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # _record_message recorded the activation but nudged the worker only on a path no
    # append reaches: the message waited for the worker's poll (poll_ms, 1 s by default;
    # on this clock, which nothing advances, for ever)
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        session = rt.session("s1", channel="chat")
        session.ref.tell(UserMessage("hello", "m1"))
        [reply] = delivered(rt, chat, 1)
        assert reply.text == "default answer"
