"""``stalwart run --session`` on a session with work queued that no worker has leased
yet. ``run`` holds no lease: a worker that leased that work while ``run``'s turn went on
would start its wake, close ``run``'s turn as interrupted and answer beside it (two
turns, two answers interleaved in one conversation). ``run`` is refused instead, with
what to do, and nothing is appended; a wake set for later does not hold it up.

Real parts: a real LMDB store, the ``stalwart`` command in a subprocess, the loopback
fake provider."""

from __future__ import annotations

import time
from pathlib import Path

from stalwart import store as store_module
from stalwart.config import ActivationSettings
from stalwart.runtime import schedule_wake, send_message
from stalwart.runtime._durable import policy_of
from stalwart.testing import Answer, FakeProvider
from tests.test_cli_review import assert_one_error_line, stalwart
from tests.test_newcomer_review import _config

POLICY = policy_of(ActivationSettings())


def _types(store_dir: Path, stream: str) -> list[str]:
    with store_module.open(store_dir, create=False) as log:  # type: ignore[attr-defined]
        return [record.type for record in log.read_stream(stream)]


def _run(config: Path, text: str = "hi") -> tuple[int, str, str]:
    return stalwart("run", "--config", str(config), "--session", "s1", text)


def _with_a_wake(tmp_path: Path, fake: FakeProvider, *, due_in_s: float, text: str) -> Path:
    """Session ``s1``, its message interrupted (no activation left of it) and a wake
    ``text`` set ``due_in_s`` from now (the system clock: the command's own); the config
    ``run`` is given. The fake provider answers ``fine``."""
    config = _config(tmp_path, fake)
    store_dir = tmp_path / "store"
    fake.set_default(Answer(text="fine"))
    now = time.time()
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        send_message(log, "s1", "hello")
        assert stalwart("--store", str(store_dir), "session", "interrupt", "s1")[0] == 0
        schedule_wake(log, "s1", now + due_in_s, now=now, policy=POLICY, text=text)
    return config


# Was: DEFECT: `stalwart run --session` went ahead on a session with a queued message a worker could lease beside its turn  # noqa: E501
def test_a_session_with_a_queued_message_is_refused_and_nothing_is_appended(
    tmp_path: Path, fake: FakeProvider
) -> None:
    config = _config(tmp_path, fake)
    store_dir = tmp_path / "store"
    fake.set_default(Answer(text="fine"))
    with store_module.open(store_dir) as log:  # type: ignore[attr-defined]
        send_message(log, "s1", "where is my order?")
    before = _types(store_dir, "session:s1")

    code, _, err = _run(config)
    assert_one_error_line(code, err)
    assert "has 1 queued activation(s)" in err
    assert "stalwart session send" in err
    assert "stalwart session interrupt s1" in err
    assert _types(store_dir, "session:s1") == before
    assert fake.requests == []

    code, _, err = stalwart("--store", str(store_dir), "session", "interrupt", "s1")
    assert code == 0, err
    code, out, err = _run(config)
    assert code == 0, err
    assert out.strip() == "fine"


# Was: DEFECT: a wake already due did not hold `stalwart run --session` back either
def test_a_wake_already_due_holds_the_run_back(tmp_path: Path, fake: FakeProvider) -> None:
    config = _with_a_wake(tmp_path, fake, due_in_s=-1, text="check")

    code, _, err = _run(config)
    assert_one_error_line(code, err)
    assert "has 1 queued activation(s)" in err
    assert fake.requests == []


def test_a_wake_set_for_later_does_not_hold_the_run_back(
    tmp_path: Path, fake: FakeProvider
) -> None:
    config = _with_a_wake(tmp_path, fake, due_in_s=3600, text="later")

    code, out, err = _run(config)
    assert code == 0, err
    assert out.strip() == "fine"
