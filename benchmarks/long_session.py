"""Starting on a long session: what an Agent's start and a ContextStore rebuild cost.

A chat session lives for months; its Agent is passivated after 5 idle minutes, so nearly
every message starts a new one, and a host serving more than 256 sessions rebuilds a
session's context from the log whenever it comes back. Both must cost what the snapshot
leaves to fold, not the whole history.

One session of n and 8n messages (the tau-bench trajectories when found, see
``benchmarks.context.tau_path``; synthetic ones otherwise) on a real LMDB store, its
snapshot saved as a first start leaves it. Measured, median of repeated runs:

- ``agent_start_ms``: ``load_state(AGENT_VIEW)`` and the folder the Agent keeps;
  against the limit, a bare msgspec decode of the same snapshot bytes
  (``vs_snapshot_decode``), and against the start before the snapshot held it all, a
  full fold of the stream from version 1 (``vs_full_fold``, how many times faster);
- ``context_rebuild_ms``: the ContextStore's rebuild of the session after it was pushed
  out (``max_sessions`` 1), through the actor; against the same rebuild with the search
  index built up front, as before it was built when first searched
  (``vs_indexed_rebuild``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from benchmarks._machine import quiet_logs, scratch
from benchmarks._registry import Result, benchmark
from benchmarks.context import synthetic, tau_path, tau_session
from stalwart import store as stores
from stalwart.actors import (
    AGENT_VIEW,
    AgentView,
    Assemble,
    ContextStoreActor,
    SearchContext,
    ask_context,
)
from stalwart.clock import FakeClock
from stalwart.context import ContextMessage, ExtractiveSummarizer
from stalwart.events import MessageAppended
from stalwart.store import EventStore, NewEvent, load_state, snapshot_name

SESSION = "long"
STREAM = f"session:{SESSION}"
BUDGET = 32_000
ASK_S = 60.0
#: a recall search: the first one builds the session's search index
SEARCH = SearchContext(session_id=SESSION, tenant=None, query="refund")


def _median_ms(work: Callable[[], object], rounds: int) -> float:
    took = []
    for _ in range(rounds):
        began = time.perf_counter()
        work()
        took.append(time.perf_counter() - began)
    return statistics.median(took) * 1000


def _write(store: EventStore, messages: list[ContextMessage]) -> None:
    news = [
        NewEvent(
            event=MessageAppended(
                message_id=m.message_id,
                role=m.role,
                content=m.content,
                tool_calls=m.tool_calls,
                tool_call_id=m.tool_call_id,
                name=m.name,
            ),
            ts=m.ts,
        )
        for m in messages
    ]
    for start in range(0, len(news), 500):
        store.append(STREAM, news[start : start + 500])


def _agent_start(result: Result, root: Path, label: str, messages: list[ContextMessage]) -> None:
    with stores.open(str(root / f"agent-{label}")) as store:  # type: ignore[attr-defined]
        _write(store, messages)
        # a first start: folds it all and saves the snapshot (whatever the history's size)
        load_state(store, STREAM, AGENT_VIEW, snapshot_every=1)
        snapshot = next(iter(store.snapshots(STREAM, snapshot_name(AGENT_VIEW))))
        decoder = msgspec.msgpack.Decoder(AgentView)
        rounds = 15

        def start() -> None:
            AGENT_VIEW.folder(load_state(store, STREAM, AGENT_VIEW))

        def full_fold() -> None:
            AGENT_VIEW.folder(load_state(store, STREAM, AGENT_VIEW, use_snapshots=False))

        ours = _median_ms(start, rounds)
        decode = _median_ms(lambda: decoder.decode(snapshot.data), rounds)
        whole = _median_ms(full_fold, max(3, rounds // 3))
    result.figures[f"{label}_messages"] = len(messages)
    result.figures[f"{label}_agent_start_ms"] = ours
    result.figures[f"{label}_snapshot_decode_ms"] = decode
    result.figures[f"{label}_snapshot_bytes"] = len(snapshot.data)
    result.figures[f"{label}_full_fold_ms"] = whole
    result.ratios[f"{label}_agent_start_vs_snapshot_decode"] = decode / ours
    result.ratios[f"{label}_agent_start_vs_full_fold"] = whole / ours


def _context_rebuild(
    result: Result, root: Path, label: str, messages: list[ContextMessage]
) -> None:
    clock = FakeClock(messages[0].ts)
    with stores.open(str(root / f"context-{label}"), clock=clock) as store:  # type: ignore[attr-defined]
        ref = ContextStoreActor.start(
            store=store, clock=clock, summarizer=ExtractiveSummarizer(), max_sessions=1
        )
        other = (ContextMessage(message_id="o", seq=0, role="user", content="hello"),)

        def assemble(session_id: str, given: tuple[ContextMessage, ...]) -> None:
            clock.advance(max(0.0, given[-1].ts - clock.now()))
            ask_context(ref, Assemble(session_id=session_id, messages=given, budget=BUDGET), ASK_S)

        try:
            for index in range(1, len(messages) + 1):  # before each user turn, as an Agent
                if messages[index - 1].role == "user":
                    assemble(SESSION, tuple(messages[:index]))
            whole = tuple(messages)
            took, indexed = [], []
            for _ in range(7):
                assemble("other", other)
                began = time.perf_counter()
                assemble(SESSION, whole)  # rebuilt from the log
                took.append(time.perf_counter() - began)
                # the same rebuild, then its whole history indexed (what it did before)
                assemble("other", other)
                began = time.perf_counter()
                assemble(SESSION, whole)
                ask_context(ref, SEARCH, ASK_S)
                indexed.append(time.perf_counter() - began)
        finally:
            ref.stop()
    ours, before = statistics.median(took) * 1000, statistics.median(indexed) * 1000
    result.figures[f"{label}_context_rebuild_ms"] = ours
    result.figures[f"{label}_context_rebuild_indexed_ms"] = before
    result.ratios[f"{label}_context_rebuild_vs_indexed_rebuild"] = before / ours


@benchmark("long_session")
def run(quick: bool) -> Result:
    with quiet_logs():
        return _run(quick)


def _run(quick: bool) -> Result:
    result = Result("long_session")
    small = 150 if quick else 600
    path = tau_path()
    if path is not None and not quick:
        source, _ = tau_session(path, facts=0)
        result.figures["tau_bench"] = 1
    else:
        source, _ = synthetic(8 * small + 10)
        result.figures["tau_bench"] = 0
    with scratch() as root:
        for label, count in (("n", small), ("n8", 8 * small)):
            _agent_start(result, Path(root), label, source[:count])
            _context_rebuild(result, Path(root), label, source[:count])
    # what grows with the history is the conversation the Agent holds, not what it reads
    result.ratios["agent_start_growth_n8_over_n"] = (
        result.figures["n8_agent_start_ms"] / result.figures["n_agent_start_ms"]
    )
    result.goal("n8_agent_start_vs_full_fold", ">=", 3.0)
    result.goal("n8_context_rebuild_vs_indexed_rebuild", ">=", 3.0)
    return result
