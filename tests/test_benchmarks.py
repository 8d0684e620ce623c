"""The benchmark runner's smoke run: ``python -m benchmarks append --quick --json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from benchmarks._machine import quiet_logs

ROOT = Path(__file__).resolve().parent.parent


def quick(*names: str, scratch: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks NAME... --quick --json`` with scratch stores in ``scratch``."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *names, "--quick", "--json"],
        cwd=ROOT,
        env={**os.environ, "STALWART_BENCH_DIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_quick_append_benchmark_prints_one_json_result_per_line(tmp_path: Path) -> None:
    done = quick("append", scratch=tmp_path, timeout=50)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["name"] for r in results] == ["append"]
    [result] = results
    assert set(result) == {"name", "figures", "ratios", "goals", "machine"}
    figures = result["figures"]
    for n in (1, 8, 64):
        assert figures[f"stalwart_n{n}_events_per_s"] > 0
        assert figures[f"raw_lmdb_{n}_per_txn_events_per_s"] > 0
        assert result["ratios"][f"vs_raw_lmdb_n{n}"] > 0
    assert figures["fsync_per_s"] > 0
    for goal in result["goals"].values():
        assert set(goal) == {"op", "target", "value", "met"}
        assert isinstance(goal["met"], bool)
    machine = result["machine"]
    assert machine["quick"] is True
    assert machine["scratch_dir"] == str(tmp_path)
    assert {"cpu_count", "python", "lmdb", "platform", "scratch_fs"} <= set(machine)
    assert list(tmp_path.iterdir()) == []  # scratch stores are removed


def test_unknown_benchmark_names_the_known_ones() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "no_such_benchmark"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "unknown benchmark 'no_such_benchmark'" in done.stderr
    assert "append" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_context_store_benchmark_runs_sessions_side_by_side(tmp_path: Path) -> None:
    done = quick("context_store_sessions", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    figures = result["figures"]
    assert figures["lanes_calls"] == figures["one_lane_calls"] > figures["sessions"]
    # one lane makes the bystander wait for the others' summarizer calls; lanes do not
    # (a wide margin: the two differ by the sum of every call's latency)
    assert result["ratios"]["lanes_vs_one_lane"] > 1.0
    assert figures["one_lane_bystander_max_ms"] > figures["lanes_bystander_p50_ms"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_pipeline_benchmark_shows_what_the_cache_fence_saves(tmp_path: Path) -> None:
    done = quick("context_pipeline", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    ratios = result["ratios"]
    for budget in ("8k", "32k"):
        # held prefixes are read from the cache: the fence costs less than no fence
        assert ratios[f"synthetic_{budget}_cost_vs_no_fence"] < 1.0
        assert (
            ratios[f"synthetic_{budget}_cached_share"]
            > ratios[f"synthetic_{budget}_no_fence_cached_share"]
        )
        assert result["figures"][f"synthetic_{budget}_violations"] == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_long_session_benchmark_starts_from_the_snapshot(tmp_path: Path) -> None:
    done = quick("long_session", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    figures, ratios = result["figures"], result["ratios"]
    assert figures["n8_messages"] == 8 * figures["n_messages"]
    for label in ("n", "n8"):
        assert figures[f"{label}_agent_start_ms"] > 0
        assert figures[f"{label}_snapshot_bytes"] > 0
        assert ratios[f"{label}_agent_start_vs_snapshot_decode"] > 0
    # wide margins: the start reads one snapshot, the peer every record (5-6x here)
    assert ratios["n8_agent_start_vs_full_fold"] > 1.5
    assert ratios["n8_context_rebuild_vs_indexed_rebuild"] > 1.5
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_json_output_stays_one_result_per_line_after_a_benchmark_quiets_the_logs(
    tmp_path: Path,
) -> None:
    """A benchmark that quieted the logs for its run once restored structlog's defaults,
    which marks it configured: every later benchmark's INFO lines (the ContextStore's
    start) went to stdout, between the JSON lines."""
    done = quick("long_session", "context_store_sessions", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["name"] for r in results] == ["long_session", "context_store_sessions"]


def test_quiet_logs_leaves_structlog_unconfigured_when_it_was() -> None:
    configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    try:
        with quiet_logs():
            assert structlog.is_configured()
        assert not structlog.is_configured()
    finally:
        if configured:
            structlog.configure(**saved)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_ledger_benchmark_folds_at_a_cost_per_event_that_does_not_grow(
    tmp_path: Path,
) -> None:
    done = quick("ledger", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    figures, ratios = result["figures"], result["ratios"]
    assert figures["store_ledger_events"] == 16_001
    assert figures["first_worker_ms"] > 0
    assert figures["next_worker_ms"] > 0
    # wide margins: 14x and 0.95 here (the pure fold's cost grows with the day's calls)
    assert ratios["folder_vs_pure_2000"] > 2.0
    assert ratios["folder_growth_8000_vs_500"] < 4.0
    assert list(tmp_path.iterdir()) == []


def test_quick_watch_benchmark_draws_a_frame_for_a_fraction_of_the_whole_overview(
    tmp_path: Path,
) -> None:
    done = quick("watch", scratch=tmp_path, timeout=100)
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    figures, ratios = result["figures"], result["ratios"]
    assert figures["sessions"] == 2_000
    assert 0 < figures["frame_ms"] < figures["whole_overview_ms"]
    # a wide margin: 19x at 20,000 sessions here, less at 2,000 (the fixed part weighs more)
    assert ratios["whole_vs_frame"] > 1.5
