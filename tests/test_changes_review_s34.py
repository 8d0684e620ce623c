"""A review of one day's changes side by side: where one change met another.

The refusal of a blank user message (``send_message``, ``session.send``) left the
``spawn_subagent`` tool's task, which reaches the run's Agent as its first user message,
unchecked; the refusal of a url holding whitespace left the invisible characters pasted
the same way (a zero-width space, a byte-order mark, a soft hyphen), which httpx sends
percent-encoded just as it sends a space.

A real LMDB store in tmp_path, the fake provider over loopback and a FakeClock.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.errors import SpawnRefusedError, ToolError
from stalwart.events import SubagentSpawned
from stalwart.runtime import Runtime
from stalwart.runtime._tools import spawn_tool_fn
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, agent_settings, runtime_config
from tests._support_s35 import config_refused, provider_at, webhook_at


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    config = runtime_config(fake.base_url, agents={"default": agent_settings(subagents=True)})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


# -- the spawn tool's task, as a user message ---------------------------------------------


# Was: DEFECT: spawn_subagent with a blank task spawned a run whose first turn had nothing to answer
@pytest.mark.parametrize("task", ["", "   ", "\n\t "])
def test_a_spawn_tool_call_with_a_blank_task_is_refused_and_spawns_nothing(
    rt: Runtime, fake: FakeProvider, store: EventStore, task: str
) -> None:
    """A model that calls ``spawn_subagent`` with an empty task reads a refusal at once
    (a tool error, ``spawn_refused``), as a host's blank ``send`` is refused: before, a run
    was spawned whose only user message was blank (Anthropic refuses such a turn, so each
    attempt of its recovery failed the same way, the parent's call waiting on them all)."""
    fake.set_default(Answer(text="done"))
    spawn_subagent = spawn_tool_fn(rt, "p1", "default")

    async def call() -> str:
        return await spawn_subagent(task=task, task_class="formatting")

    with pytest.raises(ToolError) as refused:
        rt.portal.submit(call).result(GUARD)
    assert refused.value.error_class == "spawn_refused"
    assert "empty" in str(refused.value)
    spawned = [r for r in store.read_all() if isinstance(r.event, SubagentSpawned)]
    assert spawned == []
    assert fake.requests == []  # no model was asked anything


def test_a_spawn_tool_call_with_a_task_still_spawns_its_run(
    rt: Runtime, fake: FakeProvider
) -> None:
    fake.set_default(Answer(text="done"))
    spawn_subagent = spawn_tool_fn(rt, "p1", "default")

    async def call() -> str:
        return await spawn_subagent(task=" tidy this list ", task_class="formatting")

    assert rt.portal.submit(call).result(GUARD) == "done"


# -- invisible characters in a url ---------------------------------------------------------

INVISIBLE = [
    "https://llm.example/v1\u200b",  # a zero-width space copied from a chat message
    "https://llm.example/v1\ufeff",  # a byte-order mark at the end of a pasted line
    "https://llm.example/\u00adv1",  # a soft hyphen from a web page
    "https://llm.example/v1\u200e",  # a left-to-right mark
]


# Was: DEFECT: a provider base_url with an invisible format character loaded and failed every call
@pytest.mark.parametrize("url", INVISIBLE)
def test_a_provider_base_url_with_an_invisible_character_is_a_config_error(url: str) -> None:
    error = config_refused(provider_at(url), match="invisible")
    assert error.key == "providers.main.base_url"
    assert "llm.example" not in str(error)  # the url itself is not echoed


# Was: DEFECT: a webhook url with an invisible format character loaded and every delivery failed
@pytest.mark.parametrize("url", INVISIBLE)
def test_a_webhook_url_with_an_invisible_character_is_a_config_error(url: str) -> None:
    assert config_refused(webhook_at(url), match="invisible").key == "channels.hook.url"


def test_a_url_with_letters_beyond_ascii_still_loads() -> None:
    """Only the invisible characters are refused: a path in another script is a url."""
    data = provider_at("https://llm.example/café/v1")
    assert parse_config(data).providers["main"].base_url == "https://llm.example/café/v1"


# Was: DEFECT: rt.spawn with a blank task and no work spawned a model run with nothing to answer
def test_a_host_spawn_of_a_model_run_with_a_blank_task_is_refused(
    store: EventStore, fake: FakeProvider
) -> None:
    with Runtime(runtime_config(fake.base_url), store=store) as rt:
        rt.session("p1")
        with pytest.raises(SpawnRefusedError) as refused:
            rt.spawn("p1", "  \n", task_class="formatting")
        assert refused.value.field == "task"
        runs = [r.stream for r in store.streams() if r.stream.startswith("session:")]
        assert runs == ["session:p1"]
    assert fake.requests == []
