"""A lease handed back by a clean stop (``activation:released``) fences out its old holder.

``Runtime.close`` stops the Agents, waits for each up to a bound, and then the worker
hands the running wakes' leases back. An Agent that did not stop in time (busy past the
bound) still runs its wake: whatever it appends after the release must be refused by
the store, as after a takeover, so that its settlement never lands outside a lease and
the activation stays queued for the next worker, which answers it once."""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.errors import FencedError
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationReleased,
    MessageAppended,
    RecordedEvent,
)
from stalwart.runtime import Runtime, send_message
from stalwart.state import ACTIVATIONS, ActivationPolicy, decide_lease
from stalwart.store import Due, EventStore, Fence, NewEvent, WorkQueue, load_state
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import GUARD, delivered, has, log_until, of, runtime_config, until

STREAM = "session:s1"


def _answered_once(store: EventStore, rt: Runtime, chat: MemoryChannel) -> list[RecordedEvent]:
    """The records of ``s1`` once the next runtime's wake acked: one ack, one reply."""
    records = log_until(store, STREAM, has(ActivationAcked))
    assert [m.text for m in delivered(rt, chat, 1)] == ["default answer"]
    assert len(of(ActivationAcked, records)) == 1
    return records


@pytest.fixture(params=["lmdb", "postgres"])
def either_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> Iterator[EventStore]:
    """A store of each kind: both keep the lease epoch a release claims."""
    location = tmp_path / "store" if request.param == "lmdb" else request.getfixturevalue("pg_url")
    opened = store_module.open(location, clock=clock)
    try:
        yield opened
    finally:
        opened.close()


def _clean(store: EventStore) -> None:
    report = verify_store(store, STREAM)
    assert report.clean, [f.message for f in report.findings]


# Was: DEFECT: a wake still running after a clean stop released its lease could ack under its fence
def test_a_settlement_under_a_released_lease_is_fenced_out(
    either_store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``rt.close()`` mid-wake hands the lease back. The release used to leave the
    stream's lease epoch where it was, so the holder's ``Fence(epoch)`` still passed: the
    ack an Agent that had not stopped in time appends afterwards went through, the
    activation left the queue unanswered, and ``replay --verify`` found a settlement
    outside any lease. The release now claims the next epoch: the late ack is refused,
    the activation stays queued, and the next runtime answers it exactly once."""
    store = either_store
    config = runtime_config(fake.base_url)
    fake.add(Hang())
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("a long job")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    records = list(store.read_stream(STREAM))
    [leased] = of(ActivationLeased, records)
    [released] = of(ActivationReleased, records)
    late = ActivationAcked(activation_id=leased.activation_id, epoch=leased.epoch)
    with pytest.raises(FencedError):
        store.append(STREAM, [NewEvent(event=late, ts=clock.now())], fence=Fence(leased.epoch))
    assert released.claimed == leased.epoch + 1
    assert store.lease_epoch(STREAM) == released.claimed
    state = load_state(store, STREAM, ACTIVATIONS)
    assert state.find(leased.activation_id) is not None, "the released work left the queue"
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        records = _answered_once(store, rt, chat)
    [_, again] = of(ActivationLeased, records)
    assert again.epoch == released.claimed + 1
    assert again.activation_id == leased.activation_id
    _clean(store)


# Was: DEFECT: an Agent busy past close's stop answered after its lease was handed back
def test_an_agent_busy_past_the_release_is_fenced_out_and_answers_nothing(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
    logs: list[MutableMapping[str, Any]],
) -> None:
    """The close steps around an Agent that does not stop in time: the worker leases
    nothing more, the Agent is still in a long tool call when its lease is handed back,
    and the call ends afterwards. The Agent used to record the tool's result, call the
    model, ack and send its reply; the message its lease covered was answered outside any
    lease. Now its first append after the release is fenced out (``agent.fenced``): it
    records nothing, sends nothing, and the next runtime answers the message once."""
    config = runtime_config(fake.base_url)
    running, finish = threading.Event(), threading.Event()

    def slow_job() -> str:
        """A long job."""
        running.set()
        finish.wait(GUARD)  # real-time: the tool runs until the test lets it end
        return "done"

    call = FakeToolCall(name="slow_job", id="call-1")
    fake.add(Answer(text="", tool_calls=(call,)))
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(slow_job)
        rt.session("s1", channel="chat").send("a long job")
        assert running.wait(GUARD)  # real-time: the tool runs on a thread of its own
        sessions = rt._sessions
        assert sessions is not None
        # Runtime._close's steps but the Agents' stop, which gave up on this busy one
        sessions.pause_worker()
        sessions.stop_worker()
        version = store.stream_version(STREAM)
        finish.set()
        until(lambda: any(e["event"] == "agent.fenced" for e in logs), what="agent.fenced")
        assert store.stream_version(STREAM) == version, "the Agent appended after the release"
        assert chat.attempted == []
    state = load_state(store, STREAM, ACTIVATIONS)
    assert state.lease is None
    assert len(state.queue) == 1, "the released work left the queue"
    fake.set_default(Answer(text="default answer"))
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(slow_job)
        records = _answered_once(store, rt, chat)
    tool_results = [m for m in of(MessageAppended, records) if m.role == "tool"]
    assert len(tool_results) <= 1
    _clean(store)


def test_a_release_recorded_before_releases_claimed_an_epoch_folds_and_verifies_as_before(
    store: EventStore, clock: FakeClock
) -> None:
    """A log written by an older version: its release has no ``claimed`` (decoded as 0)
    and was appended under the holder's fence. It folds as then (the epoch stays, the
    next lease takes the one after it) and ``replay --verify`` accepts it."""
    policy = ActivationPolicy(
        lease_ttl_ms=30_000,
        renew_every_ms=10_000,
        backoff_base_ms=2_000,
        backoff_cap_ms=30_000,
        max_attempts=5,
        max_pending_wakes=10,
        max_wake_horizon_ms=600_000,
    )
    assert isinstance(store, WorkQueue)
    send_message(store, "s1", "hello")

    def lease(owner: str) -> ActivationLeased:
        state = load_state(store, STREAM, ACTIVATIONS)
        [leased] = decide_lease(state, owner, clock.now(), policy)
        assert isinstance(leased, ActivationLeased)
        fence = Fence(leased.epoch, claim=True)
        news = [NewEvent(event=leased, ts=clock.now())]
        store.append(STREAM, news, state.version, fence=fence, due=Due(leased.expires_at))
        return leased

    first = lease("w1")
    old = ActivationReleased(activation_id=first.activation_id, owner="w1", epoch=first.epoch)
    store.append(STREAM, [NewEvent(event=old, ts=clock.now())], fence=Fence(first.epoch))
    [recorded] = of(ActivationReleased, list(store.read_stream(STREAM)))
    assert recorded.claimed == 0
    state = load_state(store, STREAM, ACTIVATIONS)
    assert state.lease is None
    assert state.epoch == first.epoch
    assert lease("w2").epoch == first.epoch + 1
    _clean(store)
