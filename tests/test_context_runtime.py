"""The context engines inside a running runtime: the pipeline engine chosen by the
operator's config, its knobs checked when the runtime starts."""

from __future__ import annotations

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.errors import ConfigError
from stalwart.events import ContextAssembled
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import delivered, of


def _config(base_url: str, **context: object) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": {"provider": "main", "model": "m1", "max_retries": 0}},
            "context_engine": context,
        }
    )


def test_the_pipeline_engine_runs_the_turns_when_the_operator_chooses_it(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = _config(fake.base_url, version="pipeline", pipeline={"history_turns": 2})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        for n in range(4):
            fake.add(Answer(text=f"answer {n}"))
            session.send(f"question {n}")
            delivered(rt, chat, n + 1)
    assembled = of(ContextAssembled, list(store.read_stream("context:s1")))
    assert assembled
    assert {a.engine for a in assembled} == {"pipeline"}
    sent = fake.requests[-1].body["messages"]
    users = [m["content"] for m in sent if m["role"] == "user"]
    assert "question 3" in users[-1]
    assert "question 1" not in users  # the history window kept the last 2 user turns
    names = [t["function"]["name"] for t in fake.requests[-1].body.get("tools") or ()]
    assert "ctx_search" not in names  # the ctx tools are the DAG engine's


def test_a_bad_pipeline_knob_stops_the_start_with_the_key_named(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    cfg = _config(fake.base_url, version="pipeline", pipeline={"history_turn": 2})
    with pytest.raises(ConfigError) as caught:
        Runtime(cfg, store=store, clock=clock).start()
    assert caught.value.key == "context_engine.pipeline"
    assert "history_turn" in str(caught.value)
