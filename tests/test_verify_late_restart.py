"""``replay --verify`` and a supervisor's restart appended after records of later times:
the Agent died mid model call at T0 and the supervisor decided its restart then, but the
decision reached the log after another session's record past the call's prompt timeout
(a loaded machine). The dead Agent's timer died with it: no miss. A restart decided after
the deadline fell due leaves the miss standing."""

from __future__ import annotations

from pathlib import Path

from stalwart.cli._replay import verify_store
from stalwart.config import parse_config
from stalwart.events import ActivationReady, PromptStarted, RuntimeStarted, SupervisorRestarted
from stalwart.store import open as open_store
from tests.test_cli_read_review import T0, append

PROOF_S = 3_600.0  # past any prompt deadline of the default config


def _log(store_dir: Path, restart_at: float) -> list[tuple[str, str]]:
    config = parse_config({}).to_record()
    append(store_dir, "runtime", RuntimeStarted(config=config, stalwart_version="x"), ts=T0 - 1)
    append(
        store_dir,
        "session:crash",
        PromptStarted(call_id="c1", provider="main", model="m", timeout_ms=30_000),
        ts=T0,
    )
    append(
        store_dir,
        "session:other",
        ActivationReady(activation_id="a1", kind="message"),
        ts=T0 + PROOF_S,
    )
    restarted = SupervisorRestarted(actor="session:crash", restarts=1, backoff_ms=100, reason="E")
    append(store_dir, "runtime", restarted, ts=restart_at)
    with open_store(store_dir, create=False) as store:
        report = verify_store(store, None)
    return [(f.kind, f.tag) for f in report.findings if f.kind == "missed"]


# Was: DEFECT: the restart's late record left a MISSED execution:prompt_timeout for a call
# whose actor had died before it fell due (flaky under load in test_verify_review.py).
def test_a_restart_decided_before_the_deadline_takes_its_miss_back(tmp_path: Path) -> None:
    assert _log(tmp_path / "store", restart_at=T0 + 1) == []


def test_a_restart_decided_after_the_deadline_leaves_the_miss(tmp_path: Path) -> None:
    assert _log(tmp_path / "store", restart_at=T0 + PROOF_S - 1) == [
        ("missed", "execution:prompt_timeout")
    ]
