"""The context engines inside a running runtime: the pipeline engine chosen by the
operator's config, its knobs checked when the runtime starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.context.pipeline import directory_reader
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


def test_a_bad_pipeline_knob_is_a_config_error_naming_it(fake: FakeProvider) -> None:
    """Checked with the rest of the config, before a runtime records anything."""
    with pytest.raises(ConfigError) as caught:
        _config(fake.base_url, version="pipeline", pipeline={"history_turn": 2})
    assert caught.value.key == "context_engine.pipeline.history_turn"
    assert "unknown field `history_turn`" in str(caught.value)


def test_the_pipeline_engine_reads_files_again_through_the_hosts_reader(
    tmp_path: Path, store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``Runtime(file_reader=directory_reader(root))``: after a compaction, layer 9 puts
    the agent's instructions file (read under ``root``) beside the summary; without a
    reader the runtime's pipeline engine re-read nothing."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "AGENTS.md").write_text("Always answer in French. (from AGENTS.md)\n")
    cfg = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {
                "default": {
                    "provider": "main",
                    "model": "m1",
                    "max_retries": 0,
                    "context_window": 2_048,
                }
            },
            "context_engine": {"version": "pipeline"},
        }
    )
    fake.set_default(Answer(text="noted"))  # the answers, and the summarizer's summary
    reader = directory_reader(workspace)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}, file_reader=reader) as rt:
        session = rt.session("s1", channel="chat")
        for n in range(12):
            session.send(f"question {n}: " + "lorem ipsum dolor " * 60)
            delivered(rt, chat, n + 1)
    rehydrated = [
        m["content"]
        for request in fake.requests
        for m in request.body.get("messages", ())
        if isinstance(m.get("content"), str) and m["content"].startswith("[stalwart:rehydrated]")
    ]
    assert rehydrated, "no request carried the files read again"
    assert "Always answer in French. (from AGENTS.md)" in rehydrated[-1]


def test_a_directory_reader_reads_only_regular_files_under_its_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.md").write_text("inside")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    (root / "big.txt").write_text("x" * 100)
    (tmp_path / "secret.txt").write_text("outside")
    (root / "out").symlink_to(tmp_path / "secret.txt")
    read = directory_reader(root)
    assert read("docs/a.md") == "inside"
    assert read(str(root / "docs" / "a.md")) == "inside"  # absolute, under the root
    assert read("latin1.txt") == "caf\ufffd"
    for path in ("../secret.txt", str(tmp_path / "secret.txt"), "out", "docs", "nope", "a\0b"):
        assert read(path) is None, path
    assert directory_reader(root, max_bytes=10)("big.txt") == "x" * 10
