"""`replay --all --verify` reads the health window as the verifier does (session 35).

A real LMDB store in ``tmp_path`` and the command line through click's runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.cli import cli
from stalwart.cli._replay import _widest_health_window
from stalwart.events import RuntimeStarted
from stalwart.store import NewEvent


def _store_with(path: Path, *configs: dict[str, Any]) -> None:
    with store_module.open(path) as store:
        for config in configs:
            started = RuntimeStarted(config=config, stalwart_version="t")
            store.append("runtime", [NewEvent(event=started, ts=1_700_000_000.0)])


# Was: DEFECT: a `runtime:started` whose `health` was not a mapping (a config written by
# hand or by another program) ended `replay --all --verify` with "internal error:
# AttributeError" instead of verifying the log
@pytest.mark.parametrize("health", ["x", 3, None, ["window_ms"]])
def test_a_health_setting_that_is_no_mapping_does_not_end_the_verify(
    tmp_path: Path, health: Any
) -> None:
    _store_with(tmp_path / "s", {"health": health})
    result = CliRunner().invoke(
        cli, ["--store", str(tmp_path / "s"), "replay", "--all", "--verify"]
    )
    assert "internal error" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# Was: DEFECT: a whole-number float window (600000.0), which the verifier takes as a
# number, was left out, so a later process that widened the window that way was checked
# against too short a history
def test_a_whole_float_window_counts_as_the_verifier_reads_it(tmp_path: Path) -> None:
    _store_with(
        tmp_path / "s",
        {"health": {"window_ms": 60_000}},
        {"health": {"window_ms": 600_000.0}},
        {"health": {"window_ms": 900_000.5}},  # a fraction: no whole number of ms
        {"health": {"window_ms": "900000"}},  # text: not a number
    )
    with store_module.open(tmp_path / "s") as store:
        assert _widest_health_window(store, None) == 600_000
