"""Defects a review of the command line against docs/cli.md found (tracebacks, leaked
secrets, output that breaks the documented format). Each test failed on the code before
its fix, for the defect its name states.

Real parts only: real subprocesses of ``python -m stalwart`` (so the exit codes and
stderr are the ones a user sees), real LMDB stores in temporary directories, and the
shared PostgreSQL cluster of ``tests/_postgres.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.events import (
    MessageAppended,
    ProviderCallFailed,
    SessionCreated,
)
from stalwart.store import NewEvent

T0 = 1_790_000_000.0


def stalwart(*args: str, cwd: Path | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """Run the real ``stalwart`` command; its exit code, stdout and stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_error_line(code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert code == 1, (code, err)
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err


# -- a store path that cannot be made is a traceback -------------------------------------------


def test_db_init_under_a_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    code, _, err = stalwart("--store", str(a_file / "store"), "db", "init")
    assert_one_error_line(code, err)


def test_session_send_to_a_store_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    code, _, err = stalwart("--store", str(a_file / "store"), "session", "send", "s1", "hello")
    assert_one_error_line(code, err)


# -- incidents --since -------------------------------------------------------------------------


@pytest.fixture
def calls(store_dir: Path) -> Path:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append(
            "provider:openai",
            [
                NewEvent(
                    event=ProviderCallFailed(
                        provider="openai", model="gpt-4o", agent="a", error_class="timeout"
                    ),
                    ts=T0,
                )
            ],
        )
    return store_dir


def test_incidents_since_a_long_span_is_not_a_traceback(calls: Path) -> None:
    # 1,000,000 days before the newest event: a well-formed duration ("everything")
    code, out, err = stalwart("--store", str(calls), "incidents", "--since", "1000000d")
    assert "Traceback" not in err, err
    assert code == 0, err
    assert "openai" in out


def test_incidents_since_a_huge_duration_is_one_line(calls: Path) -> None:
    code, _, err = stalwart("--store", str(calls), "incidents", "--since", "1" + "0" * 400 + "d")
    assert "Traceback" not in err, err
    assert code in (0, 1), err
    if code == 1:
        assert_one_error_line(code, err)


# -- context simulate: a malformed transcript --------------------------------------------------


def test_simulate_with_a_non_numeric_ts_is_one_line(tmp_path: Path) -> None:
    transcript = tmp_path / "t.json"
    transcript.write_text(
        json.dumps(
            [
                {"role": "user", "content": "hi", "ts": "yesterday"},
                {"role": "assistant", "content": "hello"},
            ]
        )
    )
    code, _, err = stalwart(
        "context", "simulate", "--transcript", str(transcript), "--budget", "1000"
    )
    assert_one_error_line(code, err)


# -- secrets in config errors ------------------------------------------------------------------


def test_a_config_error_never_echoes_a_password_in_a_base_url(tmp_path: Path) -> None:
    config = tmp_path / "stalwart.toml"
    config.write_text(
        "[providers.corp]\n"  # `kind` forgotten
        'base_url = "https://agent:hunter2-s3cret@llm.internal.example/v1"\n'
        "[agents.default]\n"
        'provider = "corp"\n'
        'model = "m"\n'
    )
    for args in (
        ["worker", "--config", str(config), "--for", "0"],
        ["run", "--config", str(config), "hi"],
    ):
        code, out, err = stalwart("--store", str(tmp_path / "store"), *args)
        assert code == 1, err
        assert "hunter2-s3cret" not in out + err, err


def test_a_config_error_never_echoes_a_webhook_token(tmp_path: Path) -> None:
    config = tmp_path / "stalwart.toml"
    config.write_text(
        "[providers.local]\n"
        'kind = "openai"\n'
        'base_url = "http://127.0.0.1:9/v1"\n'
        "[agents.default]\n"
        'provider = "local"\n'
        'model = "m"\n'
        "[channels.alerts]\n"  # `kind` forgotten
        'url = "https://hooks.example.com/services/T000/B000/XOXBtokenSECRET42"\n'
    )
    code, out, err = stalwart(
        "--store", str(tmp_path / "store"), "worker", "--config", str(config), "--for", "0"
    )
    assert code == 1, err
    assert "XOXBtokenSECRET42" not in out + err, err


# -- human output: one line per event, content kept as it is ---------------------------------


def test_tail_prints_one_line_per_event_when_content_has_a_carriage_return(
    store_dir: Path,
) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        store.append(
            "session:a",
            [
                SessionCreated(title="t"),
                MessageAppended(message_id="m1", role="user", content="line one\r\nline two"),
                MessageAppended(
                    message_id="m2", role="user", content="progress 50%\rprogress 100%"
                ),
            ],
        )
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", str(store_dir), "tail"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # the bytes as a terminal gets them: a raw CR sends the cursor back and the rest of
    # the event overwrites the start of its own line
    assert b"\r" not in proc.stdout, proc.stdout
    assert proc.stdout.count(b"\n") == 3, proc.stdout


def test_context_expand_prints_a_message_byte_for_byte_when_piped(tmp_path: Path) -> None:
    from stalwart.clock import FakeClock
    from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer

    clock = FakeClock()
    location = tmp_path / "store"
    coloured = "pytest said: \x1b[31mFAILED\x1b[0m test_refund (2 of 40)"
    messages = [
        ContextMessage(
            message_id=f"m{i}",
            seq=i,
            role="user" if i % 2 == 0 else "assistant",
            content=(coloured if i == 6 else f"message {i} ") + " z" * 150,
        )
        for i in range(40)
    ]
    with store_module.open(location, clock=clock) as store:  # type: ignore[attr-defined]
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
    code, out, err = stalwart("--store", str(location), "context", "expand", "s9", "m6")
    assert code == 0, err
    assert messages[6].content in out, repr(out)


# -- a command line with no command ------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["session"]], ids=repr)
def test_no_command_is_help_or_one_error_line_not_help_glued_to_an_error(
    args: list[str],
) -> None:
    code, out, err = stalwart(*args)
    assert "Traceback" not in err, err
    if code == 0:
        assert out.startswith("Usage: stalwart"), out
    else:
        assert code == 1, (code, err)
        assert err.startswith("stalwart: error: "), err
        assert err.count("\n") == 1, err  # docs/cli.md: every error is one line
