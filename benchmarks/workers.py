"""Workers (the scale-out issue): trivial wakes/s with 1, 2 and 4 worker processes on one store.

``S`` sessions each hold ``W`` ready activations in a fresh store (one PostgreSQL database
on loopback, fsync on; and, for comparison, one LMDB directory). ``N`` worker processes,
each a real :class:`~stalwart.actors.ActivationWorker` on its own store handle, start
together and run every activation; a wake does nothing but settle (``activation:acked``
under the lease's fence, from a thread of the process as an Agent would) and tell the
worker ``WakeEnded``. The clock runs from the start signal until the log holds every
ack. Each wake costs a claim, a stream read, the lease append and the ack append. Every
case runs twice, the rounds interleaved, and the better round counts (the shared disk
swings run to run).

The ``cpu`` cases are the same with wakes that hold the CPU for 4 ms before they ack (a
real turn parses, folds and renders in Python): one process runs them one at a time
whatever its threads, so they show what more processes buy on this machine's cores.

Then the log is checked: per session, lease epochs strictly increase and every ack
carries the epoch of the lease in force (no two leases overlapped), no lease expired,
and how many of the workers leased any session. Ratios: ``N`` workers' rate over one worker's.
The same runs with the work queue hidden from the workers (each folds every session from
``read_all`` and races the others for it, as before the queue) are the ``fold_all``
figures.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stalwart import store as store_module
from stalwart.actors import ActivationWorker, Scheduler, Wake, WakeEnded
from stalwart.clock import SystemClock
from stalwart.config import ActivationSettings
from stalwart.events import ActivationAcked, ActivationLeased, ActivationReady
from stalwart.runtime import policy_of
from stalwart.store import EventStore, Fence, NewEvent
from stalwart.testing import PlainStore, PostgresServer, postgres_bindir

from ._machine import quiet_logs, quiet_structlog, scratch, scratch_root
from ._registry import Result, benchmark, ratio

WORKERS = (1, 2, 4)
#: The CPU a wake holds in the ``cpu`` cases.
CPU_MS = 4.0
_CONTEXT = multiprocessing.get_context("spawn")


def _burn(ms: float) -> None:
    """Hold the CPU (and the GIL) for ``ms``, as a real turn's parsing and folding do."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


def _child(
    location: str, owner: str, fold_all: bool, cpu_ms: float, ready: Any, go: Any, stop: Any
) -> None:
    """One worker process: lease and ack until told to stop."""
    quiet_structlog()
    opened = store_module.open(location)
    store: EventStore = PlainStore(opened) if fold_all else opened
    clock = SystemClock()
    scheduler = Scheduler(clock).start()
    pool = ThreadPoolExecutor(max_workers=8)  # the Agents' threads
    holder: list[Any] = []

    def settle(w: Wake) -> None:
        _burn(cpu_ms)
        ack = ActivationAcked(activation_id=w.activation_id, epoch=w.epoch)
        with contextlib.suppress(Exception):  # fenced: a takeover would show in the check
            store.append(w.stream, [NewEvent(event=ack, ts=clock.now())], fence=Fence(w.epoch))
        holder[0].tell(WakeEnded(w.stream, w.epoch))

    def wake(w: Wake) -> bool:
        pool.submit(settle, w)
        return True

    policy = policy_of(ActivationSettings(poll_ms=50))
    ready.put(owner)
    go.wait()
    worker = ActivationWorker.start(
        store, clock, scheduler, policy, owner=owner, wake=wake, lost=lambda _l: None
    )
    holder.append(worker)
    stop.wait()
    worker.stop()
    pool.shutdown(wait=True)
    scheduler.stop(5.0)
    store.close()


def _ready(store: EventStore, sessions: int, per_session: int) -> None:
    for s in range(sessions):
        events = [
            ActivationReady(activation_id=f"a{s}.{w}", kind="wake", text="tick")
            for w in range(per_session)
        ]
        store.append(f"session:b{s}", events)


def _acks(store: EventStore, total: int, give_up: float) -> None:
    """Wait until the log holds ``total`` acks."""
    seen, position = 0, 0
    while seen < total:
        if time.monotonic() > give_up:
            raise RuntimeError(f"only {seen} of {total} wakes were acked")
        store.wait_for(position + 1, 0.2)
        for record in store.read_all(position + 1):
            position = record.position
            seen += isinstance(record.event, ActivationAcked)


def _run(
    location: str,
    workers: int,
    sessions: int,
    per_session: int,
    *,
    fold_all: bool = False,
    cpu_ms: float = 0.0,
) -> tuple[float, int]:
    """Wakes per second of ``workers`` processes, and how many of them leased anything;
    checks the log (module docstring)."""
    store = store_module.open(location)
    try:
        _ready(store, sessions, per_session)
        ready, go, stop = _CONTEXT.Queue(), _CONTEXT.Event(), _CONTEXT.Event()
        children = [
            _CONTEXT.Process(
                target=_child,
                args=(location, f"w{i}", fold_all, cpu_ms, ready, go, stop),
            )
            for i in range(workers)
        ]
        for child in children:
            child.start()
        owners = {ready.get(timeout=120) for _ in children}
        total = sessions * per_session
        began = time.perf_counter()
        go.set()
        try:
            _acks(store, total, time.monotonic() + 600)
            seconds = time.perf_counter() - began
        finally:
            stop.set()
            for child in children:
                child.join(30)
                if child.is_alive():
                    child.kill()
        leased = _check(store)
        return total / seconds, len(owners & set(leased))
    finally:
        store.close()


def _check(store: EventStore) -> Counter[str]:
    """No overlapping leases (per stream: epochs grow, each ack under the lease in force);
    how many leases each worker took."""
    epochs: dict[str, int] = {}
    held: dict[str, ActivationLeased] = {}
    owners: Counter[str] = Counter()
    for record in store.read_all():
        event, stream = record.event, record.stream
        if isinstance(event, ActivationLeased):
            if event.epoch <= epochs.get(stream, 0):
                raise RuntimeError(f"lease epoch went back at position {record.position}")
            epochs[stream] = event.epoch
            held[stream] = event
            owners[event.owner] += 1
        elif isinstance(event, ActivationAcked):
            lease = held.pop(stream, None)
            if lease is None or lease.epoch != event.epoch:
                raise RuntimeError(f"an ack outside its lease at position {record.position}")
        elif record.type in ("lease:expired", "activation:lease_lost"):
            raise RuntimeError(f"{record.type} at position {record.position}: leases overlapped")
    return owners


def _best(figures: dict[str, float], key: str, value: float) -> None:
    figures[key] = max(figures.get(key, 0.0), value)


@benchmark("workers")
def run(quick: bool) -> Result:
    result = Result("workers")
    if postgres_bindir() is None:
        raise RuntimeError("the workers benchmark needs PostgreSQL (initdb, pg_ctl) installed")
    sessions, per_session = (24, 2) if quick else (200, 5)
    rounds = 1 if quick else 2
    figures, ratios = result.figures, result.ratios
    figures["sessions"] = sessions
    figures["wakes"] = sessions * per_session
    with quiet_logs(), PostgresServer(directory=scratch_root()) as server, scratch() as directory:
        url = server.create_database("bench_workers")
        for attempt in range(rounds):  # interleaved: a noisy moment hits every case
            for n in WORKERS:
                for name in ("pg", "lmdb"):
                    where = f"{attempt}_{n}"
                    location = f"{url}?schema=w{where}"
                    if name == "lmdb":
                        location = os.path.join(directory, f"l{where}")
                    rate, leasing = _run(location, n, sessions, per_session)
                    _best(figures, f"{name}_{n}_workers_wakes_per_s", rate)
                    _best(figures, f"{name}_{n}_workers_that_leased", leasing)
                    rate, _ = _run(location + "c", n, sessions, per_session, cpu_ms=CPU_MS)
                    _best(figures, f"{name}_{n}_workers_cpu_wakes_per_s", rate)
                    if attempt == 0:
                        rate, _ = _run(location + "x", n, sessions, per_session, fold_all=True)
                        figures[f"{name}_{n}_workers_fold_all_wakes_per_s"] = rate
    for store in ("pg", "lmdb"):
        one = figures[f"{store}_1_workers_wakes_per_s"]
        cpu_one = figures[f"{store}_1_workers_cpu_wakes_per_s"]
        for n in WORKERS[1:]:
            ratios[f"{store}_{n}_vs_1"] = ratio(figures[f"{store}_{n}_workers_wakes_per_s"], one)
            cpu = figures[f"{store}_{n}_workers_cpu_wakes_per_s"]
            ratios[f"{store}_{n}_vs_1_cpu_wakes"] = ratio(cpu, cpu_one)
    figures["overlapping_leases"] = 0  # _check raised otherwise
    return result
