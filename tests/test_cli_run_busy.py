"""``stalwart run --session`` on a session something else has in hand: a worker's live
lease, a turn under way (here: a ``stalwart run`` killed with SIGKILL mid-answer), a
pending request. Before, it appended a second turn into the stream beside the first,
with no lease and no fence, and two conversations interleaved in one session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stalwart import store as store_module
from stalwart.events import ActivationLeased
from stalwart.runtime import send_message
from stalwart.store import Fence, NewEvent
from stalwart.testing import Answer, FakeProvider, Trickle
from tests.test_cli_review import assert_one_error_line, stalwart
from tests.test_newcomer_review import _config


def _types(store_dir: Path, stream: str) -> list[str]:
    with store_module.open(store_dir, create=False) as log:  # type: ignore[attr-defined]
        return [record.type for record in log.read_stream(stream)]


def _killed_mid_answer(config: Path, session: str) -> None:
    """``stalwart run --session`` SIGKILLed while the answer streams: its turn stays open."""
    command = ["run", "--config", str(config), "--session", session, "hi"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.read(1) == "."  # the answer is streaming
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)  # and close its pipes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# Was: DEFECT: `stalwart run --session` on a session with a turn under way appended a second turn into it  # noqa: E501
def test_a_session_with_a_turn_left_open_is_refused_until_interrupted(
    tmp_path: Path, fake: FakeProvider
) -> None:
    config = _config(tmp_path, fake)
    store_dir = tmp_path / "store"
    fake.add(Trickle(interval_ms=20))
    _killed_mid_answer(config, "s1")
    before = _types(store_dir, "session:s1")
    assert before.count("turn:started") == 1
    assert "turn:completed" not in before

    fake.set_default(Answer(text="fine"))
    code, _, err = stalwart("run", "--config", str(config), "--session", "s1", "again")
    assert_one_error_line(code, err)
    assert "has a turn under way" in err
    assert "stalwart session interrupt s1" in err
    assert _types(store_dir, "session:s1") == before  # nothing appended

    code, _, err = stalwart("--store", str(store_dir), "session", "interrupt", "s1")
    assert code == 0, err
    code, out, err = stalwart("run", "--config", str(config), "--session", "s1", "again")
    assert code == 0, err
    assert out.strip() == "fine"


def _leased(store_dir: Path, expires_at: float) -> None:
    """Session ``s1`` with a message queued and leased by a worker until ``expires_at``."""
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        activation = send_message(log, "s1", "hello")
        leased = ActivationLeased(
            activation_id=activation, owner="worker-1", epoch=1, expires_at=expires_at
        )
        log.append("session:s1", [NewEvent(event=leased)], fence=Fence(1, claim=True))


# Was: DEFECT: `stalwart run --session` wrote into a session a worker held, unfenced, beside its wake  # noqa: E501
def test_a_session_a_worker_holds_is_refused(tmp_path: Path, fake: FakeProvider) -> None:
    config = _config(tmp_path, fake)
    store_dir = tmp_path / "store"
    fake.set_default(Answer(text="fine"))
    _leased(store_dir, time.time() + 600)  # a worker on this machine, ten minutes ahead
    before = _types(store_dir, "session:s1")

    code, _, err = stalwart("run", "--config", str(config), "--session", "s1", "hi")
    assert_one_error_line(code, err)
    assert "is held by a worker" in err
    assert _types(store_dir, "session:s1") == before
    assert fake.requests == []


def test_a_session_whose_lease_expired_takes_a_run(tmp_path: Path, fake: FakeProvider) -> None:
    """A lease past its expiry (its worker died) does not hold the session; its message,
    still queued, is one the next worker takes over, so ``run`` waits for it to be
    answered or dropped (it was run beside it before: tests/test_cli_run_queued_s34.py)."""
    config = _config(tmp_path, fake)
    store_dir = tmp_path / "store"
    fake.set_default(Answer(text="fine"))
    _leased(store_dir, time.time() - 60)

    code, _, err = stalwart("run", "--config", str(config), "--session", "s1", "hi")
    assert_one_error_line(code, err)
    assert "is held by a worker" not in err
    assert "1 queued activation(s)" in err
    code, _, err = stalwart("--store", str(store_dir), "session", "interrupt", "s1")
    assert code == 0, err
    code, out, err = stalwart("run", "--config", str(config), "--session", "s1", "hi")
    assert code == 0, err
    assert out.strip() == "fine"
