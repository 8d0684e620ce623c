"""Review of session 31's changes: the pipeline knobs checked with the config, and the
documented exception tree with ``AppendInDoubtError`` in it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import stalwart.errors
from stalwart.config import MAX_KNOB, load_config
from stalwart.context.pipeline import PipelineConfig, parse_pipeline
from stalwart.errors import ConfigError, StalwartError
from stalwart.runtime import Runtime


# Was: DEFECT: a pipeline knob of 2**64 passed load_config, then Runtime.start failed
# recording runtime:started ("cannot encode an event for 'runtime'", no key named)
@pytest.mark.parametrize("knob", ["history_turns", "observation_trigger_chars"])
def test_a_pipeline_knob_too_large_to_record_is_refused_with_the_config(
    tmp_path: Path, knob: str
) -> None:
    path = tmp_path / "stalwart.toml"
    path.write_text(f"[context_engine.pipeline]\n{knob} = {2**64}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == f"context_engine.pipeline.{knob}"
    assert str(path) in str(info.value)
    assert str(MAX_KNOB) in str(info.value)
    path.write_text(f"[context_engine.pipeline]\n{knob} = {MAX_KNOB}\n")
    config = load_config(path)  # the largest whole-number knob, as everywhere else
    with Runtime(config, store=tmp_path / "store") as rt:
        assert rt.store.head() >= 1  # runtime:started recorded


# Was: DEFECT: config.py imported stalwart.context (to check the pipeline knobs) against
# the layering (tests/test_layout.py failed): parsing a config loaded the context engine
def test_checking_the_pipeline_knobs_loads_nothing_above_the_config() -> None:
    script = (
        "import sys, stalwart.config as c\n"
        "c.parse_config({'context_engine': {'pipeline': {'history_turns': 3}}})\n"
        "try:\n"
        "    c.parse_config({'context_engine': {'pipeline': {'history_turns': 0}}})\n"
        "except c.ConfigError as exc:\n"
        "    assert exc.key == 'context_engine.pipeline.history_turns', exc.key\n"
        "print(sorted(m for m in sys.modules if m.startswith('stalwart.context')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
    assert parse_pipeline({"history_turns": 3}) == PipelineConfig(history_turns=3)


# Was: DEFECT: AppendInDoubtError was missing from the documented exception tree
def test_the_documented_exception_tree_names_every_error() -> None:
    tree = stalwart.errors.__doc__ or ""
    missing = [
        name
        for name, value in vars(stalwart.errors).items()
        if inspect.isclass(value) and issubclass(value, StalwartError) and name not in tree
    ]
    assert missing == []
