"""Review s32 of the activation workers, their due-work queue and ``stalwart worker``:
defects proven by tests that failed before their fix."""

from __future__ import annotations

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
)
from stalwart.runtime import Runtime
from stalwart.state import ACTIVATIONS
from stalwart.store import Due, EventStore, Fence, NewEvent, WorkQueue, load_state
from stalwart.testing import FakeProvider, Hang
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    has,
    log_until,
    runtime_config,
)


def _take_over(store: EventStore, stream: str, at: float) -> int:
    """Another worker (this one froze past its lease) leases the session's activation at
    a higher epoch; returns that epoch."""
    state = load_state(store, stream, ACTIVATIONS)
    assert state.lease is not None
    leased = ActivationLeased(
        activation_id=state.lease.activation_id,
        owner="elsewhere",
        epoch=state.epoch + 1,
        expires_at=at + 30,
        ttl_ms=30_000,
    )
    fence = Fence(leased.epoch, claim=True)
    news = [NewEvent(event=leased, ts=at)]
    store.append(stream, news, state.version, fence=fence, due=Due(leased.expires_at))
    return leased.epoch


# Was: DEFECT: a worker whose lease was taken over kept that session's fold for ever
def test_a_worker_forgets_the_fold_of_a_session_whose_lease_it_lost(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A worker froze past its lease (a long pause, a loaded host); another worker took
    the session over and ran the wake to its end. The frozen one's next renewal is
    fenced: it records ``activation:lease_lost`` and stops its wake. It kept the fold it
    read then (the other worker's live lease, due at that lease's expiry) and looked at
    it once, a claim's hold and a poll later, while that expiry was still ahead: never
    again, as its Agent (told of a takeover) ends no wake. Each lost lease left one fold
    behind for the life of the process. It is looked at again once its due time passed,
    and forgotten as the docs promise."""
    fake.add(Hang())
    config = runtime_config(fake.base_url, activations={"passivate_after_ms": 0})
    stream = "session:s1"
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        epoch = _take_over(store, stream, clock.now())
        clock.advance(config.activations.renew_every_ms / 1000)  # the renewal is fenced
        log_until(store, stream, has(ActivationLeaseLost))
        state = load_state(store, stream, ACTIVATIONS)
        acked = ActivationAcked(activation_id=state.queue[0].activation_id, epoch=epoch)
        news = [NewEvent(event=acked, ts=clock.now())]
        store.append(stream, news, state.version, fence=Fence(epoch), due=Due(None))
        assert rt.worker().running == {}
        advance_until(clock, lambda: rt.worker().sessions == 0, 1.0)


def _due_now(store: EventStore, at: float) -> list[str]:
    """The sessions whose due row says "look now" at ``at`` (claimed with no hold, so the
    worker may claim them again at once)."""
    assert isinstance(store, WorkQueue)
    return [c.stream for c in store.claim_due("probe", at, 100, 0.0).claimed]


# Was: DEFECT: a wake recorded with wake_at NaN crashed the activation worker at every poll
def test_a_wake_whose_time_is_not_a_number_does_not_crash_the_worker(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A build before ``wake_at`` was checked recorded a delayed wake at NaN (every
    comparison with it is false, so the horizon cap let it through). Its session's due
    row was due at once; the worker claimed it, folded it and wrote back the fold's due
    time, NaN, which the store refuses with a ValueError: the worker died, was restarted
    (under a new owner, so the leases of the wakes it ran were no longer renewed: they
    expired and counted as failures) and claimed the session first again, every few
    seconds for ever. Such a wake is never due (no lease decision picks it): its session
    has nothing due, the row is cleared and the worker keeps running."""
    config = runtime_config(fake.base_url, activations={"passivate_after_ms": 0})
    bad = ActivationReady(activation_id="old", kind="wake", wake_at=float("nan"), text="tick")
    store.append("session:bad", [NewEvent(event=bad, ts=clock.now())])
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        owner = rt.worker().owner
        advance_until(clock, lambda: "session:bad" not in _due_now(store, clock.now()), 0.5)
        rt.session("good", channel="chat").send("hello")
        assert [m.text for m in delivered(rt, chat, 1)] == ["default answer"]
        assert rt.worker().owner == owner, "the worker was restarted"
