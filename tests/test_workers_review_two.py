"""Second review of the activation workers, their policies and the scheduler: defects
proven by tests that failed before their fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    ActivationLeased,
    SessionRequiresAction,
    TurnCompleted,
)
from stalwart.runtime import Runtime, send_message
from stalwart.state import ACTIVATIONS
from stalwart.store import Due, EventStore, Fence, NewEvent, WorkQueue, load_state
from stalwart.testing import Answer, FakeProvider, FakeToolCall
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
    settled,
)


# Was: DEFECT: a message sent while a session waited for an approval made a second, unasked reply
def test_a_message_sent_during_a_pause_does_not_make_the_resume_answer_twice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The user asks for a refund (it needs an approval), then writes "any news?" while
    the request waits; the operator allows it. The message, queued before the resume, is
    leased first; its wake continues the paused step (the refund runs, the model answers)
    and is acked. The resume was then run on its own: one more model call on a
    conversation with nothing new in it, and a second reply the user never asked for. The
    message's lease covers the resume queued behind it: one wake, one answer."""
    runs: list[int] = []
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int) -> str:
            """Refund an order."""
            runs.append(order)
            return "refunded"

        call = FakeToolCall(id="c1", name="refund", arguments={"order": 7})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refund done."))
        session = rt.session("s1", channel="chat")
        session.send("refund order 7")
        records = log_until(store, "session:s1", has(ActivationBlocked))
        session.send("any news?")
        [request] = of(SessionRequiresAction, records)
        rt.confirm("s1", request.request_id, allow=True)
        log_until(store, "session:s1", has(ActivationAcked))
        settled(store, "s1")
        assert delivered(rt, chat, 2)[1].text == "Refund done."
    records = list(store.read_stream("session:s1"))
    assert runs == [7]
    assert len(fake.requests) == 2, "the resume called the model again"
    assert [e.outcome for e in of(TurnCompleted, records)] == ["paused", "answered"]
    assert len(of(ActivationLeased, records)) == 2
    report = verify_store(store, "session:s1")
    assert report.clean, report.findings


def _lease_elsewhere(store: EventStore, stream: str, at: float, *, claim: bool = True) -> int:
    """Another worker process (``stalwart worker`` elsewhere) leases the session's due
    activation at ``at``, after claiming it when ``claim``; returns the lease's epoch."""
    assert isinstance(store, WorkQueue)
    if claim:
        assert [c.stream for c in store.claim_due("elsewhere", at, 8, 5.0).claimed] == [stream]
    state = load_state(store, stream, ACTIVATIONS)
    leased = ActivationLeased(
        activation_id=state.queue[0].activation_id,
        owner="elsewhere",
        epoch=state.epoch + 1,
        expires_at=at + 30,
        ttl_ms=30_000,
    )
    news = [NewEvent(event=leased, ts=at)]
    fence = Fence(leased.epoch, claim=True)
    store.append(stream, news, state.version, fence=fence, due=Due(leased.expires_at))
    return leased.epoch


def _ack_elsewhere(store: EventStore, stream: str, at: float, epoch: int) -> None:
    """The other worker's wake of lease ``epoch`` is acked; it writes the due time back."""
    assert isinstance(store, WorkQueue)
    state = load_state(store, stream, ACTIVATIONS)
    assert state.lease is not None
    acked = ActivationAcked(activation_id=state.lease.activation_id, epoch=epoch)
    left = len(state.queue) - 1
    due = Due(at if left else None)
    news = [NewEvent(event=acked, ts=at)]
    store.append(stream, news, state.version, fence=Fence(epoch), due=due)


# Was: DEFECT: a worker kept the fold of every session another worker served, for ever
def test_a_worker_forgets_the_fold_of_a_session_another_worker_ran(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """With several workers, one that claims a session and finds work not yet due (a
    message that came while another worker's lease runs, a retry's backoff) writes back
    the due time and keeps its fold until it claims the session again. When the other
    worker ran that work itself (its next wake needs no claim), nothing ever brought the
    session back: each worker held a fold (queued texts included) of most sessions the
    deployment ever served, against the promise that a worker running for weeks holds
    none. A kept fold whose due time passed without a claim of this worker is forgotten."""
    config = runtime_config(fake.base_url, activations={"passivate_after_ms": 0})
    stream = "session:s1"
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        send_message(store, "s1", "first", channel="chat")
        now = clock.now()
        epoch = _lease_elsewhere(store, stream, now)
        send_message(store, "s1", "second", channel="chat")  # due now: the lease runs
        advance_until(clock, lambda: rt.worker().sessions == 1, 0.5)
        _ack_elsewhere(store, stream, clock.now(), epoch)
        epoch = _lease_elsewhere(store, stream, clock.now(), claim=False)
        _ack_elsewhere(store, stream, clock.now(), epoch)
        clock.advance(60)
        advance_until(clock, lambda: rt.worker().sessions == 0, 1.0)
        assert rt.worker().running == {}
    assert fake.requests == []
    records = list(store.read_stream(stream))
    assert {e.owner for e in of(ActivationLeased, records)} == {"elsewhere"}


#: sessions with a message due when the worker starts: its first claim (``claim_batch``
#: 1000) starts a wake for each before it answers anything else (about 17 ms a wake on a
#: loaded 2-core machine: well over the 5 s the banner's ask used to wait)
BACKLOG = 1_000
#: how long a worker may take to stop on SIGTERM (under pytest-timeout's 120 s per test)
STOP_WAIT_S = 75.0


def _stopped(worker: subprocess.Popen[str], wait_s: float) -> str:
    """The stderr of ``worker`` once it exits; a worker still running after ``wait_s``
    is aborted, and the test fails with the stacks its threads were in (faulthandler)."""
    try:
        return worker.communicate(timeout=wait_s)[1]
    except subprocess.TimeoutExpired:
        worker.send_signal(signal.SIGABRT)
        err = worker.communicate()[1]
        pytest.fail(f"the worker did not stop within {wait_s:g} s of SIGTERM:\n{err[-6000:]}")


# Was: DEFECT: `stalwart worker` died at start ("internal error: TimeoutError") on a backlog
def test_a_worker_started_on_a_large_backlog_runs_instead_of_failing(tmp_path: Path) -> None:
    """After an outage an operator raises ``claim_batch`` to drain the backlog and starts
    ``stalwart worker``: its first poll starts a wake for every due session before the
    worker reads another message, and the command's banner asked the worker its owner
    name with a 5 s timeout. The ask timed out: "stalwart: internal error: TimeoutError",
    exit 1, the runtime torn down, the same again at every restart. The banner no longer
    depends on a busy worker's answer: the worker runs, and stops cleanly on SIGTERM."""
    store_dir = tmp_path / "store"
    with store_module.open(store_dir) as store:
        for i in range(BACKLOG):
            send_message(store, f"s{i}", "hello")
    with FakeProvider() as fake:
        fake.set_default(Answer(text="hi"))
        config = tmp_path / "stalwart.toml"
        config.write_text(
            f'[store]\nlocation = "{store_dir}"\n\n'
            f'[providers.main]\nkind = "openai"\nbase_url = "{fake.base_url}"\n\n'
            '[agents.default]\nprovider = "main"\nmodel = "m1"\n\n'
            "[activations]\nclaim_batch = 1000\n"
        )
        worker = subprocess.Popen(
            [sys.executable, "-m", "stalwart", "worker", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            # a worker that does not stop dumps its threads' stacks on SIGABRT (below)
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        )
        try:
            assert worker.stderr is not None
            banner = worker.stderr.readline()  # written once the runtime runs
            while banner.startswith("{"):  # a warning logged before it
                banner = worker.stderr.readline()
            assert banner.startswith("worker"), banner
            fake.wait_for(lambda requests: len(requests) >= 1, GUARD)
        finally:
            worker.send_signal(signal.SIGTERM)
            err = _stopped(worker, STOP_WAIT_S)
    assert worker.returncode == 0, err[-500:]
    assert "internal error" not in err
    assert "stopping" in err
