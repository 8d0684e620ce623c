"""Review of the CLI entry points, logging and channels (session 32): defects, each
proven by a test.

Real parts only: real subprocesses of ``python -m stalwart`` (a pipe whose reader goes
away, a config file on disk), a real LMDB store in tmp_path, the CLI's own logging set-up
in a child process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.clock import FakeClock
from stalwart.context import ContextMessage, DagEngine, ExtractiveSummarizer
from stalwart.events import MessageAppended

#: an OSC sequence: on a terminal it sets the window's title (others set the clipboard)
OSC = "\x1b]0;owned\x07"
OSC_SHOWN = "\\u001b]0;owned\\u0007"
STALWART = [sys.executable, "-m", "stalwart"]

_CONSOLE_LOGS = f"""
import logging
from stalwart.cli._logging import configure_logging
from stalwart._logs import get_logger

configure_logging("info", json=False)  # what a terminal gets
log = get_logger("stalwart.actors.demo")
log.warning("worker.claim_unsettled", stream="session:a{OSC}b", error="FencedError")
logging.getLogger("psycopg.pool").warning("error connecting: %s", "server said {OSC}\\nforged")
try:
    raise RuntimeError("a host callback failed on {OSC}")
except RuntimeError:
    log.exception("supervisor.works_failed", run="run:1")
"""


# Was: DEFECT: console logs wrote control characters of values and tracebacks raw
def test_console_logs_show_control_characters_escaped() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CONSOLE_LOGS],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    err = proc.stderr
    # the renderer's own colours start with ESC [; nothing of the untrusted text does
    assert "\x07" not in err
    assert "\x1b]" not in err
    assert f"session:a{OSC_SHOWN}b" in err
    foreign = next(line for line in err.splitlines() if "error connecting" in line)
    assert f"server said {OSC_SHOWN}\\nforged" in foreign  # one line, as it came
    assert f"RuntimeError: a host callback failed on {OSC_SHOWN}" in err
    assert "Traceback (most recent call last):\n" in err  # a traceback keeps its lines


def _store_events(location: Path) -> list[tuple[str, str]]:
    with store_module.open(location, create=False) as log:
        return [(record.stream, record.type) for record in log.read_all()]


# Was: DEFECT: `stalwart demo | head`: a thread's traceback, a 20 s wait, exit 1
def test_the_demo_ends_quietly_when_its_reader_goes_away(tmp_path: Path) -> None:
    directory = tmp_path / "demo-log"
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [*STALWART, "--store", str(directory), "demo"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert proc.stdout is not None
        try:
            # read up to scene 2's description, then go away: what comes next is the
            # narrator's (its own thread) and the chat screen's (the runtime's loop)
            for line in proc.stdout:
                if line.startswith("   The model sends three words"):
                    break
            proc.stdout.close()
            code = proc.wait(timeout=120)  # real-time: the demo plays on the system clock
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert err_path.read_text() == ""
    assert code == 0
    events = _store_events(directory)
    assert events[-1] == ("runtime", "runtime:stopped")  # closed as after a whole tour
    assert ("session:alice", "execution:prompt_timeout") in events  # scene 2 played out
    assert not any(stream == "session:heidi" for stream, _ in events)  # the last never began
    verify = subprocess.run(
        [*STALWART, "--store", str(directory), "replay", "--all", "--verify"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _session_with_a_message_id(location: Path, message_id: str) -> None:
    """Session ``s9`` whose newest message (a chat platform's id, kept as the sender
    gave it) holds ``KIWI``, with a DAG assembly of it stored."""
    clock = FakeClock()
    messages = [
        ContextMessage(
            message_id=message_id if i == 79 else f"m{i}",
            seq=i,
            role="user" if i % 2 == 0 else "assistant",
            content=("KIWI " if i == 79 else "") + f"message {i} " + "z " * 150,
        )
        for i in range(80)
    ]
    with store_module.open(location, clock=clock) as log:
        log.append(
            "session:s9",
            [
                MessageAppended(message_id=m.message_id, role=m.role, content=m.content)
                for m in messages
            ],
        )
        engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=clock)
        result = engine.assemble("s9", messages, 3_000, tenant="acme")
        log.append("context:s9", list(result.events))


# Was: DEFECT: `stalwart context search` printed a message id's control characters raw
def test_context_search_escapes_a_message_id(tmp_path: Path) -> None:
    location = tmp_path / "store"
    _session_with_a_message_id(location, f"ev{OSC}il")
    found = CliRunner().invoke(cli, ["--store", str(location), "context", "search", "s9", "KIWI"])
    assert found.exit_code == 0, found.output
    assert "\x1b" not in found.output
    assert f"message ev{OSC_SHOWN}il  #79" in found.output
    as_json = CliRunner().invoke(
        cli, ["--store", str(location), "context", "search", "s9", "KIWI", "--json"]
    )
    assert "ev\\u001b]0;owned\\u0007il" in as_json.output  # JSON carries it as it is


# Was: DEFECT: an error line quoted a config file's names with control characters raw
def test_an_error_line_shows_control_characters_escaped(tmp_path: Path) -> None:
    config = tmp_path / "stalwart.toml"
    config.write_text('[agents."x\\u001b]0;owned\\u0007"]\nprovider = "p"\nmodel = "m"\n')
    proc = subprocess.run(
        [*STALWART, "--store", str(tmp_path / "s"), "run", "--config", str(config), "hi"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        f"stalwart: error: {config}: key 'agents.x{OSC_SHOWN}.provider': no provider named "
        "'p' (configured: none)\n"
    )
