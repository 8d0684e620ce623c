"""The worker with and without a store's work queue, through a real runtime: with one it
folds only the sessions it claimed; on a store without one (any EventStore) it folds the
whole log and still runs every wake, delayed ones included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.errors import StoreUnavailableError
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    LeaseExpired,
    RecordedEvent,
)
from stalwart.runtime import Runtime, send_message
from stalwart.store import NO_STREAM, Due, EventStore, Fence, NewEvent, WorkQueue
from stalwart.testing import FakeProvider, PlainStore
from tests._runtime_support import delivered, has, log_until, of
from tests.test_durable_sessions import config


def _settled_history(store: EventStore, sessions: int, now: float) -> None:
    """Sessions whose one activation was leased and acked long ago (no work left)."""
    assert isinstance(store, WorkQueue)
    for i in range(sessions):
        events = [
            ActivationReady(activation_id=f"old{i}", kind="wake", text="tick"),
            ActivationLeased(activation_id=f"old{i}", owner="gone", epoch=1, expires_at=now),
            ActivationAcked(activation_id=f"old{i}", epoch=1),
        ]
        news = [NewEvent(event=e, ts=now - 3600) for e in events]
        store.append(f"session:old{i}", news, NO_STREAM, fence=Fence(1, claim=True), due=Due(None))


def test_a_worker_folds_only_the_sessions_it_claimed(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    _settled_history(store, 10, clock.now())
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("new", channel="chat").send("hello")
        [reply] = delivered(rt, chat, 1)
        assert reply.text == "default answer"
        # not the ten in the log's history (and, once its wake settled, not even this one)
        assert rt.worker().sessions <= 1


@pytest.fixture
def plain(store: EventStore) -> PlainStore:
    return PlainStore(store)


def test_a_store_without_a_work_queue_still_runs_every_wake(
    plain: PlainStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    assert not isinstance(plain, WorkQueue)
    _settled_history(plain.inner, 3, clock.now())
    with Runtime(config(fake.base_url), store=plain, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        delivered(rt, chat, 1)
        rt.wake_at("s1", clock.now() + 60, "check the order")
        clock.advance(60.0)
        delivered(rt, chat, 2)
        records: list[RecordedEvent] = log_until(plain, "session:s1", has(ActivationAcked, 2))
        assert [leased.epoch for leased in of(ActivationLeased, records)] == [1, 2]
        assert rt.worker().sessions == 4  # it folded the whole log: the history too


def test_a_claim_batch_of_one_still_serves_every_session_due_before_the_start(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Work written before the runtime started (by a CLI, say) is found by the worker's
    claims, here one session per claim: a full claim polls again at once."""
    from stalwart.runtime import send_message

    for name in ("a", "b", "c"):
        send_message(store, name, f"hello {name}", channel="chat", ts=clock.now())
    settings = config(fake.base_url, activations={"claim_batch": 1, "claim_hold_ms": 200})
    assert (settings.activations.claim_batch, settings.activations.claim_hold_ms) == (1, 200)
    with Runtime(settings, store=store, clock=clock, channels={"chat": chat}):
        for name in ("a", "b", "c"):
            log_until(store, f"session:{name}", has(ActivationAcked))


@pytest.mark.parametrize(
    ("key", "value"), [("claim_batch", 0), ("claim_hold_ms", 99), ("claim_batch", "8")]
)
def test_claim_knobs_out_of_range_are_config_errors_naming_them(
    fake: FakeProvider, key: str, value: object
) -> None:
    from stalwart.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        config(fake.base_url, activations={key: value})


class _Blipping(PlainStore):
    """A third-party store whose database blips once: the first read of a session's
    first record (what starting its Agent for a wake reads) cannot reach it."""

    def __init__(self, store: EventStore) -> None:
        super().__init__(store)
        self.blipped = 0
        inner_read = store.read_stream

        def read_stream(
            stream: str, from_version: int = 1, to_version: int | None = None
        ) -> Iterator[RecordedEvent]:
            if not self.blipped and (from_version, to_version) == (1, 1):
                self.blipped += 1
                raise StoreUnavailableError("no connection to the store: is the server up?")
            return inner_read(stream, from_version, to_version)

        self.read_stream = read_stream


def test_a_wake_whose_agent_could_not_start_while_the_store_blipped_runs_once_it_is_back(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Starting a session's Agent for a wake reads the store; when it cannot be reached
    (StoreUnavailableError: nothing was handed over), the worker keeps its lease and runs
    the wake at its next poll. It used to count a failed wake (``wake_refused``): with
    ``max_attempts`` = 1 the user's message was abandoned though nothing ran, because
    the database was away for a moment (seen on PostgreSQL while its pool reconnected
    after an outage)."""
    blipping = _Blipping(store)
    settings = config(fake.base_url, activations={"max_attempts": 1})
    with Runtime(settings, store=blipping, clock=clock, channels={"chat": chat}) as rt:
        rt.worker()  # started, and polled once
        send_message(blipping, "s1", "hello", channel="chat", ts=clock.now())
        clock.advance(1.0)  # the next poll leases it; starting its Agent fails
        log_until(store, "session:s1", has(ActivationLeased))
        rt.worker()  # that poll is over
        assert blipping.blipped == 1
        clock.advance(1.0)  # the next poll runs the wake it leased
        [reply] = delivered(rt, chat, 1)
        records = log_until(store, "session:s1", has(ActivationAcked))
    assert reply.text == "default answer"
    assert of((ActivationRequeued, ActivationAbandoned, LeaseExpired), records) == []
    assert [lease.epoch for lease in of(ActivationLeased, records)] == [1]
