"""Defects a review of the operator commands (``run``, ``session``, the help) found: a
help whose reader went away ending in a traceback or exit 1, ``run --session`` refusing
the stream name every other command takes, an empty prompt sent to the model, no way to
give a prompt longer than one argument, and a continued session answered by another
agent than its own. Each test fails on the code it was written against, for the defect
its ``# Was: DEFECT:`` line states.

Real parts only: real LMDB stores in temporary directories, the loopback fake provider,
real subprocesses of ``python -m stalwart`` where the exit code or a closed pipe matters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.events import MessageAppended
from stalwart.testing import Answer, FakeProvider


def _config(tmp_path: Path, fake: FakeProvider) -> Path:
    """Two agents on the fake provider, each with a model of its own."""
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
model = "default-model"
max_retries = 0

[agents.support]
provider = "main"
model = "support-model"
max_retries = 0
"""
    )
    return path


def _invoke(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def stalwart(*args: str) -> tuple[int, str, str]:
    """The real ``stalwart`` command (its exit codes and stderr are the ones a user gets)."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _user_messages(store_dir: Path, stream: str) -> list[str]:
    with store_module.open(store_dir, create=False) as log:
        return [
            record.event.content
            for record in log.read_stream(stream)
            if isinstance(record.event, MessageAppended) and record.event.role == "user"
        ]


def _streams(store_dir: Path) -> list[str]:
    if not store_dir.exists():
        return []
    with store_module.open(store_dir, create=False) as log:
        return [info.stream for info in log.streams()]


# -- the help, when its reader went away ---------------------------------------------------


# Was: DEFECT: `stalwart | head -1` printed a BrokenPipeError traceback; `--help | head` exit 1
@pytest.mark.parametrize("args", [[], ["session"], ["--help"], ["--version"]])
def test_the_help_ends_quietly_when_its_reader_went_away(args: list[str]) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the help is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "stalwart", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 0


# -- stalwart run ----------------------------------------------------------------------------


# Was: DEFECT: `run --session session:s1` (the name `status` lists) was "not a session id"
def test_run_continues_a_session_named_by_its_stream(tmp_path: Path, fake: FakeProvider) -> None:
    config = str(_config(tmp_path, fake))
    fake.add(Answer(text="first answer"), Answer(text="second answer"))
    code, _, err = _invoke("run", "--config", config, "--session", "s1", "first")
    assert code == 0, err
    code, out, err = _invoke("run", "--config", config, "--session", "session:s1", "second")
    assert code == 0, err
    assert out.strip() == "second answer"
    assert err.strip() == "session s1"
    assert _user_messages(tmp_path / "store", "session:s1") == ["first", "second"]
    assert _streams(tmp_path / "store").count("session:session:s1") == 0


# Was: DEFECT: `run ""` (an unset $PROMPT) asked the model with an empty turn and recorded it
@pytest.mark.parametrize("prompt", ["", "  \n\t"])
def test_run_refuses_an_empty_prompt_before_asking_a_model(
    tmp_path: Path, fake: FakeProvider, prompt: str
) -> None:
    code, out, err = stalwart("run", "--config", str(_config(tmp_path, fake)), prompt)
    assert code == 1
    assert out == ""
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err
    assert "PROMPT is empty" in err
    assert fake.requests == []
    assert [s for s in _streams(tmp_path / "store") if s.startswith("session:")] == []


# Was: DEFECT: `session send s1 ""` queued an empty message for a worker to send a model
def test_session_send_refuses_an_empty_text(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    code, out, err = stalwart("--store", str(store_dir), "session", "send", "s1", " ")
    assert code == 1
    assert out == ""
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err
    assert _streams(store_dir) == []


# Was: DEFECT: `run -` sent the model "-", and no prompt over 128 KiB (one argument) could go
def test_run_reads_the_prompt_from_standard_input_for_a_dash(
    tmp_path: Path, fake: FakeProvider
) -> None:
    long_prompt = "Summarise this log:\n" + "line of a long log\n" * 20_000  # ~360 KiB
    code, _, err = _invoke(
        "run", "--config", str(_config(tmp_path, fake)), "--session", "s1", "-", stdin=long_prompt
    )
    assert code == 0, err
    assert _user_messages(tmp_path / "store", "session:s1") == [long_prompt]
    assert fake.requests[0].body["messages"][-1]["content"] == long_prompt


# Was: DEFECT: `session send s1 -` queued the message "-", not the text piped to it
def test_session_send_reads_the_text_from_standard_input_for_a_dash(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    code, _, err = _invoke(
        "--store", str(store_dir), "session", "send", "s1", "-", stdin="from a pipe\n"
    )
    assert code == 0, err
    with store_module.open(store_dir, create=False) as log:
        texts = [getattr(record.event, "text", None) for record in log.read_stream("session:s1")]
    assert "from a pipe\n" in texts


# Was: DEFECT: `run --session S` answered a session of agent `support` as agent `default`
def test_run_goes_on_with_the_agent_of_the_session(tmp_path: Path, fake: FakeProvider) -> None:
    config = str(_config(tmp_path, fake))
    code, _, err = _invoke("run", "--config", config, "--agent", "support", "--session", "s1", "a")
    assert code == 0, err
    code, _, err = _invoke("run", "--config", config, "--session", "s1", "b")
    assert code == 0, err
    assert [request.model for request in fake.requests] == ["support-model", "support-model"]


# Was: DEFECT: `run --agent default --session S` answered agent `support`'s session as another
def test_run_refuses_another_agent_for_an_existing_session(
    tmp_path: Path, fake: FakeProvider
) -> None:
    config = str(_config(tmp_path, fake))
    code, _, err = _invoke("run", "--config", config, "--agent", "support", "--session", "s1", "a")
    assert code == 0, err
    code, _, err = _invoke("run", "--config", config, "--agent", "default", "--session", "s1", "b")
    assert code == 1
    assert err == (
        "stalwart: error: session 'session:s1' belongs to agent 'support', not 'default'\n"
    )
    assert len(fake.requests) == 1
    assert _user_messages(tmp_path / "store", "session:s1") == ["a"]
