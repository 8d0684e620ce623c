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


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )


_LOG_TWO_LINES = (
    "from stalwart._logs import get_logger;"
    "log = get_logger('stalwart.store.demo');"
    "log.info('quiet.line', n=1);"
    "log.warning('loud.line', api_key='sk-abcdefghijklmnop', n=2)"
)


def test_an_unconfigured_host_sees_only_warnings_on_stderr_and_nothing_on_stdout() -> None:
    proc = _child(_LOG_TWO_LINES)
    assert proc.stdout == ""
    assert "loud.line" in proc.stderr
    assert "n=2" in proc.stderr
    assert "quiet.line" not in proc.stderr
    assert "sk-abcdefghijklmnop" not in proc.stderr


def test_a_host_that_configured_stdlib_logging_gets_the_lines_there() -> None:
    proc = _child(
        "import logging, sys;"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(name)s|%(message)s');"
        + _LOG_TWO_LINES
    )
    lines = proc.stdout.splitlines()
    assert lines[0] == "stalwart.store.demo|quiet.line n=1"
    assert lines[1].startswith("stalwart.store.demo|loud.line")
    assert "sk-abcdefghijklmnop" not in proc.stdout


def test_a_host_that_configured_structlog_gets_the_lines_through_it() -> None:
    proc = _child(
        "import structlog, sys;"
        "structlog.configure(processors=[structlog.processors.JSONRenderer()],"
        "logger_factory=structlog.PrintLoggerFactory(file=sys.stdout));" + _LOG_TWO_LINES
    )
    first, second = (json.loads(line) for line in proc.stdout.splitlines())
    assert first == {"event": "quiet.line", "n": 1}
    assert second["event"] == "loud.line"
    assert second["api_key"] == REDACTED


# Was: DEFECT: a URL's user info (a dependency's error quoting a database URL) was logged
def test_the_user_info_of_a_url_is_redacted_in_any_value() -> None:
    event = {
        "exception": "OperationalError: connection to postgresql://app:hunter2@db:5432/x",
        "note": "cloning https://ghp_abcdef0123@github.com/o/r; see https://example.com/a@b",
    }
    out = redact(None, "error", dict(event))
    assert "hunter2" not in out["exception"]
    assert out["exception"].endswith("postgresql://[redacted]@db:5432/x")
    assert "ghp_abcdef0123" not in out["note"]
    assert out["note"].endswith("see https://example.com/a@b")  # a path's @ is no user info
