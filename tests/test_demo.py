"""``stalwart demo`` runs end to end: every scene happens, and the log says so."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.cli._demo import MARKER, _prepare
from stalwart.cli._demo_narrator import SENTENCES
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    AnnouncementDeadLetterDelivered,
    Event,
    MessageAppended,
    event_tag,
)


@pytest.mark.slow
def test_the_demo_plays_every_scene_and_leaves_an_inspectable_log(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, directory = demo_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    for line in (
        "user sees (alice): Your refund was issued on Monday.",
        "user sees (alice): Your order ships tomorrow.",
        "[log] the call was aborted: its stall limit",
        "is DEGRADED",
        "waits in the dead-letter queue",
        "recovered (rule: quiet_window)",
        "the dead letter was delivered",
        "watchdog: the sub-agent ran past its 2000 ms limit",
        "recovery: escalate (attempts_exhausted)",
        "ghost sweep: a run left 'running'",
        "Invoices reconciled: two duplicate charges found.",
        "recovery: respawn_continue (partial_work)",
        "Incident summary: written (part 1 reused, part 2 added).",
        "the session PAUSED: 'refund' needs an approval",
        "the operator ALLOWED the request",
        "the tool 'refund' ran once: refunded 12.50 on order 7",
        "user sees (grace): Done: 12.50 is back on your card.",
        "the wake failed (agent_crashed): requeued, retry 1 in 500 ms",
        "user sees (heidi): Your balance is 42.00.",
        f"stalwart --store {shlex.quote(str(directory))} tail",  # a space in the path
    ):
        assert line in out, f"missing {line!r} in the demo's output:\n{out}"
    with store_module.open(directory, create=False) as log:
        types = [record.type for record in log.read_all()]
    for expected in (
        "runtime:started",
        "execution:prompt_timeout",
        "model:fallback_attempt",
        "provider:degraded",
        "announcement:dead_lettered",
        "provider:recovered",
        "announcement:dead_letter_delivered",
        "subagent:watchdog_timeout",
        "subagent:ghost_swept",
        "subagent:recovery_decided",
        "subagent:completed",
        "session:requires_action",
        "activation:requeued",
        "runtime:stopped",
    ):
        assert expected in types


def test_the_demo_refuses_a_directory_that_is_not_its_own(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", str(tmp_path), "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("stalwart: error:")
    assert "not a previous demo's store" in proc.stderr
    assert (tmp_path / "notes.txt").exists()


def _demo(store: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stalwart", "--store", store, "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_demo_never_replaces_a_real_store(tmp_path: Path) -> None:
    # a real store holds the same two files as a demo's: only the demo's mark tells them apart
    directory = tmp_path / "real"
    with store_module.open(directory) as log:
        log.append("session:s1", [MessageAppended(message_id="m1", role="user", content="hi")])
    proc = _demo(str(directory))
    assert proc.returncode == 1
    assert "not a previous demo's store" in proc.stderr
    assert "Traceback" not in proc.stderr
    with store_module.open(directory, create=False) as log:
        assert [r.stream for r in log.read_all()] == ["session:s1"]


@pytest.mark.parametrize("where", ["file", "postgresql://u@127.0.0.1:1/x"])
def test_the_demo_refuses_a_store_it_cannot_own_in_one_line(tmp_path: Path, where: str) -> None:
    if where == "file":
        where = str(tmp_path / "notes.txt")
        Path(where).write_text("mine")
    proc = _demo(where)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("stalwart: error:")
    assert not (Path.cwd() / "postgresql:").exists()


@pytest.mark.parametrize(
    ("event", "sentence"),
    [
        (
            AnnouncementDeadLetterDelivered(entry_id="e1", attempts=1),
            "the dead letter was delivered (after 1 earlier attempt)",
        ),
        (
            AnnouncementDeadLetterDelivered(entry_id="e1", attempts=3),
            "the dead letter was delivered (after 3 earlier attempts)",
        ),
        (
            ActivationAbandoned(activation_id="a1", attempts=1, error_class="internal"),
            "the wake was given up after 1 attempt",
        ),
        (
            ActivationLeased(activation_id="a2", owner="w", epoch=2, expires_at=1.0),
            "leased by this worker at lease epoch 2",
        ),
    ],
)
def test_the_narration_counts_in_english(event: Event, sentence: str) -> None:
    """A count of one is singular, and a lease's epoch is not called a re-lease (the
    second message's first lease is at epoch 2 too)."""
    assert SENTENCES[event_tag(event)](event) == sentence


def test_the_demo_uses_an_empty_directory_as_it_is(tmp_path: Path) -> None:
    """An empty directory (``mktemp -d``) is used, not removed and made again: its mode
    and identity stay the user's."""
    directory = tmp_path / "empty"
    directory.mkdir(mode=0o750)
    before = directory.stat()
    _prepare(directory)
    after = directory.stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert [p.name for p in directory.iterdir()] == [MARKER]
