"""Folding a tenant's summarizer ledger: what a worker's first summarizer call costs.

A tenant's ledger (``context-ledger:<tenant>``) gains two events per summarizer call for
ever; a worker folds it at its first call for the tenant. Measured, each call reserved
and released, spread evenly over the days:

- ``folder_us_per_event`` at 500 and 8,000 calls a day (3 days): the accumulator
  (``SUMMARIZER_LEDGER.folder``). Its cost per event must not grow with the day's
  traffic (``folder_growth_8000_vs_500``, goal <= 2);
- against the peer, the pure fold (``SUMMARIZER_LEDGER.apply`` per record, what the
  worker used before) on the same 2,000-a-day ledger (``folder_vs_pure_2000``, how many
  times faster; the pure fold at 8,000 a day takes half a minute, so it is not run);
- through a real LMDB store: the first ``StoreLedger`` (folds the whole ledger, saves a
  snapshot) and the next one (starts from the snapshot), in ms.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator

from benchmarks._machine import scratch
from benchmarks._registry import Result, benchmark, ratio
from stalwart import store as stores
from stalwart.actors import StoreLedger, ledger_stream
from stalwart.clock import FakeClock
from stalwart.events import (
    ContextLedgerOpened,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    RecordedEvent,
)
from stalwart.state import DAY_S, SUMMARIZER_LEDGER
from stalwart.store import NewEvent

T0 = 1_800_000_000.0
TENANT = "bench"
STREAM = ledger_stream(TENANT)


def busy_days(calls_per_day: int, days: int) -> Iterator[NewEvent]:
    """A tenant's ledger after its opening: each call reserved, then released."""
    step = DAY_S / calls_per_day
    for n in range(calls_per_day * days):
        ts = T0 + n * step
        call = f"call-{n}"
        yield NewEvent(event=ContextSummarizerReserved(call_id=call, tenant=TENANT), ts=ts)
        released = ContextSummarizerReleased(
            call_id=call, tenant=TENANT, input_tokens=800, output_tokens=90
        )
        yield NewEvent(event=released, ts=ts + 1.0)


def _records(calls_per_day: int, days: int) -> list[RecordedEvent]:
    opened = NewEvent(event=ContextLedgerOpened(tenant=TENANT), ts=T0)
    return [
        RecordedEvent(
            position=version,
            stream=STREAM,
            version=version,
            ts=new.ts or T0,
            id=f"{version:032x}",
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=new.event,
        )
        for version, new in enumerate([opened, *busy_days(calls_per_day, days)], 1)
    ]


def _folder_s(records: list[RecordedEvent]) -> float:
    started = time.perf_counter()
    folder = SUMMARIZER_LEDGER.folder(SUMMARIZER_LEDGER.initial(STREAM))
    for record in records:
        folder.add(record)
    folder.state()
    return time.perf_counter() - started


def _pure_s(records: list[RecordedEvent]) -> float:
    started = time.perf_counter()
    state = SUMMARIZER_LEDGER.initial(STREAM)
    for record in records:
        state = SUMMARIZER_LEDGER.apply(state, record)
    return time.perf_counter() - started


def _best(rounds: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(rounds))


@benchmark("ledger")
def run(quick: bool) -> Result:
    result = Result("ledger")
    figures = result.figures
    days = 1 if quick else 3
    rounds = 1 if quick else 3
    per_event: dict[int, float] = {}
    for per_day in (500, 8_000):
        records = _records(per_day, days)
        per_event[per_day] = _best(rounds, functools.partial(_folder_s, records)) / len(records)
        figures[f"folder_{per_day}_per_day_us_per_event"] = per_event[per_day] * 1e6
    peer = _records(2_000 if not quick else 500, 1 if quick else 2)
    folder_s = _best(rounds, lambda: _folder_s(peer))
    pure_s = _best(1, lambda: _pure_s(peer))
    figures["peer_events"] = len(peer)
    figures["peer_pure_fold_us_per_event"] = pure_s / len(peer) * 1e6
    result.ratios["folder_vs_pure_2000"] = ratio(pure_s, folder_s)
    result.ratios["folder_growth_8000_vs_500"] = ratio(per_event[8_000], per_event[500])
    result.goal("folder_growth_8000_vs_500", "<=", 2.0)
    result.goal("folder_vs_pure_2000", ">=", 10.0)
    with scratch() as directory:
        clock = FakeClock(T0 + days * DAY_S)
        store = stores.open(os.path.join(directory, "store"), clock=clock)
        try:
            store.append(STREAM, [NewEvent(event=ContextLedgerOpened(tenant=TENANT), ts=T0)])
            batch: list[NewEvent] = []
            for new in busy_days(8_000, days):
                batch.append(new)
                if len(batch) == 5_000:
                    store.append(STREAM, batch)
                    batch = []
            store.append(STREAM, batch)
            figures["store_ledger_events"] = store.stream_version(STREAM)
            for label in ("first_worker_ms", "next_worker_ms"):
                started = time.perf_counter()
                StoreLedger(store, clock, lease_ms=60_000).governor(TENANT)
                figures[label] = (time.perf_counter() - started) * 1000
        finally:
            store.close()
    result.ratios["next_worker_vs_first"] = ratio(
        figures["first_worker_ms"], figures["next_worker_ms"]
    )
    return result
