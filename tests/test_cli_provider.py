"""``stalwart run`` and ``stalwart fake-provider`` end to end over real loopback HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.testing import Answer, Fail, FakeProvider, Stall

SECRET = "sk-test-0123456789abcdefSECRET"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(api_key=SECRET) as provider:
        yield provider


def _config(tmp_path: Path, fake: FakeProvider, kind: str = "openai") -> Path:
    path = tmp_path / "stalwart.toml"
    path.write_text(
        f"""
[store]
location = "{tmp_path / "store"}"

[providers.main]
kind = "{kind}"
base_url = "{fake.base_url}"
api_key_env = "STALWART_TEST_KEY"

[providers.backup]
kind = "anthropic"
base_url = "{fake.base_url}"
api_key_env = "STALWART_TEST_KEY"

[agents.default]
provider = "main"
model = "primary-model"
fallback_models = ["backup:backup-model"]
prompt_timeout_ms = 300
retry_prompt_timeout_ms = 400
activity_interval_ms = 10
max_retries = 0
"""
    )
    return path


def _run(config: Path, *args: str) -> tuple[int, str, str]:
    runner = CliRunner()
    result = runner.invoke(
        cli, ["run", "--config", str(config), *args], env={"STALWART_TEST_KEY": SECRET}
    )
    return result.exit_code, result.stdout, result.stderr


def _types(tmp_path: Path, stream: str) -> list[str]:
    with store_module.open(tmp_path / "store", create=False) as log:
        return [record.type for record in log.read_stream(stream)]


def _session(stderr: str) -> str:
    found = re.search(r"session ([0-9a-f]{32})", stderr)
    assert found, stderr
    return found.group(1)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_run_prints_the_streamed_reply_and_logs_every_step(
    tmp_path: Path, fake: FakeProvider, kind: str
) -> None:
    fake.set_default(Answer(text="The refund is on its way."))
    code, out, err = _run(_config(tmp_path, fake, kind), "Where is my refund?")
    assert code == 0, err
    assert out.strip() == "The refund is on its way."
    types = _types(tmp_path, f"session:{_session(err)}")
    assert "prompt:activity" in types
    assert [t for t in types if t != "prompt:activity"] == [
        "session:created",
        "turn:started",
        "message:appended",
        "prompt:started",
        "prompt:completed",
        "message:appended",
        "turn:completed",
    ]
    assert [r.authorized for r in fake.requests] == [True]


def test_run_continues_a_session_with_its_history(tmp_path: Path, fake: FakeProvider) -> None:
    config = _config(tmp_path, fake)
    fake.add(Answer(text="first answer"), Answer(text="second answer"))
    _, _, err = _run(config, "first question")
    session = _session(err)
    code, out, _ = _run(config, "--session", session, "second question")
    assert code == 0
    assert out.strip() == "second answer"
    sent = [m["content"] for m in fake.requests[1].body["messages"]]
    assert sent == ["first question", "first answer", "second question"]


def test_a_stalled_stream_is_retried_and_the_reply_still_arrives(
    tmp_path: Path, fake: FakeProvider
) -> None:
    fake.add(Stall(model="primary-model", after_deltas=2, text="half an"))
    fake.set_default(Answer(text="a whole answer"))
    code, out, err = _run(_config(tmp_path, fake), "hello")
    assert code == 0, err
    assert out.strip().endswith("a whole answer")
    assert "trying again with backup-model" in err
    types = _types(tmp_path, f"session:{_session(err)}")
    assert "execution:prompt_timeout" in types
    assert "model:fallback_attempt" in types
    stalled = fake.wait_finished(0)
    assert stalled.outcome == "client_closed"


def test_when_every_model_fails_the_user_gets_one_static_line(
    tmp_path: Path, fake: FakeProvider
) -> None:
    fake.set_default(Fail(status=503))
    code, out, err = _run(_config(tmp_path, fake), "hello")
    assert code == 1
    assert out == ""
    assert err.strip().splitlines() == [
        "stalwart: error: the model did not answer: every configured model failed or timed out"
    ]
    assert len(fake.requests) == 2  # the primary once (max_retries 0), then the fallback


def test_an_answer_that_broke_off_still_ends_its_line(tmp_path: Path, fake: FakeProvider) -> None:
    """The last attempt's partial answer was left without a newline: the shell prompt
    came up on the same line as it."""
    fake.add(Stall(model="primary-model", after_deltas=2, text="half an"))
    fake.set_default(Stall(after_deltas=2, text="other half"))
    code, out, err = _run(_config(tmp_path, fake), "hello")
    assert code == 1
    assert out.endswith("\n")
    assert err.strip().splitlines()[-1] == (
        "stalwart: error: the model did not answer: every configured model failed or timed out"
    )


def test_the_api_key_never_reaches_the_log_or_the_output(
    tmp_path: Path, fake: FakeProvider
) -> None:
    fake.add(Fail(status=401))
    fake.set_default(Answer(text="ok"))
    code, out, err = _run(_config(tmp_path, fake), "hello")
    assert code == 0
    assert SECRET not in out + err
    raw = b"".join(p.read_bytes() for p in (tmp_path / "store").iterdir())
    assert SECRET.encode() not in raw


def test_a_missing_api_key_is_a_401_and_one_line(tmp_path: Path, fake: FakeProvider) -> None:
    result = CliRunner().invoke(
        cli, ["run", "--config", str(_config(tmp_path, fake)), "hello"], env={}
    )
    assert result.exit_code == 1
    *warnings, error = result.stderr.splitlines()
    assert error.startswith("stalwart: error: ")
    assert [json.loads(w)["event"] for w in warnings] == ["provider.api_key_missing"] * 2
    assert {json.loads(w)["env"] for w in warnings} == {"STALWART_TEST_KEY"}  # says which
    assert {r.status for r in fake.requests} == {401}


def test_fake_provider_command_serves_plays_and_stops(tmp_path: Path) -> None:
    script = tmp_path / "script.yaml"
    script.write_text("steps:\n  - action: fail\n    status: 429\n    retry_after: '7'\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "fake-provider", "--script", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        base_url = banner.rsplit(" ", 1)[-1].strip()
        assert base_url.startswith("http://127.0.0.1:")
        assert base_url.endswith("/v1")
        body = {"model": "m", "messages": []}
        limited = httpx.post(f"{base_url}/chat/completions", json=body, timeout=5)
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "7"
        answered = httpx.post(f"{base_url}/messages", json=body, timeout=5)
        assert answered.json()["content"][0]["text"] == "Hello from the fake provider."
        assert "#0 openai m (whole): fail -> rejected, HTTP 429" in proc.stdout.readline()
        assert "#1 anthropic m (whole): answer -> completed" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "Traceback" not in err


def test_fake_provider_bad_script_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "script.toml"
    script.write_text('[[steps]]\naction = "explode"\n')
    result = CliRunner().invoke(cli, ["fake-provider", "--script", str(script)])
    assert result.exit_code == 1
    assert "Invalid value 'explode'" in result.stderr
    assert "actions: answer, cut" in result.stderr
    assert result.stderr.count("\n") == 1
