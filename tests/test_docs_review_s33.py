"""Defects a newcomer's walk through README.md, the docs' examples and ``stalwart demo``
found (review s33). Each test fails on the code or page it was written against.

Real parts only: the pages as they are in the repository, real LMDB directories in
temporary folders, and real subprocesses of ``python -m stalwart`` (so the exit codes,
signals and output are the ones a user gets).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import stalwart.actors
from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.cli._demo import MARKER, _prepare
from stalwart.events import MessageAppended

ROOT = Path(__file__).resolve().parent.parent

#: the pages a newcomer reads first, whose examples are copied as they are
PAGES = (
    "README.md",
    "docs/getting-started.md",
    "docs/embedding.md",
    "docs/cli.md",
    "docs/resilience.md",
    "docs/sessions.md",
    "docs/channels.md",
    "docs/tools.md",
)


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def _missing_imports(block: str) -> list[str]:
    """The ``from stalwart... import NAME`` of a snippet that name nothing there."""
    missing: list[str] = []
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stalwart"):
            module = importlib.import_module(node.module or "")
            missing += [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if not hasattr(module, alias.name)
            ]
    return missing


# Was: DEFECT: resilience.md's health example imported a `Status` stalwart.actors lacks
@pytest.mark.parametrize("page", PAGES)
def test_every_python_example_imports_only_what_stalwart_has(page: str) -> None:
    blocks = _python_blocks(page)
    missing = [name for block in blocks for name in _missing_imports(block)]
    assert missing == [], f"{page} imports what stalwart does not have: {missing}"


# Was: DEFECT: resilience.md showed keyword-only Spawn, RunEnded, Recovered as positional
def test_the_resilience_api_tables_mark_keyword_only_messages() -> None:
    page = (ROOT / "docs" / "resilience.md").read_text()
    rows = re.findall(r"^\| `(\w+)\(([^)]*)\)", page, re.M)
    checked = 0
    for name, shown in rows:
        target = getattr(stalwart.actors, name, None)
        if not isinstance(target, type):
            continue
        params = list(inspect.signature(target).parameters.values())
        if params and params[0].kind is inspect.Parameter.KEYWORD_ONLY:
            checked += 1
            assert shown.startswith("*"), f"{name}({shown}) takes keywords only"
    assert checked >= 3  # Spawn, RunEnded, Recovered at least


# -- stalwart demo ---------------------------------------------------------------------------


def _previous_demo(directory: Path) -> None:
    """What a whole earlier tour leaves: its mark and an LMDB store with its log."""
    with store_module.open(directory) as log:
        log.append("session:old", [MessageAppended(message_id="m1", role="user", content="x")])
    (directory / MARKER).write_text("made by `stalwart demo`, which may replace it\n")


# Was: DEFECT: a link to a previous demo's directory was refused: "... at link: OSError"
def test_a_previous_demos_directory_behind_a_link_is_emptied_in_place(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    _previous_demo(real)
    link = tmp_path / "demo"
    link.symlink_to(real, target_is_directory=True)
    _prepare(link)
    assert link.is_symlink()
    assert sorted(p.name for p in real.iterdir()) == [MARKER]  # the old log is gone


def _command(line: str) -> list[str]:
    argv = shlex.split(line, comments=True)
    assert argv[0] == "stalwart", line
    return argv[1:]


# Was: DEFECT: the demo's closing commands broke on a store path with a space (unquoted)
@pytest.mark.slow
def test_the_demos_closing_commands_run_as_printed_with_a_space_in_the_path(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, directory = demo_run  # the session's one demo: its path holds a space
    assert " " in str(directory)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = proc.stdout.split("Inspect it:\n", 1)[1].splitlines()
    commands = [_command(line) for line in shown if line.strip()]
    assert len(commands) == 6
    for argv in commands:
        assert argv[:2] == ["--store", str(directory)]
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, (argv, result.output)


def _read_until(proc: subprocess.Popen[bytes], text: bytes, timeout: float) -> bytes:
    """What ``proc`` printed up to and including ``text``, read as it comes."""
    assert proc.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"the demo never printed {text!r}:\n{seen.decode()}"
        ready, _, _ = select.select([proc.stdout], [], [], left)  # real-time: the demo runs live
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"the demo ended before {text!r}:\n{seen.decode()}"
            seen += chunk
    return seen


# Was: DEFECT: SIGTERM killed the demo at once: exit -15, no runtime:stopped in its log
@pytest.mark.slow
def test_sigterm_stops_the_demo_as_ctrl_c_does(tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "--store", str(directory), "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        _read_until(proc, b"user sees (alice): Your refund", timeout=60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err == b""
    with store_module.open(directory, create=False) as log:
        runtime = [record.type for record in log.read_stream("runtime")]
    assert runtime == ["runtime:started", "runtime:stopped"]
