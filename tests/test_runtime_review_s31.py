"""Review s31: configuration, the embedding API (Runtime), the scheduler and ``stalwart run``.

A test that proved a defect carries a ``# Was: DEFECT:`` line (each failed before its fix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import UNANSWERED_TOOL_TEXT, RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.config import load_config
from stalwart.errors import ConfigError
from stalwart.events import (
    MessageAppended,
    SessionCreated,
    SubagentSpawned,
    ToolCall,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider

from ._runtime_support import GUARD, agent_settings, delivered, of, runtime_config


async def _hang(report: RunReport) -> str:
    await anyio.sleep_forever()
    return ""  # never reached


# -- a delayed wake: the log is the truth ------------------------------------------------------


def test_a_delayed_wake_survives_a_restart_and_runs_when_due(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as first:
        first.session("s1", channel="chat")
        first.wake_at("s1", clock.now() + 3600, "check the refund")
    later = MemoryChannel("chat")
    with Runtime(config, store=store, clock=clock, channels={"chat": later}) as second:
        clock.advance(3599)
        assert not later.messages
        clock.advance(2)
        [reply] = delivered(second, later, 1)
        assert reply.text == "default answer"


# -- rt.spawn for a parent session the runtime holds no handle for -----------------------------


# Was: DEFECT: rt.spawn(parent) after a restart sent the run's notice to `console`, not its channel
def test_a_spawn_after_a_restart_reports_to_the_parent_sessions_recorded_address(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    # RunLayer.defaults read only this runtime's handles: a parent session started by an
    # earlier runtime on the log (or passivated and let go of) got channel `console`, its
    # bare id as the conversation, no thread and agent `default`, so the user in the
    # parent's conversation never heard that the run failed (it went to stdout)
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as first:
        first.session("alice", channel="chat", conversation="room-7", thread="t-1")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as second:
        run = second.spawn(
            "alice", "Reconcile invoices", custom_timeout_ms=1_000, reason="short", work=_hang
        )
        assert run.status().status == "running"  # asked: its watchdog is armed
        clock.advance(1.0)
        assert run.result(GUARD).outcome == "timed_out"
        [notice] = delivered(second, chat, 1)
    assert (notice.conversation, notice.thread) == ("room-7", "t-1")
    assert "Reconcile invoices" in notice.text
    [spawned] = of(SubagentSpawned, list(store.read_stream(run.stream)))
    assert (spawned.channel, spawned.conversation, spawned.thread) == ("chat", "room-7", "t-1")


# Was: DEFECT: a model-driven run of a parent started before a restart ran as agent `default`
def test_a_model_driven_spawn_after_a_restart_runs_as_the_parents_agent(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    agents = {
        "default": agent_settings(),
        "billing": agent_settings(model="billing-model"),
    }
    config = runtime_config(fake.base_url, agents=agents)
    fake.add(Answer(model="billing-model", text="two duplicate charges"))
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as first:
        first.session("bob", agent="billing", channel="chat")
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as second:
        run = second.spawn("bob", "Find the duplicate charge", task_class="code")
        ended = run.result(GUARD)
    assert (ended.outcome, ended.result) == ("succeeded", "two duplicate charges")
    assert [request.model for request in fake.requests] == ["billing-model"]


def test_a_spawn_for_a_parent_the_log_does_not_hold_keeps_the_defaults(
    rt: Runtime, store: EventStore
) -> None:
    run = rt.spawn("nobody", "Research X", task_class="research", work=_hang)
    assert run.status().status == "running"  # asked: its spawn is recorded
    [spawned] = of(SubagentSpawned, list(store.read_stream(run.stream)))
    assert (spawned.channel, spawned.conversation, spawned.thread) == ("console", "nobody", None)


# -- stalwart run: the request an agent would send ---------------------------------------------


def _run_config(tmp_path: Path, fake: FakeProvider, **agent: str) -> Path:
    lines = "\n".join(f"{key} = {value!r}" for key, value in agent.items())
    path = tmp_path / "stalwart.toml"
    path.write_text(
        f"""
[store]
location = "{tmp_path / "store"}"

[providers.main]
kind = "openai"
base_url = "{fake.base_url}"

[agents.default]
provider = "main"
model = "m1"
max_retries = 0
{lines}
""".replace("'", '"')
    )
    return path


def _stalwart_run(config: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["run", "--config", str(config), *args])
    return result.exit_code, result.stdout, result.stderr


# Was: DEFECT: `stalwart run` never sent the agent's configured system_prompt
def test_stalwart_run_sends_the_agents_system_prompt_first(
    tmp_path: Path, fake: FakeProvider
) -> None:
    config = _run_config(tmp_path, fake, system_prompt="You answer questions about orders.")
    code, out, _ = _stalwart_run(config, "Where is my order?")
    assert (code, out) == (0, "default answer\n")
    [request] = fake.requests
    assert request.body["messages"] == [
        {"role": "system", "content": "You answer questions about orders."},
        {"role": "user", "content": "Where is my order?"},
    ]


# Was: DEFECT: `stalwart run --session` sent a tool call a stopped turn left unanswered
def test_stalwart_run_answers_a_tool_call_a_stopped_turn_left_open(
    tmp_path: Path, fake: FakeProvider
) -> None:
    # a runtime's turn stopped mid-tool leaves an assistant tool call with no result in
    # the log; a provider rejects such a request, so every later `stalwart run --session`
    # of that session failed with "every configured model failed"
    config = _run_config(tmp_path, fake)
    call = ToolCall(id="call-1", name="order_status", arguments='{"order_id": "1234"}')
    with store_module.open(tmp_path / "store") as log:
        log.append(
            "session:s1",
            [
                SessionCreated(agent="default"),
                TurnStarted(turn_id="t1"),
                MessageAppended(message_id="m1", role="user", content="Where is 1234?"),
                MessageAppended(message_id="m2", role="assistant", content="", tool_calls=(call,)),
                TurnCompleted(turn_id="t1", outcome="interrupted", reason="cancelled"),
            ],
        )
    code, _, _ = _stalwart_run(config, "--session", "s1", "And now?")
    assert code == 0
    [request] = fake.requests
    messages: list[dict[str, Any]] = request.body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[2]["tool_call_id"] == "call-1"
    assert messages[2]["content"] == UNANSWERED_TOOL_TEXT


# -- config: a key YAML reads as a number --------------------------------------------------------


# Was: DEFECT: a YAML number key in a section: "Expected `str`, found a table", naming no key
def test_a_yaml_key_that_is_not_a_string_is_named_in_any_section(tmp_path: Path) -> None:
    # parse_config named such a key only directly under providers / agents / channels;
    # anywhere else msgspec's "at `key` in `$.health`" was not read, so the error named
    # no key and said it found "a table" (the whole config)
    path = tmp_path / "stalwart.yaml"
    path.write_text("subagents:\n  class_timeouts_ms:\n    1: 5000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key == "subagents.class_timeouts_ms.1"
    assert str(caught.value) == (
        f"{path}: key 'subagents.class_timeouts_ms.1': a name must be a string, found int 1 "
        "(quote it)"
    )
    path.write_text("health:\n  window_ms: 1000\n  yes: 3\n")
    with pytest.raises(ConfigError, match=r"key 'health.True': a name must be a string"):
        load_config(path)
