"""The ContextStore with sessions side by side (a real LMDB store, real threads).

N sessions ask for an assembly at once, each with 30 turns to fit into 2,500 tokens, so
each makes several summarizer calls; meanwhile one bystander session, with nothing to
summarize, asks again and again. The summarizer is the deterministic stand-in behind a
fixed latency: a model's round trip (a real one takes seconds; 50 ms here).

Each case runs twice in the same process: with ``parallel_sessions = 1`` (one lane: the
sessions one after another, as the ContextStore did before lanes) and with the default
16. Measured: the wall time until every session has its assembly, against the limit
(the slowest session's own summarizer calls back to back, with no CPU at all) and
against one lane; and the bystander's assembly latency (p50, p99, max), which with lanes
should never include another session's summarizer call.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import scratch
from benchmarks._registry import Result, benchmark
from stalwart import store as stores
from stalwart.actors import Assemble, ContextStoreActor, ask_context
from stalwart.clock import SystemClock
from stalwart.config import ContextEngineSettings
from stalwart.context import ExtractiveSummarizer, SummaryRequest
from stalwart.testing import conversation

BUDGET = 2_500
TURNS = 40
TIMEOUT_S = 300.0
#: small leaves, so that each session makes several summarizer calls (and condenses)
LEAF_TOKENS = 1_000


class _Slow:
    """The extractive stand-in after a fixed round trip; counts calls per session."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.inner = ExtractiveSummarizer()
        self.calls: dict[str, int] = {}
        self._mutex = threading.Lock()

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        session = request.messages[0].message_id.split("-")[0]
        with self._mutex:
            self.calls[session] = self.calls.get(session, 0) + 1
        time.sleep(self.latency_s)
        return self.inner(request)


def _case(root: Path, parallel: int, sessions: int, latency_s: float) -> dict[str, Any]:
    store = stores.open(str(root / f"store-{parallel}"))
    summarizer = _Slow(latency_s)
    ref = ContextStoreActor.start(
        store=store,
        clock=SystemClock(),
        summarizer=summarizer,
        settings=ContextEngineSettings(
            fresh_tail_turns=2, leaf_chunk_tokens=LEAF_TOKENS, parallel_sessions=parallel
        ),
    )
    try:
        bystander = Assemble(session_id="by", messages=conversation("by", 2), budget=100_000)
        ask_context(ref, bystander, TIMEOUT_S)  # its first assembly stores its messages
        done = threading.Event()
        left = [sessions]
        mutex = threading.Lock()

        def compact(name: str) -> None:
            ask_context(
                ref,
                Assemble(session_id=name, messages=conversation(name, TURNS), budget=BUDGET),
                TIMEOUT_S,
            )
            with mutex:
                left[0] -= 1
                if not left[0]:
                    done.set()

        threads = [
            threading.Thread(target=compact, args=(f"s{n}",), daemon=True) for n in range(sessions)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        waits: list[float] = []
        while not done.is_set():
            asked = time.perf_counter()
            ask_context(ref, bystander, TIMEOUT_S)
            waits.append(time.perf_counter() - asked)
            done.wait(latency_s / 5)
        wall = time.perf_counter() - started
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        ref.stop()
        store.close()
    calls = [summarizer.calls.get(f"s{n}", 0) for n in range(sessions)]
    waits.sort()
    return {
        "wall_s": wall,
        "limit_s": max(calls) * latency_s,
        "calls": sum(calls),
        "bystander_p50_ms": statistics.median(waits) * 1000,
        "bystander_p99_ms": waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1000,
        "bystander_max_ms": waits[-1] * 1000,
        "bystander_asks": len(waits),
    }


@benchmark("context_store_sessions")
def run(quick: bool) -> Result:
    result = Result("context_store_sessions")
    sessions, latency_s = (4, 0.01) if quick else (8, 0.05)
    result.figures["sessions"] = sessions
    result.figures["summarizer_latency_ms"] = latency_s * 1000
    with scratch() as root:
        one = _case(Path(root), 1, sessions, latency_s)
        lanes = _case(Path(root), ContextEngineSettings().parallel_sessions, sessions, latency_s)
    for name, case in (("one_lane", one), ("lanes", lanes)):
        for key, value in case.items():
            result.figures[f"{name}_{key}"] = value
    result.ratios["lanes_vs_limit"] = lanes["limit_s"] / lanes["wall_s"]
    result.ratios["lanes_vs_one_lane"] = one["wall_s"] / lanes["wall_s"]
    result.goal("lanes_vs_limit", ">=", 0.5)
    # the bystander waits for the engine's lock at most, never for a summarizer call
    result.figures["lanes_bystander_p99_over_latency"] = lanes["bystander_p99_ms"] / (
        latency_s * 1000
    )
    result.goal("lanes_bystander_p99_over_latency", "<=", 1.0)
    return result
