"""Defects a newcomer's walk through README.md, ``stalwart demo`` and the command line
(docs/getting-started.md, docs/cli.md, docs/replay.md) found. Each test fails on the
code it was written against, for the defect its docstring states.

Real parts only: real LMDB stores in temporary directories, the loopback fake provider,
and real subprocesses of ``python -m stalwart`` (so the exit codes, signals and stderr
are the ones a user gets).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.testing import FakeProvider, Trickle
from tests.test_cli_review import assert_one_error_line, stalwart


def _config(tmp_path: Path, fake: FakeProvider, provider: str = "local") -> Path:
    path = tmp_path / "stalwart.toml"
    path.write_text(
        f"""
[store]
location = "{tmp_path / "store"}"

[providers."{provider}"]
kind = "openai"
base_url = "{fake.base_url}"

[agents.default]
provider = "{provider}"
model = "any-model"
max_retries = 0
"""
    )
    return path


def _records(store_dir: Path) -> list[store_module.RecordedEvent]:
    with store_module.open(store_dir, create=False) as log:  # type: ignore[attr-defined]
        return list(log.read_all())


# -- stalwart run ------------------------------------------------------------------------------


def test_a_provider_named_with_a_colon_is_a_config_error_not_an_internal_error(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A provider named ``openai:prod`` (a natural name for a second deployment) passes
    the config check (stalwart/config.py Config.__post_init__ checks only that the agent's
    provider exists), but the model chain is ``provider:model`` split at the first colon
    (``openai`` / ``prod:any-model``), so ``stalwart run`` prints "stalwart: internal
    error: KeyError (a bug; ...)" (the breaker lookup in stalwart/providers/_caller.py
    _attempt) and leaves the session ``running``; ``stalwart worker`` requeues every wake
    with error_class ``internal``. The user should get the answer, or one config error
    line naming the provider, never an internal error."""
    code, out, err = stalwart("run", "--config", str(_config(tmp_path, fake, "openai:prod")), "hi")
    assert "internal error" not in err, err
    if code == 0:
        assert "default answer" in out
    else:
        assert_one_error_line(code, err)
        assert "openai:prod" in err, err


def test_an_api_key_with_a_non_ascii_character_is_a_failed_call_not_an_internal_error(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """An API key pasted with a typographic character in it (``sk-live…key``): httpx
    cannot encode it as a header and raises UnicodeEncodeError while building the
    request (stalwart/providers/_client.py ``stream``, called from _caller.py ``_run``),
    which is not an ``httpx.RequestError``, so _classify.py ``classify_request`` never sees
    it. The user gets "stalwart: internal error: UnicodeEncodeError (a bug; ...)", the
    call has no outcome in the log (``prompt:started``, then ``runtime:stopped``), and a
    worker requeues the session with error_class ``internal``. docs/providers.md: "A key
    that still cannot be sent as a header ... fails every call at once as a final
    ``client_error``, without a retry and without reaching the provider"; the user should
    get the one static error line."""
    key = "sk-newcomer\u2026key"
    config = _config(tmp_path, fake)
    config.write_text(
        config.read_text().replace(
            'kind = "openai"', 'kind = "openai"\napi_key_env = "NEWCOMER_REVIEW_KEY"'
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "run", "--config", str(config), "hi"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "NEWCOMER_REVIEW_KEY": key},
    )
    assert "internal error" not in proc.stderr, proc.stderr
    assert_one_error_line(proc.returncode, proc.stderr)
    assert key not in proc.stdout + proc.stderr
    failed = [r.event for r in _records(tmp_path / "store") if r.type == "prompt:failed"]
    assert [f.error_class for f in failed] == ["client_error"]  # type: ignore[attr-defined]
    assert fake.requests == []  # nothing reached the provider


def signalled_run(
    tmp_path: Path, fake: FakeProvider, sig: signal.Signals, *, timeout: float
) -> tuple[int, str]:
    """``stalwart run`` sent ``sig`` while it streams an answer (one delta every 20 ms
    until the client leaves): its exit code and stderr."""
    fake.add(Trickle(interval_ms=20))
    config = _config(tmp_path, fake)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "run", "--config", str(config), "hi"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.read(1) == "."  # the answer is streaming
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def session_statuses(store_dir: Path) -> dict[str, str]:
    """Each session's status as ``stalwart status --json`` shows it."""
    code, out, err = stalwart("--store", str(store_dir), "status", "--json")
    assert code == 0, err
    return {row["session"]: row["status"] for row in json.loads(out)["sessions"]}


def test_run_stopped_with_ctrl_c_does_not_leave_its_session_running(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """Ctrl-C while ``stalwart run`` streams an answer: the command exits (130) and even
    records ``runtime:stopped``, but the turn it started is never closed (no
    ``turn:completed``, the call has no outcome), so ``stalwart status`` shows the session
    ``running`` for ever, with no lease and nothing running it. The interrupted turn
    should be closed in the log (``stalwart run``'s ``_turn`` in stalwart/cli/_run.py only
    closes it on ProviderError)."""
    _, err = signalled_run(tmp_path, fake, signal.SIGINT, timeout=60)
    assert "Traceback" not in err, err
    types = [record.type for record in _records(tmp_path / "store")]
    assert "runtime:stopped" in types  # the process ended in order, knowing it stopped
    statuses = session_statuses(tmp_path / "store")
    assert "running" not in statuses.values(), statuses


def test_run_records_the_model_calls_of_its_turn(tmp_path: Path, fake: FakeProvider) -> None:
    """``stalwart run`` answers with one model call, but its ``turn:completed`` says
    ``steps=0`` (``tail`` shows ``outcome=answered steps=0``), where the same turn run by
    a worker says ``steps=1``: TurnCompleted.steps is "how many model calls it made"
    (stalwart/events/_session.py), and stalwart/cli/_run.py _turn never sets it."""
    result = CliRunner().invoke(cli, ["run", "--config", str(_config(tmp_path, fake)), "hi"])
    assert result.exit_code == 0, result.stderr
    [completed] = [r.event for r in _records(tmp_path / "store") if r.type == "turn:completed"]
    assert completed.outcome == "answered"  # type: ignore[attr-defined]
    assert completed.steps == 1  # type: ignore[attr-defined]


# -- stalwart demo -----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_demos_outage_degrades_the_provider_on_two_agents_503s(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """Scene 3 of ``stalwart demo`` says "Two agents get 503s within the health window
    (3 s here ...): the provider is marked degraded", but its own narration shows one 503
    (billing) and then "DEGRADED (rule: agents; 2 failures within 3 s)": the second
    failure counted is support's stall timeout from scene 2, 40 ms earlier, still inside
    the 3 s window; support's 503 comes after the provider is already degraded. A
    newcomer checking the story with the suggested ``tail --type 'provider:*'`` sees the
    log contradict it. Every agent the degradation names should have had its 503 by
    then (or the scene should say what really tripped it)."""
    proc, directory = demo_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Two agents get 503s within the health window" in proc.stdout
    failed_503: set[str] = set()
    for record in _records(directory):
        if record.stream != "provider:main":
            continue
        event = record.event
        if record.type == "provider:call_failed" and event.status == 503:  # type: ignore[attr-defined]
            failed_503.add(event.agent)  # type: ignore[attr-defined]
        if record.type == "provider:degraded":
            assert set(event.agents) <= failed_503, (  # type: ignore[attr-defined]
                f"degraded on {event.agents} at position {record.position}, "  # type: ignore[attr-defined]
                f"after 503s from {sorted(failed_503)} only"
            )
            return
    pytest.fail("the demo never marked provider 'main' degraded")
