"""Running a model's tool calls: what ``run_tools`` adds to a tool's own work.

One step with one call of a trivial tool (``add(a, b)``), parsed, validated, run under
its timeout and made an outcome, repeated:

- ``sync_step_us``: a sync tool (it runs on a daemon thread of its own, so a tool that
  hangs for ever never keeps the process from exiting);
- ``async_step_us``: the same tool written ``async`` (awaited on the loop);
- the peer, ``thread_hop_us``: the bare thread hop a sync call cannot avoid, anyio's
  ``to_thread.run_sync`` of the same function (a pooled, non-daemon worker).

Goal: a sync step costs at most 4x the bare hop (``sync_vs_hop`` <= 4): the daemon
thread (created per call) and the step's own work stay small beside a model's answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread

from benchmarks._registry import Result, benchmark, ratio
from stalwart.events import ToolCall
from stalwart.tools import ToolRegistry, run_tools


def _add(a: int, b: int) -> int:
    return a + b


async def _add_async(a: int, b: int) -> int:
    return a + b


def _per_call_us(step: Callable[[], Awaitable[object]], calls: int) -> float:
    async def main() -> float:
        for _ in range(calls // 10):  # warm the loop, the threads and the caches
            await step()
        started = time.perf_counter()
        for _ in range(calls):
            await step()
        return (time.perf_counter() - started) / calls * 1e6

    return anyio.run(main)


@benchmark("tools")
def run(quick: bool) -> Result:
    result = Result("tools")
    figures = result.figures
    calls = 200 if quick else 3_000
    registry = ToolRegistry()
    registry.register(_add, name="add")
    registry.register(_add_async, name="add_async")
    arguments = '{"a": 1, "b": 2}'
    sync_call = (ToolCall(id="c1", name="add", arguments=arguments),)
    async_call = (ToolCall(id="c1", name="add_async", arguments=arguments),)
    rounds = 1 if quick else 3
    sync_us, async_us, hop_us = [], [], []
    for _ in range(rounds):  # interleaved, best of the rounds
        sync_us.append(_per_call_us(lambda: run_tools(registry, sync_call, limit=4), calls))
        async_us.append(_per_call_us(lambda: run_tools(registry, async_call, limit=4), calls))
        hop_us.append(_per_call_us(lambda: anyio.to_thread.run_sync(_add, 1, 2), calls))
    figures["sync_step_us"] = min(sync_us)
    figures["async_step_us"] = min(async_us)
    figures["thread_hop_us"] = min(hop_us)
    result.ratios["sync_vs_hop"] = ratio(min(sync_us), min(hop_us))
    result.goal("sync_vs_hop", "<=", 4.0)
    return result
