"""A log the real Runtime wrote verifies clean, and a doctored copy of it does not.

The runtime tests' fixtures: a real LMDB store on the fake clock, the fake provider over
loopback, a chat MemoryChannel. The clock moves in 10-second steps, as a real one would
move past the sweeps, so every timer fires near its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import (
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    TurnCompleted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, delivered, delivered_by_clock, has, log_until

AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
}


async def hang(report: RunReport) -> str:
    report.progress(3, step=1)
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


def _advance(clock: FakeClock, seconds: float, step: float = 10.0) -> None:
    while seconds > 0:
        clock.advance(min(step, seconds))
        seconds -= step


def _advance_until(clock: FakeClock, store: EventStore, stream: str, kind: type) -> None:
    """10-second steps until ``kind`` is in ``stream`` (the actor arms its timer in its own
    time: a step taken before that would be lost on it)."""
    give_up = time.monotonic() + GUARD
    while not has(kind)(list(store.read_stream(stream))):
        assert time.monotonic() < give_up, f"no {kind.__name__} in {stream}"
        head = store.head()
        clock.advance(10)
        store.wait_for(head + 1, 0.2)


@pytest.fixture
def scenario(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Path]:
    """A chat turn, then a sub-agent that hangs twice: watchdog, notice, respawn, escalate."""
    where = tmp_path / "store"
    store = store_module.open(where, clock=clock)
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {"default": AGENT},
            "subagents": {"class_timeouts_ms": {"formatting": 30_000}},
        }
    )
    try:
        with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
            rt.session("s1", channel="chat").send("hi")
            delivered(rt, chat, 1)
            log_until(store, "session:s1", has(TurnCompleted))
            handle = rt.spawn("s1", "format the table", task_class="formatting", work=hang)
            handle.status()
            _advance(clock, 30)
            assert handle.result(GUARD).outcome == "timed_out"
            log_until(store, handle.stream, has(SubagentRecoveryDecided))
            respawned = _respawned(store, handle.stream)
            _advance_until(clock, store, respawned, SubagentRecoveryDecided)
        yield where
    finally:
        store.close()


def _respawned(store: EventStore, first: str) -> str:
    """The run the recovery respawned (woken by appends until it is in the log)."""
    give_up = time.monotonic() + GUARD
    while time.monotonic() < give_up:
        head = store.head()
        for info in store.streams():
            if info.stream.startswith("session:") and info.stream not in (first, "session:s1"):
                return info.stream
        store.wait_for(head + 1, give_up - time.monotonic())
    raise AssertionError("no respawned run")


def test_the_runtime_log_verifies_clean(scenario: Path, clock: FakeClock) -> None:
    store = store_module.open(scenario, create=False, clock=clock)
    try:
        report = verify_store(store, None)
    finally:
        store.close()
    assert report.findings == ()
    assert report.checked["subagent:watchdog_timeout"] == 2
    assert report.checked["subagent:recovery_decided"] == 2
    result = CliRunner().invoke(cli, ["--store", str(scenario), "replay", "--all", "--verify"])
    assert result.exit_code == 0, result.output
    assert "clean: every decision follows" in result.output


def test_an_early_watchdog_appended_to_the_runtime_log_fails_verification(
    scenario: Path, clock: FakeClock
) -> None:
    store = store_module.open(scenario, create=False, clock=clock)
    try:
        stream = "session:doctored"
        store.append(
            stream,
            [
                NewEvent(
                    event=SubagentSpawned(
                        parent="s1", task="t", task_class="formatting", timeout_ms=30_000
                    ),
                    ts=clock.now(),
                ),
                NewEvent(
                    event=SubagentWatchdogTimeout(
                        deadline=clock.now() + 30, limit_ms=30_000, knob="x", elapsed_ms=1_000
                    ),
                    ts=clock.now() + 1,
                ),
            ],
        )
        report = verify_store(store, stream)
    finally:
        store.close()
    [finding] = report.findings
    assert (finding.kind, finding.tag, finding.stream) == (
        "mismatch",
        "subagent:watchdog_timeout",
        stream,
    )
    assert "29000 ms before it" in finding.message
    result = CliRunner().invoke(cli, ["--store", str(scenario), "replay", stream, "--verify"])
    assert result.exit_code == 1
    assert "DOES NOT FOLLOW" in result.output


# -- retries of the same model ---------------------------------------------------------------


RETRYING: dict[str, Any] = AGENT | {
    "max_retries": 2,
    "retry_base_ms": 20,
    "retry_cap_ms": 40,
    "fallback_models": ["main:m2"],
}


def test_retries_recorded_by_the_runtime_are_re_derived_and_a_doctored_delay_is_not(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    from stalwart.cli._replay import default_knobs
    from stalwart.events import PromptRetryScheduled
    from stalwart.state import VERIFIERS, verify
    from stalwart.testing import Fail

    fake.add(Fail(status=503))  # backoff, drawn
    fake.add(Fail(status=429, retry_after="0.05"))  # the server's wait, once per model
    fake.add(Fail(status=429, retry_after="0.05"))  # a second 429: down the chain
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {"default": RETRYING},
        }
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("r1", channel="chat").send("hello")
        delivered_by_clock(clock, chat, 1, step_s=0.01)  # the backoffs run on the Clock
    records = list(store.read_stream("session:r1"))
    retries = [r for r in records if isinstance(r.event, PromptRetryScheduled)]
    assert [(r.event.status, r.event.rate_limited_before) for r in retries] == [
        (503, False),
        (429, False),
    ]
    assert retries[1].event.delay_ms == 50
    report = verify_store(store, "session:r1")
    assert report.findings == ()
    assert report.checked["prompt:retry_scheduled"] == 2

    first = retries[0]
    doctored = [
        msgspec.structs.replace(
            r,
            event=msgspec.structs.replace(first.event, delay_ms=first.event.delay_ms + 500),
        )
        if r.position == first.position
        else r
        for r in sorted([*of_runtime(store), *records], key=lambda r: r.position)
    ]
    [finding] = verify(doctored, VERIFIERS, defaults=default_knobs()).findings
    assert finding.tag == "prompt:retry_scheduled"
    assert finding.position == first.position
    assert "attempt 1: jitter" in finding.message
    assert f"it waited {first.event.delay_ms + 500} ms" in finding.message


def of_runtime(store: EventStore) -> list[Any]:
    """The ``runtime`` stream's records (the config in force is recorded there)."""
    return list(store.read_stream("runtime"))
