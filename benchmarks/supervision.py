"""1,000 concurrent sub-agent runs supervised on one machine (the supervisor issue).

Real parts throughout: an LMDB store in :func:`~benchmarks._machine.scratch`, a
``SystemClock`` :class:`~stalwart.actors.Scheduler`, an :class:`~stalwart.actors.IoPortal`,
a :class:`~stalwart.actors.SupervisorActor` (the runs' parent, with a ``MemoryChannel``
for the failure notices) and one :class:`~stalwart.actors.SubAgentActor` per run (pykka:
a thread each). Every run's work hangs, so its watchdog force-fails it; the custom
timeouts put the deadlines a few seconds after the last spawn, spread over a few seconds.

- **spawn**: starting every run until its ``subagent:spawned`` is durable (runs/s);
- **idle**: this process's CPU time over a quiet interval with every run armed and
  nothing due, as % of one core (the limit is 0 %), and per run; also before any run;
- **sweep**: one ghost + heartbeat sweep (``ask(Sweep())``) over every run, cold (the
  supervisor folds each run from the log) and warm (nothing moved);
- **deadlines under load**: while 4 threads append to other streams, the lateness of
  each watchdog: its ``subagent:watchdog_timeout`` record's ``ts`` minus the event's
  ``deadline``, read back from the log (scheduler lateness + the actor's mailbox + its
  decision), p50/p99/max; and the scheduler's own ``stats()`` (when it fired the timer);
- **exactly once**: every run has one watchdog event, none was swept or completed, every
  work was cancelled and every failure notice delivered once; any miss is a figure.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import pykka

from stalwart import store as store_module
from stalwart.actors import (
    GetRun,
    GetRuns,
    IoPortal,
    RunReport,
    Scheduler,
    Spawn,
    SubAgentActor,
    SupervisorActor,
    Sweep,
)
from stalwart.channels import MemoryChannel
from stalwart.clock import SystemClock
from stalwart.config import SubagentSettings
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentWatchdogTimeout,
)
from stalwart.store import EventStore

from ._machine import quiet_logs, scratch
from ._registry import Result, benchmark
from ._workload import message, percentile

WAIT = 60.0
LOAD_THREADS = 4
BARRIER_BATCH = 64  # concurrent GetRun asks: below the store's 126 reader slots
SETTINGS = SubagentSettings()  # the defaults: sweeps every 60 s, so none runs by itself


@dataclass(frozen=True)
class _Plan:
    runs: int
    lead_s: float  # from a run's spawn to the earliest deadline
    spread_s: float  # the deadlines are spread evenly over this
    quiet_s: float  # the idle measurement
    baseline_s: float  # the idle measurement before any run


QUICK = _Plan(runs=200, lead_s=3.0, spread_s=2.0, quiet_s=1.0, baseline_s=0.5)
FULL = _Plan(runs=1_000, lead_s=8.0, spread_s=4.0, quiet_s=3.0, baseline_s=1.0)
# the burst round: every deadline at one instant, no idle measurement
QUICK_BURST = _Plan(runs=200, lead_s=2.0, spread_s=0.0, quiet_s=0.0, baseline_s=0.0)
FULL_BURST = _Plan(runs=1_000, lead_s=4.0, spread_s=0.0, quiet_s=0.0, baseline_s=0.0)


class _Hang:
    """Every run's work: awaits forever until its watchdog cancels it. All calls run on
    the portal's one event loop, so the counts need no lock."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def __call__(self, report: RunReport) -> str:
        self.started += 1
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        return "never"


class _Load:
    """Threads appending one event at a time (durably) to their own ``load:<i>`` stream."""

    def __init__(self, store: EventStore, threads: int) -> None:
        self._store = store
        self._stop = threading.Event()
        self.appended = [0] * threads
        self.errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(threads)
        ]
        self._started = self._ended = 0.0

    def _loop(self, index: int) -> None:
        event, stream = message(index), f"load:{index}"
        try:
            while not self._stop.is_set():
                self._store.append(stream, [event])
                self.appended[index] += 1
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> _Load:
        self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT)
        self._ended = time.perf_counter()

    @property
    def rate(self) -> float:
        return sum(self.appended) / max(self._ended - self._started, 1e-9)


@dataclass
class _Rig:
    """Every part of one run of the benchmark, started in ``_rig``."""

    store: EventStore
    scheduler: Scheduler
    portal: IoPortal
    channel: MemoryChannel
    supervisor: pykka.ActorRef[Any]
    work: _Hang = field(default_factory=_Hang)
    runs: dict[str, pykka.ActorRef[Any]] = field(default_factory=dict)

    def spawn(self, run_id: str, timeout_ms: int) -> None:
        spawn = Spawn(
            run_id=run_id,
            parent="bench",
            task="wait for a reply that never comes",
            custom_timeout_ms=timeout_ms,
            reason="benchmark: a hung run the watchdog must force-fail",
            channel="chat",
            conversation="bench",
        )
        self.runs[run_id] = SubAgentActor.start(
            store=self.store,
            clock=SystemClock(),
            scheduler=self.scheduler,
            portal=self.portal,
            spawn=spawn,
            work=self.work,
            parent=self.supervisor,
            settings=SETTINGS,
        )

    def ask_all(self) -> None:
        """A barrier: every run has started (its spawn is durable, its watchdog armed) and
        handled every message queued before this one. Asked :data:`BARRIER_BATCH` at a
        time: each reply is a read of the run's stream, and more concurrent reads than
        LMDB's 126 reader slots make the store raise (see the docs' Supervision section)."""
        refs = list(self.runs.values())
        for start in range(0, len(refs), BARRIER_BATCH):
            batch = refs[start : start + BARRIER_BATCH]
            for future in [ref.ask(GetRun(), block=False) for ref in batch]:
                future.get(timeout=WAIT)


@contextlib.contextmanager
def _rig(directory: str) -> Iterator[_Rig]:
    clock = SystemClock()
    store = store_module.open(os.path.join(directory, "store"), clock=clock)
    channel = MemoryChannel("chat")
    try:
        with Scheduler(clock) as scheduler, IoPortal() as portal:
            supervisor = SupervisorActor.start(
                store=store,
                clock=clock,
                scheduler=scheduler,
                portal=portal,
                channels={"chat": channel},
                settings=SETTINGS,
                announce_timeout_ms=5_000,
            )
            rig = _Rig(store, scheduler, portal, channel, supervisor)
            try:
                yield rig
            finally:
                _stop(rig)
    finally:
        store.close()


def _stop(rig: _Rig) -> None:
    futures = [ref.stop(block=False) for ref in rig.runs.values()]
    futures.append(rig.supervisor.stop(block=False))
    for future in futures:
        with contextlib.suppress(pykka.ActorDeadError):
            future.get(timeout=WAIT)


def _cpu_percent(seconds: float) -> tuple[float, float]:
    """This process's CPU seconds over ``seconds`` of wall time, and the wall time."""
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return time.process_time() - cpu, time.perf_counter() - wall


def _spawn_all(rig: _Rig, plan: _Plan) -> tuple[float, float]:
    """Start every run, its timeout aimed at one instant of ``[first, first + spread]``
    (``first`` = now + lead; a run's deadline is its spawn's ``ts`` + its timeout, so it
    lands a little after its aim); seconds until each spawn is durable, and ``first``."""
    started, first = time.perf_counter(), time.time() + plan.lead_s
    for i in range(plan.runs):
        aim = first + plan.spread_s * i / max(plan.runs - 1, 1)
        rig.spawn(f"bench-{i:04d}", round((aim - time.time()) * 1000))
    rig.ask_all()
    return time.perf_counter() - started, first


def _sweeps(rig: _Rig) -> tuple[float, float]:
    """Milliseconds of one sweep cold (every run folded from the log) and one warm."""
    timings = []
    for _ in range(2):
        started = time.perf_counter()
        rig.supervisor.ask(Sweep(), timeout=WAIT)
        timings.append((time.perf_counter() - started) * 1000)
    return timings[0], timings[1]


def _await_fired(rig: _Rig, runs: int) -> None:
    """Wait (on the log's head) until the scheduler fired every watchdog, then until each
    run handled its watchdog (its mailbox is FIFO)."""
    deadline = time.monotonic() + WAIT
    while rig.scheduler.stats().fired < runs:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{rig.scheduler.stats().fired} of {runs} watchdogs fired")
        rig.store.wait_for(rig.store.head() + 1, min(left, 0.5))
    rig.ask_all()


def _settled(rig: _Rig, runs: int) -> float:
    """Seconds until the supervisor's folds hold every notice delivered (bounded by WAIT)."""
    started = time.perf_counter()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        head = rig.store.head()
        watches = rig.supervisor.ask(GetRuns(), timeout=WAIT)
        assert isinstance(watches, dict)
        if sum(watch.notice == "delivered" for watch in watches.values()) >= runs:
            break
        rig.store.wait_for(head + 1, 0.5)
    return time.perf_counter() - started


def _audit(
    store: EventStore, run_ids: list[str]
) -> tuple[list[float], list[float], dict[str, float]]:
    """Each watchdog's lateness (seconds) and deadline from the log, and every miss."""
    lateness: list[float] = []
    deadlines: list[float] = []
    misses = dict.fromkeys(
        (
            "no_watchdog",
            "double_watchdog",
            "swept",
            "completed",
            "notice_not_queued_once",
            "notice_not_delivered_once",
        ),
        0.0,
    )
    for run_id in run_ids:
        records = list(store.read_stream(f"session:{run_id}"))
        fired = [(r.ts, r.event) for r in records if isinstance(r.event, SubagentWatchdogTimeout)]
        lateness.extend(ts - event.deadline for ts, event in fired)
        deadlines.extend(event.deadline for _, event in fired)
        misses["no_watchdog"] += not fired
        misses["double_watchdog"] += len(fired) > 1
        events = [r.event for r in records]
        misses["swept"] += any(isinstance(e, SubagentGhostSwept) for e in events)
        misses["completed"] += any(isinstance(e, SubagentCompleted) for e in events)
        misses["notice_not_queued_once"] += (
            sum(isinstance(e, AnnouncementQueued) for e in events) != 1
        )
        misses["notice_not_delivered_once"] += (
            sum(isinstance(e, AnnouncementDelivered) for e in events) != 1
        )
    return lateness, deadlines, misses


def _idle(figures: dict[str, float], rig: _Rig, plan: _Plan, first_deadline: float) -> None:
    """CPU over the quiet interval (it ends 0.5 s before the earliest deadline), then the
    cost of a sweep over every armed run."""
    quiet = min(plan.quiet_s, first_deadline - time.time() - 0.5)
    cpu, wall = _cpu_percent(max(quiet, 0.0))
    figures["idle_s"] = wall
    figures["idle_cpu_percent"] = cpu / wall * 100 if wall > 0.05 else float("nan")
    figures["idle_cpu_us_per_run_per_s"] = cpu * 1e6 / plan.runs / wall if wall > 0.05 else 0.0
    figures["sweep_cold_ms"], figures["sweep_warm_ms"] = _sweeps(rig)


def _lateness(figures: dict[str, float], rig: _Rig, plan: _Plan, prefix: str) -> None:
    """Every watchdog's lateness from the log, the scheduler's own, and every miss."""
    sent = rig.channel.attempted
    figures[f"{prefix}work_cancelled"] = rig.work.cancelled
    figures[f"{prefix}notices_delivered"] = len(rig.channel.messages)
    lateness, deadlines, misses = _audit(rig.store, list(rig.runs))
    span = max(deadlines) - min(deadlines) if deadlines else float("nan")
    figures[f"{prefix}deadlines_span_ms"] = span * 1000
    misses["notice_sends_not_once"] = abs(len(sent) - plan.runs) + (
        len(sent) - len({m.idempotency_key for m in sent})
    )
    misses["work_not_cancelled"] = plan.runs - rig.work.cancelled
    ms = [late * 1000 for late in lateness]
    figures[f"{prefix}watchdog_late_p50_ms"] = percentile(ms, 50)
    figures[f"{prefix}watchdog_late_p99_ms"] = percentile(ms, 99)
    figures[f"{prefix}watchdog_late_max_ms"] = max(ms, default=float("nan"))
    stats = rig.scheduler.stats()
    figures[f"{prefix}scheduler_fired"] = stats.fired
    figures[f"{prefix}scheduler_late_p50_ms"] = stats.p50_ms
    figures[f"{prefix}scheduler_late_p99_ms"] = stats.p99_ms
    figures[f"{prefix}scheduler_late_max_ms"] = stats.max_ms
    figures["misses"] = figures.get("misses", 0.0) + sum(misses.values())
    for key, count in misses.items():
        figures[f"{prefix}miss_{key}"] = count


def _round(figures: dict[str, float], directory: str, plan: _Plan, prefix: str) -> None:
    """One round on a fresh store: spawn, (idle,) fire under load, settle, audit."""
    with _rig(directory) as rig:
        if plan.baseline_s:
            cpu, wall = _cpu_percent(plan.baseline_s)
            figures["baseline_idle_cpu_percent"] = cpu / wall * 100
        spawn_s, first_deadline = _spawn_all(rig, plan)
        figures[f"{prefix}runs"] = plan.runs
        figures[f"{prefix}spawn_s"] = spawn_s
        figures[f"{prefix}spawns_per_s"] = plan.runs / spawn_s
        figures[f"{prefix}threads"] = threading.active_count()
        figures[f"{prefix}pending_timers"] = rig.scheduler.pending()
        if plan.quiet_s:
            _idle(figures, rig, plan, first_deadline)
        with _Load(rig.store, LOAD_THREADS) as load:
            _await_fired(rig, plan.runs)
        if load.errors:
            raise load.errors[0]
        figures[f"{prefix}load_events_per_s"] = load.rate
        figures[f"{prefix}notices_settled_after_fired_s"] = _settled(rig, plan.runs)
        _lateness(figures, rig, plan, prefix)


@benchmark("supervision")
def run(quick: bool) -> Result:
    """1,000 hung runs (200 quick) under their watchdogs and one supervisor."""
    result = Result("supervision")
    rounds = (
        [(QUICK, ""), (QUICK_BURST, "burst_")] if quick else [(FULL, ""), (FULL_BURST, "burst_")]
    )
    with quiet_logs():
        for plan, prefix in rounds:
            with scratch() as directory:
                _round(result.figures, directory, plan, prefix)
    result.machine["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result.goal("idle_cpu_percent", "<=", 5.0)
    result.goal("watchdog_late_p99_ms", "<=", 100.0)
    result.goal("misses", "<=", 0.0)
    return result
