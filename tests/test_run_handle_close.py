"""A run's handle when the runtime closes before the run ends: ``result()`` raises
``CancelledError`` (the run will not end in this runtime), and the next runtime on the
store sweeps the run that no process runs any more (real LMDB, fake clock)."""

from __future__ import annotations

from concurrent.futures import CancelledError

import anyio
import pytest

from stalwart.actors import RunReport
from stalwart.clock import FakeClock
from stalwart.events import SubagentGhostSwept
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import has, log_until
from tests.test_runtime_restarts import config


def test_a_run_cut_short_by_close_is_cancelled_then_swept_by_the_next_runtime(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    async def forever(report: RunReport) -> str:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    with Runtime(config(fake.base_url), store=store, clock=clock) as rt:
        run = rt.spawn("p1", "write code", task_class="code", work=forever)
        run.status()  # started: its watchdog is armed
    with pytest.raises(CancelledError):
        run.result(timeout=5)
    stream = f"session:{run.run_id}"
    with Runtime(config(fake.base_url), store=store, clock=clock) as rt:
        settings = rt.config.subagents
        # past the run's limit (the code class) and the ghost grace, at a sweep
        clock.advance(
            (settings.class_timeouts_ms.code + settings.ghost_grace_ms) / 1000
            + settings.ghost_sweep_interval_ms / 1000
            + 1
        )
        records = log_until(store, stream, has(SubagentGhostSwept))
    assert any(isinstance(r.event, SubagentGhostSwept) for r in records)
