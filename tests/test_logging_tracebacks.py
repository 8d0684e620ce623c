"""A logged exception's traceback: always there, plain text, and never a secret.

Real subprocesses run the CLI's logging set-up (``configure_logging``) and log an
exception raised in a frame whose local variable holds an API key, the way pykka logs an
actor's crash through the standard library and stalwart logs through structlog.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging, sys
import structlog
from stalwart.cli._logging import configure_logging

configure_logging("error", json=sys.argv[1] == "json")
key = "sk-" + "live" + "0123456789abcdef"  # made at run time: only a local holds it


def call(api_key):
    headers = {"x-api-key": api_key}
    raise RuntimeError("the provider failed")


for logged in ("stdlib", "structlog"):
    try:
        call(key)
    except RuntimeError:
        if logged == "stdlib":  # as pykka logs an actor's crash
            logging.getLogger("pykka").error("Unhandled exception in actor", exc_info=True)
        else:
            structlog.get_logger().error("agent.crashed", exc_info=True)
"""
SECRET = "sk-live0123456789abcdef"


def _run(mode: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout == ""
    return proc.stderr


# Was: DEFECT: JSON logs dropped tracebacks ("exc_info": true, or a traceback object's repr)
def test_json_lines_carry_the_traceback_as_text() -> None:
    err = _run("json")
    lines = [json.loads(line) for line in err.splitlines()]
    assert [line["event"] for line in lines] == ["Unhandled exception in actor", "agent.crashed"]
    for line in lines:
        assert "exc_info" not in line
        assert line["exception"].startswith("Traceback (most recent call last):")
        assert "RuntimeError: the provider failed" in line["exception"]
        assert ", in call" in line["exception"]
    assert SECRET not in err


# Was: DEFECT (with rich or better-exceptions installed, as many hosts have): the console
# traceback showed every frame's local variables, an API key among them
def test_console_tracebacks_are_plain_and_show_no_locals() -> None:
    err = _run("console")
    assert err.count("Traceback (most recent call last):") == 2
    assert "RuntimeError: the provider failed" in err
    assert SECRET not in err
    assert "x-api-key" not in err  # a local's name and value would appear with locals
