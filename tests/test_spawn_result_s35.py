"""Session 35: what a parent's ``spawn_subagent`` call answers, and a run's failure notice.

Real parts: an LMDB directory, the loopback ``FakeProvider``, a ``FakeClock``-driven
Runtime; ``replay --verify`` runs on the logs the tests write.
"""

from __future__ import annotations

import pytest

from stalwart.channels import Channel, MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.events import MessageAppended, SubagentCompleted, SubagentSpawned, ToolCompleted
from stalwart.runtime import SPAWN_TOOL, Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from stalwart.tools import ToolRegistry
from tests._runtime_support import agent_settings, of, runtime_config, until

TASK = "write the long report"


def config(base_url: str, **subagents: object) -> Config:
    agent = agent_settings(prompt_timeout_ms=3_600_000, subagents=True)
    return runtime_config(base_url, agents={"default": agent}, subagents=dict(subagents))


def _spawn_call(call_id: str = "c1") -> FakeToolCall:
    arguments = {"task": TASK, "task_class": "formatting"}
    return FakeToolCall(id=call_id, name=SPAWN_TOOL, arguments=arguments)


def _runs(store: EventStore) -> dict[str, SubagentSpawned]:
    """Every run in the log, by stream: its spawn."""
    found = {}
    for info in store.streams():
        first = next(iter(store.read_stream(info.stream, 1, 1)))
        if isinstance(first.event, SubagentSpawned):
            found[info.stream] = first.event
    return found


def _tool_result(fake: FakeProvider, call_id: str) -> str:
    """What the parent's model read as the result of call ``call_id``."""
    for request in reversed(fake.requests):
        for message in reversed(request.body["messages"]):
            if message.get("role") == "tool" and message.get("tool_call_id") == call_id:
                return str(message["content"])
    raise AssertionError(f"no request holds the result of {call_id}")


def _reply(chat: MemoryChannel) -> str:
    replies = until(lambda: [m.text for m in chat.messages if m.kind == "reply"])
    return str(replies[0])


def _verified(store: EventStore) -> None:
    report = verify_store(store, None)  # replay --verify: every decision follows
    assert report.findings == (), [f"{f.kind} {f.tag}: {f.message}" for f in report.findings]


# Was: DEFECT: a sub-agent's 300 KB answer went whole into the parent's turn, its model request and its log  # noqa: E501
@pytest.mark.parametrize("limit", [None, 2_000])
def test_a_sub_agents_long_answer_is_cut_to_the_tools_limit_naming_its_stream(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, limit: int | None
) -> None:
    """The limit is the runtime's registry's (50,000 bytes unless the host set one)."""
    line = "a line of the sub-agent's very long report\n"
    answer = line * (300_000 // len(line))  # about 300 KB
    fake.add(
        Answer(text="", tool_calls=(_spawn_call(),)),  # the parent spawns
        Answer(text=answer, chunks=8),  # the sub-agent answers at length
    )
    fake.set_default(Answer(text="Here is the gist."))  # the parent, with the result
    tools = ToolRegistry() if limit is None else ToolRegistry(max_result_bytes=limit)
    settings = config(fake.base_url)
    channels: dict[str, Channel] = {"chat": chat}
    with Runtime(settings, store=store, clock=clock, channels=channels, tools=tools) as rt:
        rt.session("s1", channel="chat").send("write it")
        assert _reply(chat) == "Here is the gist."
    bound = limit or 50_000
    [run] = _runs(store)
    read = _tool_result(fake, "c1")
    assert len(read.encode()) < bound + 400
    assert read.startswith(line)
    assert f"stream {run}." in read  # where the whole answer is kept
    assert f"limit of {bound:,} bytes" in read
    parent = list(store.read_stream("session:s1"))
    [done] = of(ToolCompleted, parent)
    assert done.output == read
    assert all(len(m.content) < bound + 400 for m in of(MessageAppended, parent))
    [completed] = of(SubagentCompleted, list(store.read_stream(run)))
    assert completed.result == answer  # the run's own log keeps it whole
    _verified(store)
