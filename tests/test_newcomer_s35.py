"""Defects a newcomer found following README.md, docs/getting-started.md and
docs/cli.md literally, each command and example in a fresh directory.

Real parts only: real LMDB directories, the shared throwaway PostgreSQL cluster, and
real subprocesses of ``python -m stalwart`` (the exit codes and stderr a user gets).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart import store as store_module
from stalwart.cli._demo import MARKER
from stalwart.testing import PostgresServer
from tests.test_cli_review import assert_one_error_line


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr


# Was: DEFECT: a store's "create it with `stalwart db init --store URL`" hint failed: No such option
def test_the_db_init_command_a_missing_store_names_runs_as_written(
    pg_server: PostgresServer, pg_url: str
) -> None:
    """A read command on a PostgreSQL store nobody has made yet says "create it with
    `stalwart db init --store URL`"; typed as shown, that command was refused ("No such
    option '--store'": the option only went before the command). The URL it shows holds
    no password, so the user gives it the way libpq takes one, PGPASSWORD."""
    code, _, err = _run("--store", pg_url, "streams")
    assert_one_error_line(code, err)
    hint = re.search(r"create it with `([^`]+)`", err)
    assert hint is not None, err
    command = shlex.split(hint.group(1))
    assert command[:3] == ["stalwart", "db", "init"], command

    code, out, err = _run(*command[1:], env={"PGPASSWORD": pg_server.password})
    assert (code, err) == (0, ""), err
    assert out.startswith("created the store at "), out
    code, out, err = _run("--store", pg_url, "streams")
    assert (code, out, err) == (0, "no streams yet\n", "")
    code, out, err = _run("db", "check", "--store", pg_url)  # the same place, the same way
    assert (code, err) == (0, ""), err
    assert out.endswith("consistent\n"), out


def _demo_banner(cwd: Path, env: dict[str, str]) -> str:
    """Start ``stalwart demo`` in ``cwd``, read its banner up to the line naming where
    its log goes (it has made that directory by then), stop it with SIGTERM; that line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "demo"],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60  # real-time: a subprocess starting on a loaded machine
        while not line.startswith("The event log goes to") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
        return line
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


# Was: DEFECT: `stalwart demo` made its throwaway store where STALWART_STORE named the user's own
def test_the_demo_does_not_take_its_directory_from_stalwart_store(tmp_path: Path) -> None:
    """getting-started says `--store` can come from STALWART_STORE; with it exported
    (for the user's own store, not made yet), the README's `stalwart demo` wrote its log
    there and marked the directory as its own: the user's runtime then writes to a store
    the next `stalwart demo` empties. (Exported for an existing store, the demo refused,
    asking for a --store nobody gave.) The demo's log goes to ./stalwart-demo unless
    --store is given on its command line."""
    own = tmp_path / "agents-store"
    line = _demo_banner(tmp_path, {"STALWART_STORE": str(own)})
    assert line == "The event log goes to stalwart-demo/.\n", line
    assert not own.exists()
    assert (tmp_path / "stalwart-demo" / MARKER).exists()


# Was: DEFECT: `session send` to an existing session silently ignored another --agent or --channel
def test_session_send_refuses_another_agent_or_channel_for_an_existing_session(
    tmp_path: Path,
) -> None:
    """`stalwart session send s1 TEXT --agent billing` on a session the support agent
    owns recorded the message and printed its activation id: the support agent answered
    it, on the session's own channel, and nothing said that --agent was dropped
    (`stalwart run` refuses the same). Now it is one error line and nothing appended;
    the session's own agent and channel, or none given, are accepted."""
    store = str(tmp_path / "store")
    code, _, err = _run("--store", store, "session", "send", "s1", "hi", "--agent", "support")
    assert code == 0, err
    with store_module.open(store, create=False) as log:  # type: ignore[attr-defined]
        head = log.head()
    for option, value in (("--agent", "billing"), ("--channel", "sms")):
        code, out, err = _run("--store", store, "session", "send", "s1", "refund?", option, value)
        assert_one_error_line(code, err)
        assert out == ""
        assert f"{option} is for a new session" in err, err
    with store_module.open(store, create=False) as log:  # type: ignore[attr-defined]
        assert log.head() == head
    for extra in ((), ("--agent", "support", "--channel", "console")):
        code, out, err = _run("--store", store, "session", "send", "session:s1", "more", *extra)
        assert code == 0, err
        assert len(out.strip()) == 32, out
