"""``stalwart context simulate | search | expand`` (issue 6, item 6)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer
from stalwart.events import MessageAppended
from stalwart.testing import Answer, FakeProvider


def openai_transcript(turns: int) -> list[dict[str, object]]:
    items: list[dict[str, object]] = [{"role": "system", "content": "Be brief."}]
    for n in range(turns):
        fact = f" The vault code is VAULT{n:03d}." if n == 4 else ""
        items += [
            {"role": "user", "content": f"Question {n}.{fact} " + "q " * 120},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{n}",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"n": n})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{n}", "content": "result " * 80},
            {"role": "assistant", "content": f"Answer {n}. " + "a " * 100},
        ]
    return items


def anthropic_transcript() -> list[dict[str, object]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]


def test_simulate_reports_every_call_and_a_summary(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(item) for item in openai_transcript(40)))
    result = CliRunner().invoke(
        cli, ["context", "simulate", "--transcript", str(path), "--budget", "3000"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    calls = [line for line in lines if line.startswith("call ")]
    assert len(calls) == 81  # one per assistant message, and the last over everything
    assert "violations 0" in calls[-1]
    assert "leaf_summary" in result.output
    assert lines[-1].startswith("81 calls: max ")
    assert "0 over budget, 0 validity violations" in lines[-1]


def test_simulate_json_ends_with_the_assembled_messages(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(openai_transcript(30)))
    result = CliRunner().invoke(
        cli,
        [
            "context",
            "simulate",
            "--transcript",
            str(path),
            "--budget",
            "2500",
            "--model-profile",
            "small",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    per_call, final = objects[:-1], objects[-1]
    assert all(o["tokens"] <= 2500 and o["violations"] == [] for o in per_call)
    assert {"prefix_unchanged", "layers_fired", "summaries_made", "fence"} <= set(per_call[0])
    assert final["final"] is True
    assert final["messages"][0]["role"] == "system"
    assert final["over_budget"] == 0


def test_simulate_reads_anthropic_blocks_and_runs_the_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(anthropic_transcript()))
    for engine in ("dag", "pipeline"):
        result = CliRunner().invoke(
            cli,
            [
                "context",
                "simulate",
                "--transcript",
                str(path),
                "--budget",
                "5000",
                "--engine",
                engine,
                "--json",
            ],
        )
        assert result.exit_code == 0, result.output
        final = json.loads(result.stdout.splitlines()[-1])
        roles = [m["role"] for m in final["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant", "tool", "user"]
        # both engines keep a cache fence on the default (caching) profile
        assert final["prefix_checked"] == final["prefix_unchanged"] == final["calls"] - 1 > 0


def test_simulate_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"content": "no role"}]')
    for args in (
        ["--transcript", str(tmp_path / "missing.json"), "--budget", "10"],
        ["--transcript", str(bad), "--budget", "10"],
    ):
        result = CliRunner().invoke(cli, ["context", "simulate", *args])
        assert result.exit_code == 1
        assert result.output.count("\n") == 1
        assert result.output.startswith("stalwart: error: ")
        assert "Traceback" not in result.output


def test_simulate_refuses_an_agent_without_a_config(tmp_path: Path) -> None:
    """``--agent`` alone used to be ignored: the run used the stand-in summarizer while
    the operator thought it summarized with that agent's model."""
    args = ["context", "simulate", "--transcript", str(tmp_path / "t.json"), "--budget", "10"]
    result = CliRunner().invoke(cli, [*args, "--agent", "support"])
    assert result.exit_code != 0
    assert "--agent names an agent of --config" in result.stderr


def _stored_session(location: Path, sixth: str) -> list[ContextMessage]:
    """Session ``s9`` of 80 long messages (the seventh, ``m6``, opening with ``sixth``)
    stored with a DAG assembly of it at a 3,000-token budget: summaries over most."""
    clock = FakeClock()
    store = store_module.open(location, clock=clock)
    messages = [
        ContextMessage(
            message_id=f"m{i}",
            seq=i,
            role="user" if i % 2 == 0 else "assistant",
            content=(sixth if i == 6 else "") + f"message {i} " + "z " * 150,
        )
        for i in range(80)
    ]
    store.append(
        "session:s9",
        [
            MessageAppended(message_id=m.message_id, role=m.role, content=m.content)
            for m in messages
        ],
    )
    engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock)
    result = engine.assemble("s9", messages, 3_000, tenant="acme")
    store.append("context:s9", list(result.events))
    store.close()
    return messages


def test_search_and_expand_a_stored_session(tmp_path: Path) -> None:
    location = tmp_path / "store"
    messages = _stored_session(location, "Secret is KIWI-77. ")
    found = CliRunner().invoke(
        cli, ["--store", str(location), "context", "search", "context:s9", "KIWI-77", "--json"]
    )
    assert found.exit_code == 0, found.output
    hit = json.loads(found.stdout.splitlines()[0])
    assert hit["id"] == "m6"
    assert hit["summary_id"]
    expanded = CliRunner().invoke(
        cli, ["--store", str(location), "context", "expand", "s9", hit["summary_id"], "--json"]
    )
    assert expanded.exit_code == 0, expanded.output
    rows = [json.loads(line) for line in expanded.stdout.splitlines()]
    by_id = {row["message_id"]: row["content"] for row in rows}
    assert by_id["m6"] == messages[6].content
    text = CliRunner().invoke(
        cli, ["--store", str(location), "context", "expand", "s9", hit["summary_id"]]
    )
    assert messages[6].content in text.output
    unknown = CliRunner().invoke(cli, ["--store", str(location), "context", "expand", "s9", "nope"])
    assert unknown.exit_code == 1
    assert unknown.output == "stalwart: error: no summary or message with that id in this session\n"


def test_expand_escapes_control_characters_on_a_terminal_only(tmp_path: Path) -> None:
    """A stored message (a model's or a tool's text) may hold an OSC sequence that would
    set the operator's terminal title: on a terminal it is shown escaped, piped it is
    written byte for byte."""
    location = tmp_path / "store"
    title = "\x1b]0;owned\x07"
    messages = _stored_session(location, f"KIWI-77 {title}\tcol\nnext line ")
    found = CliRunner().invoke(
        cli, ["--store", str(location), "context", "search", "context:s9", "KIWI-77", "--json"]
    )
    summary = json.loads(found.stdout.splitlines()[0])["summary_id"]
    command = [sys.executable, "-m", "stalwart", "--store", str(location), "context", "expand"]
    piped = subprocess.run(
        [*command, "s9", summary], capture_output=True, text=True, timeout=30, check=True
    )
    assert messages[6].content in piped.stdout  # byte for byte
    main, side = pty.openpty()
    try:
        proc = subprocess.Popen([*command, "s9", summary], stdout=side, stderr=subprocess.DEVNULL)
        os.close(side)
        shown = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other side closed
                break
            if not chunk:
                break
            shown += chunk
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(main)
    text = shown.decode()
    assert "\x1b" not in text
    assert "KIWI-77 \\u001b]0;owned\\u0007\tcol" in text.replace("\r\n", "\n")
    assert "\nnext line" in text.replace("\r\n", "\n")


def test_simulate_can_summarize_with_a_real_model(tmp_path: Path, fake: FakeProvider) -> None:
    fake.set_default(Answer(text="A short summary of the earlier turns.", input_tokens=500))
    config = tmp_path / "stalwart.toml"
    config.write_text(
        f'[providers.fake]\nkind = "openai"\nbase_url = "{fake.base_url}"\n\n'
        '[agents.default]\nprovider = "fake"\nmodel = "summarizer-1"\n'
    )
    path = tmp_path / "t.json"
    path.write_text(json.dumps(openai_transcript(30)))
    result = CliRunner().invoke(
        cli,
        [
            "context",
            "simulate",
            "--transcript",
            str(path),
            "--budget",
            "2500",
            "--config",
            str(config),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    final = json.loads(result.stdout.splitlines()[-1])
    assert final["summaries"] > 0
    assert final["over_budget"] == 0
    assert fake.requests
    assert all(r.model == "summarizer-1" for r in fake.requests)
    shown = "\n".join(m["content"] for m in final["messages"])
    assert "| A short summary of the earlier turns." in shown
