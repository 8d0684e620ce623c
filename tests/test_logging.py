"""Logging: only the CLI configures it, and secrets never reach a line."""

from __future__ import annotations

import json
import subprocess
import sys

from stalwart.cli._logging import REDACTED, redact


def test_secret_keys_and_values_are_redacted() -> None:
    event = {
        "event": "provider.call",
        "api_key": "sk-live-1234567890abcdef",
        "Authorization": "Bearer abc.def",
        "detail": "used key sk-abcdefghijklmnop for the call",
        "header": "Bearer xyz123",
        "model": "gpt-4o-mini",
    }
    out = redact(None, "info", dict(event))
    assert out["api_key"] == REDACTED
    assert out["Authorization"] == REDACTED
    assert "sk-abcdefghijklmnop" not in out["detail"]
    assert out["header"] == REDACTED
    assert out["model"] == "gpt-4o-mini"


def test_the_cli_logs_json_lines_without_secrets_on_stderr() -> None:
    code = (
        "import structlog; from stalwart.cli._logging import configure_logging;"
        "configure_logging('info', json=True);"
        "structlog.get_logger().info('call', token='t0ps3cret', note='Bearer zzz')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout == ""
    line = json.loads(proc.stderr)
    assert line["event"] == "call"
    assert "t0ps3cret" not in proc.stderr
    assert "zzz" not in proc.stderr


def test_importing_the_library_configures_nothing() -> None:
    code = (
        "import structlog; before = structlog.get_config();"
        "import stalwart.store, stalwart.events, stalwart.state;"
        "assert structlog.get_config() == before; print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout.strip() == "ok", proc.stderr


def test_token_counts_are_not_taken_for_secrets() -> None:
    event = {"input_tokens": 12, "tail_tokens": 40, "auth_token": "abc", "token": "x"}
    assert redact(None, "info", dict(event)) == {
        "input_tokens": 12,
        "tail_tokens": 40,
        "auth_token": REDACTED,
        "token": REDACTED,
    }
