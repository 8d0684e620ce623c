"""The verify benchmark's smoke run: its generated log verifies clean and both sides run."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.verify import generate
from stalwart.cli._replay import REGISTRY, default_knobs
from stalwart.state import verify

ROOT = Path(__file__).resolve().parent.parent


def test_the_generated_log_verifies_clean_and_holds_every_kind_it_claims() -> None:
    records = generate(5_000)
    report = verify(records, REGISTRY, defaults=default_knobs())
    assert report.findings == ()
    assert set(report.checked) == {
        "execution:prompt_timeout",
        "provider:degraded",
        "provider:recovered",
        "subagent:recovery_decided",
        "subagent:watchdog_timeout",
    }
    assert [r.position for r in records] == list(range(1, len(records) + 1))
    assert all(a.ts <= b.ts for a, b in itertools.pairwise(records))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_quick_verify_benchmark_prints_its_figures_and_ratios() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "verify", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    [result] = [json.loads(line) for line in done.stdout.splitlines()]
    assert result["name"] == "verify"
    for key in ("fold", "verify", "decode_fold", "decode_verify"):
        assert result["figures"][f"{key}_events_per_s"] > 0
    assert result["ratios"]["decode_verify_vs_decode_fold"] > 0
