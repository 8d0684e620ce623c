"""Review: resources over a long run (leaks and unbounded growth).

stalwart's hosts run it for weeks: agents in chat channels with many sessions that go
idle and are passivated, sub-agent runs, runtimes and channels built and closed. Each test
drives the real parts (a real LMDB store in a temporary directory, the loopback fake
provider, a host channel, the fake clock) through many cycles and compares what is held
after a warm-up with what is held after a later phase of the same size: what should be
flat (threads, file descriptors, live actors, timers, logging filters) must stay flat, and
nothing may grow with the number of sessions or runs ever seen unless the docs say so.

Tests marked ``# Was:`` failed on ``1ae0d67`` (until the fix of the same session); each
docstring says what a host saw, what it should see and where the cause was.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pykka
import pytest

from stalwart import _logs
from stalwart import store as store_module
from stalwart.actors import AgentActor, RunReport
from stalwart.channels import Delivery, OutboundMessage, WebhookChannel
from stalwart.clock import FakeClock
from stalwart.config import ChannelSettings
from stalwart.runtime import Runtime, SessionHandle
from stalwart.testing import Answer, FakeProvider
from tests._runtime_support import GUARD, runtime_config, until

#: passivate_after_ms in these tests: the sweep runs every 30 s of fake time
IDLE_MS = 60_000
#: sessions in each measured phase of the many-sessions run
PHASE = 200
#: real seconds a whole phase may take on a loaded machine before the test gives up
PATIENCE = 60.0


class Inbox:
    """A host channel (docs/embedding.md's ``Inbox``) that counts what it was given and
    keeps none of it, so the test's own bookkeeping does not grow with the run."""

    def __init__(self, name: str = "chat") -> None:
        self.name = name
        self.count = 0
        self._changed = threading.Condition()

    async def send(self, message: OutboundMessage) -> Delivery:
        with self._changed:
            self.count += 1
            self._changed.notify_all()
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        pass

    def wait(self, count: int) -> None:
        with self._changed:
            reached = self._changed.wait_for(lambda: self.count >= count, PATIENCE)
        assert reached, f"only {self.count} of {count} replies arrived"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _alive(kind: type) -> int:
    """How many objects of ``kind`` are alive (after a full collection)."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kind))


def _passivate(clock: FakeClock, refs: list[pykka.ActorRef[Any]]) -> None:
    """Move the clock, one sweep period at a time, until every Agent in ``refs`` is
    stopped by the passivation sweep (which runs on its own thread)."""
    give_up = time.monotonic() + PATIENCE
    while any(ref.is_alive() for ref in refs):
        assert time.monotonic() < give_up, "the sweep never passivated the idle Agents"
        clock.advance(IDLE_MS / 2000)
        time.sleep(0.01)  # real-time: the sweep stops the Agents on its own thread


# -- many sessions, each answered once and passivated ----------------------------------------


@dataclass(frozen=True)
class Held:
    """What a runtime holds at one point of the run."""

    threads: int
    fds: int
    actors: int
    timers: int
    handles: int
    worker_sessions: int


@dataclass(frozen=True)
class ManySessions:
    warm: Held
    first: Held
    second: Held


def _held(rt: Runtime) -> Held:
    gc.collect()
    scheduler = rt._base._scheduler  # the runtime exposes no count of its timers
    assert scheduler is not None
    return Held(
        threads=threading.active_count(),
        fds=_fds(),
        actors=len(pykka.ActorRegistry.get_all()),
        timers=scheduler.pending(),
        handles=_alive(SessionHandle),
        worker_sessions=rt.worker(GUARD).sessions,
    )


def _chat_phase(rt: Runtime, clock: FakeClock, inbox: Inbox, name: str, count: int) -> None:
    """``count`` new sessions, one message each, answered; then idle until passivated.
    The host keeps no handle afterwards (a chat bot forgets a conversation that ended)."""
    expected = inbox.count + count
    handles = [rt.session(f"{name}-{index}", channel="chat") for index in range(count)]
    for handle in handles:
        handle.send("where is my refund?")
    inbox.wait(expected)
    refs = [handle.ref for handle in handles]
    del handles
    _passivate(clock, refs)


@pytest.fixture(scope="module")
def many_sessions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManySessions]:
    """One runtime: a warm-up of 20 sessions, then two phases of PHASE new sessions, each
    session answered once and passivated; what the runtime held after each."""
    clock = FakeClock(start=1_800_000_000.0)
    path: Path = tmp_path_factory.mktemp("many") / "store"
    log = store_module.open(path, clock=clock)
    inbox = Inbox()
    try:
        with FakeProvider() as fake:
            fake.set_default(Answer(text="it is on its way"))
            cfg = runtime_config(fake.base_url, activations={"passivate_after_ms": IDLE_MS})
            with Runtime(cfg, store=log, clock=clock, channels={"chat": inbox}) as rt:
                _chat_phase(rt, clock, inbox, "warm", 20)
                warm = _held(rt)
                _chat_phase(rt, clock, inbox, "first", PHASE)
                first = _held(rt)
                _chat_phase(rt, clock, inbox, "second", PHASE)
                second = _held(rt)
        yield ManySessions(warm=warm, first=first, second=second)
    finally:
        log.close()


@pytest.mark.timeout(240)
def test_threads_fds_actors_and_timers_stay_flat_over_hundreds_of_passivated_sessions(
    many_sessions: ManySessions,
) -> None:
    """Passivation keeps the live parts flat: 200 more sessions, each answered and idle,
    leave no Agent running, no extra thread (not one per session), no descriptor and
    no timer behind (docs/sessions.md: "Thousands of sessions do not need thousands of
    live threads")."""
    first, second = many_sessions.first, many_sessions.second
    assert second.actors <= first.actors, (second, first)
    assert second.actors <= 8, f"Agents still alive after passivation: {second.actors} actors"
    # anyio's shared worker threads (at most 40) and the provider's keep-alive pool come
    # and go with load; one thread or descriptor per session would be PHASE more
    assert second.threads <= first.threads + 40, (second, first)
    assert second.fds <= first.fds + PHASE // 2, (second, first)
    assert second.timers <= first.timers + 8, (second, first)


@pytest.mark.timeout(240)
def test_a_passivated_session_leaves_no_handle_behind(many_sessions: ManySessions) -> None:
    # Was: every session ever started keeps a SessionHandle (and its dead Agent's
    # mailbox) in SessionLayer._handles for the life of the runtime
    """A chat host that opens a session per conversation and drops it once answered
    should hold no more memory after 200 more such sessions went idle and were
    passivated. Instead the runtime keeps, for every session it ever started, its
    ``SessionHandle`` in ``SessionLayer._handles`` (stalwart/runtime/_sessions.py:91,
    set at :214, never removed while the runtime runs; ``passivate`` at :463 only adds
    the id to ``_passivated``). Each holds its stopped Agent's ``ActorRef`` with its
    mailbox (a ``queue.Queue`` and an ``Event``: 4 Conditions and their deques) and three
    partials: about 7 KB per session measured with tracemalloc, so a bot that sees 100 000
    conversations over a few weeks holds ~700 MB for Agents that are all stopped.

    Expected: memory does not grow with the sessions ever seen (docs/sessions.md:
    passivation's "state is the log"): on passivation keep at most a small record (or
    nothing: ``session:created`` records the agent, channel, conversation and thread)
    and rebuild the handle on demand; a host that still holds its handle keeps it valid
    through its ``revive`` callback."""
    first, second = many_sessions.first, many_sessions.second
    grown = second.handles - first.handles
    assert grown <= PHASE // 10, (
        f"{PHASE} sessions answered and passivated, their handles dropped by the host: "
        f"the runtime still holds {grown} more SessionHandles (each with its stopped "
        "Agent's mailbox); a host expects memory not to grow with every session ever seen"
    )


@pytest.mark.timeout(240)
def test_the_activation_worker_forgets_sessions_with_no_work(
    many_sessions: ManySessions,
) -> None:
    # Was: ActivationWorker._states keeps a fold of every session it ever leased
    """The activation worker (stalwart/actors/_worker.py:230, ``_states``) keeps the
    ``ActivationsState`` of every session it ever folded, also on a store with a work
    queue (both LMDB and PostgreSQL), where it only ever needs the sessions it claimed
    and whose wakes run; nothing removes an entry (``_refresh`` at :300 adds one per
    claimed session). A host sees it as ``rt.worker().sessions`` growing by one for each
    session ever answered: 200 idle, passivated sessions with no work left add 200
    folds (a claim history of up to 20 entries each) for the life of the process.

    Expected: a settled session with no due work is dropped from the worker's memory
    (it is claimed again, and folded from its snapshot, when new work is appended), so
    the worker's memory follows the sessions with work, not the sessions ever seen."""
    first, second = many_sessions.first, many_sessions.second
    grown = second.worker_sessions - first.worker_sessions
    assert grown <= PHASE // 10, (
        f"{PHASE} sessions answered, settled (no work left) and passivated: the "
        f"activation worker holds {grown} more session folds "
        f"({first.worker_sessions} -> {second.worker_sessions}); it should hold the "
        "sessions with work, not every session ever seen"
    )


# -- one session woken and passivated again and again ----------------------------------------


@pytest.mark.timeout(240)
def test_one_session_woken_and_passivated_many_times_keeps_one_handle_and_no_agent(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    # Was: a stopped Agent stays reachable from its turn's cancelled execution timer
    """A session that talks every few minutes is woken and passivated again and again.
    Each wake starts a new Agent that folds the whole session; passivation stops it
    ("its state is the log"). The host's handle stays the same and nothing live
    accumulates (threads, actors). But every stopped Agent object stays reachable, with
    its whole folded session, from the scheduler: its turn's execution timer
    (stalwart/actors/_agent.py:486, ``partial(self._fire, turn_id)``) is cancelled when the
    turn ends, and ``Scheduler._retire`` (stalwart/actors/_scheduler.py:280) only marks
    the heap entry dead: the ``TimerHandle`` keeps its callback, and so the Agent, until
    the entry reaches the top of the heap (the cancelled deadline, 10 min after the turn
    began) or a compaction (more than 64 dead entries, and more dead than live). With
    ``execution_timeout_ms`` at 10 min and ``passivate_after_ms`` at 5 min, each
    passivated Agent's memory outlives its stop by about 5 min, and on a busy runtime
    (many live timers) by as many dead entries as there are live ones.

    Expected: a passivated session keeps no Agent object alive (cancelling a timer drops
    its callback: ``handle._callback = None`` in ``_retire``), so passivation frees the
    session's memory when it stops the Agent."""
    log = store_module.open(tmp_path / "store", clock=clock)
    inbox = Inbox()
    cfg = runtime_config(fake.base_url, activations={"passivate_after_ms": IDLE_MS})
    try:
        with Runtime(cfg, store=log, clock=clock, channels={"chat": inbox}) as rt:
            session = rt.session("regular", channel="chat")
            threads: list[int] = []
            actors: list[int] = []
            for count in range(1, 13):
                session.send(f"message {count}")
                inbox.wait(count)
                _passivate(clock, [session.ref])
                threads.append(threading.active_count())
                actors.append(len(pykka.ActorRegistry.get_all()))
                assert rt.session("regular") is session  # the same handle, woken up
            assert session.status(GUARD).session.turns == 12
            _passivate(clock, [session.ref])
            assert actors[-1] <= actors[2], actors
            assert threads[-1] <= threads[2] + 6, threads
            stopped = _alive(AgentActor)
    finally:
        log.close()
    assert stopped <= 1, (
        f"a session passivated 13 times keeps {stopped} stopped Agent objects alive (each "
        "with its folded session); passivation should free them"
    )


# -- sub-agent runs --------------------------------------------------------------------------


class _Payload:
    """What a host's work closes over (a document, a client, a buffer)."""

    def __init__(self) -> None:
        self.blob = bytearray(64 * 1024)


@pytest.mark.timeout(240)
def test_a_finished_runs_work_is_not_kept(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    # Was: RunLayer._works keeps every spawned run's work (and its closure) for ever
    """A host spawns sub-agent runs with ``work`` closures over what the task needs (a
    document, a client). Once a run has succeeded nobody can respawn it, yet
    ``RunLayer.spawn`` (stalwart/runtime/_runs.py:102) stores ``(work, agent)`` in
    ``_works`` under ``(parent, task)`` and nothing ever removes it (``ended`` at :192
    pops ``_runs`` and ``_tracks`` only); ``_splitters`` likewise. Every closure, and
    everything it references, lives as long as the runtime: 100 runs over a 64 KiB
    buffer each keep 6.4 MB alive, and ``_lineage`` (:225) scans all of them on every
    respawn and every ``holds_work`` ask.

    Expected: a lineage's work is forgotten once the lineage has ended for good (a run
    that succeeded, one escalated or given up), so finished runs hold no host memory."""
    log = store_module.open(tmp_path / "store", clock=clock)
    kept: list[weakref.ref[_Payload]] = []

    def work_over(payload: _Payload) -> Any:
        async def work(report: RunReport) -> str:
            report.progress(len(payload.blob), step=1)
            return "done"

        return work

    cfg = runtime_config(fake.base_url)
    try:
        with Runtime(cfg, store=log, clock=clock, channels={"chat": Inbox()}) as rt:
            actors = len(pykka.ActorRegistry.get_all())
            for index in range(100):
                payload = _Payload()
                kept.append(weakref.ref(payload))
                run = rt.spawn(
                    "planner",
                    f"research item {index}",
                    task_class="research",
                    channel="chat",
                    work=work_over(payload),
                    announce=False,
                )
                del payload
                assert run.result(GUARD).outcome == "succeeded"
            del run
            # every run's actor stopped (the last one's stop is not waited for by ended)
            until(lambda: len(pykka.ActorRegistry.get_all()) <= actors)
            gc.collect()
            alive = sum(ref() is not None for ref in kept)
    finally:
        log.close()
    assert alive == 0, (
        f"100 sub-agent runs succeeded and their handles were dropped: {alive} of their "
        "work closures (64 KiB each here) are still held by the runtime; a finished run "
        "should keep none of the host's memory"
    )


# -- runtimes and channels built and closed --------------------------------------------------


def _logging_hooks() -> dict[str, tuple[int, int]]:
    """Every stdlib logger with filters or handlers: (filters, handlers)."""
    hooks = {"": (len(logging.root.filters), len(logging.root.handlers))}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (logger.filters or logger.handlers):
            hooks[name] = (len(logger.filters), len(logger.handlers))
    return hooks


@pytest.mark.timeout(240)
def test_thirty_runtimes_started_and_stopped_leave_nothing_behind(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A host (or a test suite) that starts and closes a runtime again and again on one
    store: after a warm-up, 30 more cycles (each answering a message, with a configured
    webhook channel built and closed) leave no thread, descriptor, actor, logger,
    logging filter or handler behind."""
    start = 1_800_000_000.0
    log = store_module.open(tmp_path / "store", clock=FakeClock(start=start))
    channels = {"hook": {"kind": "webhook", "url": "https://hooks.example.invalid/t/abc"}}
    cfg = runtime_config(fake.base_url, channels=channels)

    def cycle(index: int) -> None:
        clock = FakeClock(start=start + 1_000 * index)  # each runtime later than the last
        inbox = Inbox()
        with Runtime(cfg, store=log, clock=clock, channels={"chat": inbox}) as rt:
            rt.session(f"s{index % 3}", channel="chat").send("hello")
            inbox.wait(1)

    try:
        for index in range(3):
            cycle(index)
        gc.collect()
        before = (threading.active_count(), _fds(), len(pykka.ActorRegistry.get_all()))
        hooks, loggers = _logging_hooks(), len(logging.Logger.manager.loggerDict)
        for index in range(3, 33):
            cycle(index)
        gc.collect()
        after = (threading.active_count(), _fds(), len(pykka.ActorRegistry.get_all()))
        assert _logging_hooks() == hooks
        assert len(logging.Logger.manager.loggerDict) == loggers
        # the fake provider's connection threads end a moment after their client closes;
        # a leak of one per runtime would be 30
        assert after[0] <= before[0] + 6, f"threads {before[0]} -> {after[0]}"
        assert after[1] <= before[1] + 6, f"file descriptors {before[1]} -> {after[1]}"
        assert after[2] == before[2] == 0, f"actors {before[2]} -> {after[2]}"
    finally:
        log.close()


@pytest.mark.timeout(240)
def test_a_closed_runtime_on_a_shared_fake_clock_is_released(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    # Was: Scheduler.stop() leaves its listener on the FakeClock, keeping the runtime
    """docs/embedding.md tells a host to test with a ``FakeClock``, and that a closed
    runtime cannot start again: "make a new one on the same store" (a restart test does
    exactly that, on the same clock). Each runtime's ``Scheduler.start`` registers
    ``_on_advance`` with ``clock.on_advance`` (stalwart/actors/_scheduler.py:248);
    ``stop`` never removes it and ``FakeClock`` has no way to. The clock then keeps every
    closed runtime reachable (the stopped scheduler, its kept timers and their callbacks
    over the Agents, actors, clients and store), about 130 KB per runtime measured
    over 30 cycles, and every ``advance()`` calls every dead scheduler.

    Expected: a closed runtime is garbage once the host drops it (``stop`` unregisters
    its listener, e.g. a ``FakeClock.remove_listener``, or the clock holds listeners
    weakly)."""
    log = store_module.open(tmp_path / "store", clock=clock)

    def closed_runtime(index: int) -> weakref.ref[Runtime]:
        inbox = Inbox()
        cfg = runtime_config(fake.base_url)
        rt = Runtime(cfg, store=log, clock=clock, channels={"chat": inbox})
        with rt:
            rt.session(f"s{index}", channel="chat").send("hello")
            inbox.wait(1)
        return weakref.ref(rt)

    try:
        closed = [closed_runtime(index) for index in range(3)]
        clock.advance(1.0)
        gc.collect()
        alive = sum(ref() is not None for ref in closed)
    finally:
        log.close()
    assert alive == 0, (
        f"{alive} of 3 closed runtimes are still alive, held by the FakeClock they ran "
        "on; a closed runtime the host dropped should be freed"
    )


class _Receiver:
    """A webhook receiver on 127.0.0.1 that accepts every POST (keep-alive)."""

    def __init__(self) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(GUARD)


def _message(index: int) -> OutboundMessage:
    return OutboundMessage(conversation="c1", text=f"reply {index}", idempotency_key=f"k{index}")


@pytest.mark.timeout(240)
def test_webhook_channels_built_and_closed_keep_no_connection(clock: FakeClock) -> None:
    """One webhook channel sending many messages keeps its keep-alive pool bounded (one
    connection to one receiver for messages sent one after the other), and channels
    built, used and closed again and again give back every descriptor and thread."""
    receiver = _Receiver()
    url = f"http://127.0.0.1:{receiver.port}/hook"

    async def send_all(channel: WebhookChannel, count: int) -> None:
        try:
            for index in range(count):
                await channel.send(_message(index))
        finally:
            await channel.aclose()

    def channel() -> WebhookChannel:
        return WebhookChannel("hook", ChannelSettings(kind="webhook", url=url), clock=clock)

    try:
        anyio.run(send_all, channel(), 3)  # warm-up: imports, the receiver's first thread
        gc.collect()
        before = (_fds(), threading.active_count())

        async def one_channel_many_sends() -> int:
            busy = channel()
            try:
                for index in range(200):
                    await busy.send(_message(index))
                return _fds()
            finally:
                await busy.aclose()

        during = anyio.run(one_channel_many_sends)
        assert during <= before[0] + 4, f"200 sends held {during - before[0]} descriptors"

        async def built_and_closed(times: int) -> None:
            for _ in range(times):
                await send_all(channel(), 2)

        anyio.run(built_and_closed, 30)
        time.sleep(0.2)  # real-time: the receiver's threads see their sockets close
        gc.collect()
        after = (_fds(), threading.active_count())
    finally:
        receiver.close()
    # the receiver's connection threads end a moment after their client closes; a leak
    # of one per channel would be 30
    assert after[0] <= before[0] + 6, f"file descriptors {before[0]} -> {after[0]}"
    assert after[1] <= before[1] + 6, f"threads {before[1]} -> {after[1]}"


def test_webhook_channels_built_and_closed_do_not_grow_the_log_filter(clock: FakeClock) -> None:
    # Was: every WebhookChannel ever built adds its url to _logs._HIDDEN_URLS for ever
    """A host that builds a ``WebhookChannel`` per tenant or per conversation (each its
    own incoming-webhook url, which holds a token) and closes it when done: each
    constructor calls ``hide_url`` (stalwart/channels/_webhook.py:77), which adds the url
    and its origin to the module-level ``_HIDDEN_URLS`` (stalwart/_logs.py:89) and nothing
    ever removes them, not ``aclose()`` either. The process keeps every webhook url it
    ever saw, secret path included, in memory for good: one entry per channel ever built.

    Expected: a closed channel's url is forgotten (``aclose`` drops it, counted per url
    so an open channel with the same url keeps it hidden), so building and closing
    channels does not grow the process."""

    async def build_and_close(count: int) -> None:
        for index in range(count):
            url = f"https://hooks.example.invalid/services/T0/B{index}/secret{index:06d}"
            settings = ChannelSettings(kind="webhook", url=url)
            await WebhookChannel("hook", settings, clock=clock).aclose()

    before = len(_logs._HIDDEN_URLS)
    anyio.run(build_and_close, 40)
    grown = len(_logs._HIDDEN_URLS) - before
    assert grown <= 2, (
        f"40 webhook channels built and closed: {grown} of their urls (tokens included) "
        "are still kept by stalwart._logs; a closed channel should leave nothing behind"
    )
