"""How long the ``spawn_subagent`` tool waits for its run: never less than the longest
limit a run can be given, plus the ghost sweep's grace and interval."""

from __future__ import annotations

from stalwart.config import Config, parse_config
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider


def _config(base_url: str, subagents: dict[str, object]) -> Config:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": base_url}},
            "agents": {"default": {"provider": "main", "model": "m", "subagents": True}},
            "subagents": subagents,
        }
    )


# Was: DEFECT: a class timeout above custom_max_ms: the spawn tool gave up on its run before the run's own limit  # noqa: E501
def test_a_class_timeout_above_custom_max_bounds_the_tools_wait(
    store: EventStore, fake: FakeProvider
) -> None:
    """``class_timeouts_ms.deep`` at 40 minutes, ``custom_max_ms`` at its default 30: the
    tool waited 31 minutes (``custom_max_ms`` + 60 s), so a deep run's answer came after
    the model had been told the tool timed out."""
    config = _config(fake.base_url, {"class_timeouts_ms": {"deep": 2_400_000}})
    settings = config.subagents
    assert settings.longest_run_ms == 2_400_000
    wait = settings.spawn_wait_ms
    assert wait >= 2_400_000 + settings.ghost_grace_ms + settings.ghost_sweep_interval_ms
    with Runtime(config, store=store) as rt:
        assert rt._spawn_tool("s1", "default").timeout_ms == wait


def test_the_default_wait_covers_the_custom_limit_and_the_sweep(fake: FakeProvider) -> None:
    settings = _config(fake.base_url, {}).subagents
    assert settings.longest_run_ms == settings.custom_max_ms == 1_800_000
    # a run the watchdog missed is swept by limit + grace (checked every interval), and
    # its recovery's retry gets as long (recovery_max_attempts = 2)
    assert settings.spawn_wait_ms == 2 * (1_800_000 + 120_000 + 60_000) + 60_000


# Was: DEFECT: the spawn tool's wait covered one attempt: a retry started by recovery answered no one  # noqa: E501
def test_the_wait_covers_every_attempt_of_the_lineage(fake: FakeProvider) -> None:
    one = _config(fake.base_url, {"recovery_max_attempts": 1}).subagents
    three = _config(fake.base_url, {"recovery_max_attempts": 3}).subagents
    attempt = one.longest_run_ms + one.ghost_grace_ms + one.ghost_sweep_interval_ms
    assert three.spawn_wait_ms - one.spawn_wait_ms == 2 * attempt
