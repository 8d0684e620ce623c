"""Defects a third, adversarial review of the command line found (as an operator and a
newcomer use it): a turn of ``stalwart run`` that a SIGTERM or a reader that goes away
leaves wrong in the log, an internal error where a one-line error is due, and untrusted
text (stream ids, a client's model name) that reaches the terminal unescaped. Each test
fails on the code it was written against, for the defect its ``# DEFECT:`` line states.

Real parts only: real LMDB stores in temporary directories, the loopback fake provider,
and real subprocesses of ``python -m stalwart`` (so the exit codes, signals and stderr are
the ones a user gets).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import lmdb

from stalwart import store as store_module
from stalwart.events import ActivationReady, MessageAppended, SessionCreated
from stalwart.testing import FakeProvider
from tests.test_newcomer_review import _config, _records, session_statuses, signalled_run

#: an OSC sequence (set the terminal's title): click strips CSI colours when piped, not this
OSC = "\x1b]0;PWNED\x07"


def stalwart(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    """Run the real ``stalwart`` command; its exit code, stdout and stderr, as written
    (bytes decoded with no newline translation: a raw CR stays a CR)."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", *args],
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def _raw_controls(text: str) -> set[str]:
    """The terminal-driving characters in ``text`` (ESC, BEL, CR) written as they are."""
    return set(text) & {"\x1b", "\x07", "\r"}


# -- stalwart run ------------------------------------------------------------------------------


def test_run_stopped_with_sigterm_does_not_leave_its_session_running(
    tmp_path: Path, fake: FakeProvider
) -> None:
    # Was: DEFECT: `timeout 30 stalwart run ...` (or a supervisor's SIGTERM) while the answer
    # streams kills the process with the default action: the turn is never closed (no
    # turn:completed, no runtime:stopped), so `stalwart status` shows the session
    # `running` for ever with nothing running it. Ctrl-C is handled (the turn closes as
    # interrupted/cancelled), SIGTERM is not: stalwart/cli/_run.py:155-175 (`run`) installs
    # no SIGTERM handler. Fix: turn SIGTERM into the same cancellation as Ctrl-C (e.g. a
    # handler that raises KeyboardInterrupt, or cancels the anyio task) for the run.
    returncode, err = signalled_run(tmp_path, fake, signal.SIGTERM, timeout=8)
    assert "Traceback" not in err, err
    assert returncode == 128 + signal.SIGTERM, (returncode, err)
    statuses = session_statuses(tmp_path / "store")
    assert "running" not in statuses.values(), statuses


def test_run_whose_reader_goes_away_keeps_the_answer_and_does_not_call_it_internal(
    tmp_path: Path, fake: FakeProvider
) -> None:
    # Was: DEFECT: `stalwart run ... | head -c 0` (any reader that goes away) exits 0, but the
    # BrokenPipeError of the printer (stalwart/cli/_run.py:65-70, `_Printer.__call__`)
    # is raised inside the model call and caught by `_turn`'s `except BaseException`
    # (stalwart/cli/_run.py:104-112), which records `turn:completed outcome=interrupted
    # reason=internal` (the reason for a bug) and drops the answer the model gave: the
    # session's history lacks it, and the next `run --session` asks again without it.
    # Fix: the printer stops printing when stdout is gone (catch BrokenPipeError/OSError
    # there, remember it) and the turn completes and records the answer; `run` then exits
    # 0 as `tail | head` does.
    config = _config(tmp_path, fake)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first delta is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "stalwart", "run", "--config", str(config), "hi"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=8,
            check=False,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert fake.requests, "the model was asked"
    events = [r.event for r in _records(tmp_path / "store")]
    replies = [e for e in events if isinstance(e, MessageAppended) and e.role == "assistant"]
    reasons = [getattr(e, "reason", None) for e in events if type(e).__name__ == "TurnCompleted"]
    assert "internal" not in reasons, reasons  # a closed pipe is not a bug of stalwart
    assert [r.content for r in replies] == ["default answer"], replies


# -- stalwart demo -----------------------------------------------------------------------------


def test_demo_into_a_directory_that_cannot_be_made_is_one_error_line(tmp_path: Path) -> None:
    # Was: DEFECT: `stalwart --store notes.txt/demo demo` (a path under a file; likewise a
    # read-only or missing parent such as /proc/x) prints two lines of the tour and then
    # `stalwart: internal error: NotADirectoryError (a bug; ...)`, where `db init` and
    # `session send` say `stalwart: error: cannot create the store at ...`. The OSError
    # of `_prepare` (stalwart/cli/_demo.py:379-395: `iterdir`, `rmtree`, `mkdir`,
    # `write_text`) is not turned into a StalwartError. Fix: catch OSError in `_prepare`
    # and raise StalwartError("cannot create the demo's directory at ...: <strerror>"),
    # before the banner is printed.
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    code, _, err = stalwart("--store", str(a_file / "demo"), "demo")
    assert "internal error" not in err, err
    assert code == 1, (code, err)
    assert err.startswith("stalwart: error: "), err
    assert err.count("\n") == 1, err


# -- untrusted text on the terminal ------------------------------------------------------------


def test_activations_escapes_control_characters_in_stream_ids_and_values(
    store_dir: Path,
) -> None:
    # Was: DEFECT: `stalwart activations` writes the stream id and the event's values raw:
    # `lifecycle_line` (stalwart/cli/_watch.py:131-149) joins row["session"],
    # row["activation_id"], the owner and the detail values without `escaped`, where
    # `tail`, `streams` and `status` escape the same stream id (docs/cli.md: human lines
    # show control characters in values and stream ids escaped). A writer's stream id or a
    # dedupe key can set the terminal's title or forge a line. Fix: pass each part through
    # `stalwart._text.escaped` in `lifecycle_line` (the JSON output stays as it is).
    stream = f"session:x{OSC}"
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        log.append(
            stream,
            [
                SessionCreated(agent="a"),
                ActivationReady(activation_id="a1", kind="message", dedupe_key=f"k{OSC}\r\nforged"),
            ],
        )
    code, out, err = stalwart("--store", str(store_dir), "activations")
    assert code == 0, err
    assert not _raw_controls(out), repr(out)
    assert out.count("\n") == 1, repr(out)  # one event, one line


def test_db_check_escapes_the_stream_id_of_a_problem(store_dir: Path) -> None:
    # Was: DEFECT: `stalwart db check` prints each problem as `position N <stream>: <what>`
    # with the stream id raw (stalwart/cli/_db.py:79-87 builds `where` from
    # `problem.stream` without `escaped`): the damaged record of a stream whose id holds
    # an escape sequence drives the terminal in the report an operator reads to find the
    # damage (`streams` and `tail` escape the same id). Fix: `escaped(problem.stream)` and
    # `escaped(problem.what)` (and the location) in the text report.
    stream = f"session:x{OSC}"
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        log.append(stream, [SessionCreated(agent="a")])
        log.append(stream, [MessageAppended(message_id="m1", role="user", content="hi")])
    env = lmdb.open(str(store_dir), max_dbs=8)
    try:
        with env.begin(write=True) as txn:  # disk damage: the stream's second record
            txn.put((2).to_bytes(8, "big"), b"\xc1garbage", db=env.open_db(b"log", txn=txn))
    finally:
        env.close()
    code, out, err = stalwart("--store", str(store_dir), "db", "check")
    assert code == 1, (code, out, err)  # a problem was found
    assert "problem" in out, out
    assert not _raw_controls(out), repr(out)


def test_fake_provider_escapes_the_model_name_a_client_sent(tmp_path: Path) -> None:
    # Was: DEFECT: `stalwart fake-provider` prints one line per request with the model name the
    # HTTP client sent, raw (`_describe`, stalwart/cli/_fake.py:19-24): any local client's
    # request body (a model of `"m\x1b]0;...\x07\r\nforged"`) sets the operator's
    # terminal title and forges a request line. Fix: `escaped(request.model)` (and the
    # other request-derived fields) in `_describe`.
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "fake-provider"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline().decode()
        base_url = banner.rsplit("base_url for both APIs: ", 1)[1].strip()
        body = json.dumps(
            {"model": f"m{OSC}\r\nforged", "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        request = urllib.request.Request(
            f"{base_url}/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        line = proc.stdout.readline().decode()  # bytes: a raw CR is not taken for a newline
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=8)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    printed = line + rest
    assert not _raw_controls(printed), repr(printed)
    assert "forged" in line, repr(line)  # the whole request stays on its one line


#: a child in which the import of the CLI is cut by a Ctrl-C, as one pressed in the half
#: second the command spends importing the runtime (the finder raises what Python's
#: SIGINT handler raises, at a point a real Ctrl-C cannot be aimed at)
_CTRL_C_WHILE_IMPORTING = """
import sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "stalwart.cli":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, CtrlC())
sys.argv = ["stalwart", "streams"]
from stalwart._entry import main
main()
"""


# Was: DEFECT: a Ctrl-C in the command's first half second printed a KeyboardInterrupt traceback
def test_a_ctrl_c_while_the_command_starts_is_exit_130_without_a_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_IMPORTING],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (130, "")


def test_the_installed_command_enters_through_the_light_entry_point() -> None:
    """The console script and ``python -m stalwart`` load the CLI inside the entry point
    (where the Ctrl-C above is caught), not while the script imports."""
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["stalwart"] == "stalwart._entry:main"
    assert (
        "stalwart._entry import main"
        in (Path(__file__).parent.parent / "stalwart" / "__main__.py").read_text()
    )


# Was: DEFECT: bidirectional overrides (U+202E...) in a stream id reordered a line of output
def test_bidirectional_overrides_in_stream_ids_are_shown_escaped(store_dir: Path) -> None:
    """A stream id (or provider or model name) holding U+202E RIGHT-TO-LEFT OVERRIDE made
    the rest of its line read backwards in `streams`, `tail` and the tables ("Trojan
    Source"): escaping took C0 and C1 controls only. Embedding, override and isolate
    controls are now escaped too; right-to-left text itself is shown as it is."""
    stream = "session:\u202eevil\u2066x\u2069 שלום"
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        log.append(stream, [SessionCreated(agent="a")])
    for command in (("streams",), ("tail",)):
        code, out, err = stalwart("--store", str(store_dir), *command)
        assert code == 0, err
        assert not any(c in out for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
        assert "\\u202eevil\\u2066x\\u2069 שלום" in out, repr(out)
