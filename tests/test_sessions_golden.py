"""The durable-session golden logs (``tests/golden/make_sessions_golden.py``): a log a real
runtime wrote (an approval pause, a crash retried, a delayed wake) verifies clean, and
the same log with a hot-loop retry and an early lease does not, with each finding in
words. A change that breaks how old logs fold or verify fails here."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.state import ACTIVATIONS, fold
from tests.golden.make_verify_golden import load


def test_the_clean_sessions_log_verifies_clean_and_folds_settled(tmp_path: Path) -> None:
    store = load("sessions-clean.log", tmp_path / "clean")
    try:
        report = verify_store(store, None)
        assert report.findings == ()
        for tag in ("activation:leased", "activation:acked", "activation:blocked"):
            assert report.checked[tag] >= 1, tag
        assert report.checked["activation:requeued"] == 1
        for session in ("approve", "crash", "later"):
            stream = f"session:{session}"
            state = fold(ACTIVATIONS, stream, store.read_stream(stream))
            assert state.queue == ()
            assert state.lease is None
        assert fold(ACTIVATIONS, "session:crash", store.read_stream("session:crash")).epoch == 2
    finally:
        store.close()


def test_the_doctored_sessions_log_names_the_hot_loop_and_the_early_lease(
    tmp_path: Path,
) -> None:
    load("sessions-doctored.log", tmp_path / "doctored").close()
    result = CliRunner().invoke(
        cli, ["--store", str(tmp_path / "doctored"), "replay", "--all", "--verify"]
    )
    assert result.exit_code == 1
    out = result.output
    assert "failure 1 of 5 waits 2000 ms" in out
    assert "it waited 500 ms" in out
    assert "activation:leased" in out
    assert "no activation was due at that time" in out
