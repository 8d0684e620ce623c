"""Review s35 of delayed wakes, the work queue and passivation: defects proven by tests
that failed before their fix. Real parts: a runtime on a real LMDB store, the loopback
fake provider, the clock driven by the test."""

from __future__ import annotations

from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import ActivationAcked, ActivationLeased, ActivationLeaseLost
from stalwart.runtime import Runtime, interrupt, send_message
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
)

#: a lease renewed rarely: what the worker does before its next renewal shows
SLOW_RENEWAL = {"lease_ttl_ms": 600_000, "renew_every_ms": 200_000, "passivate_after_ms": 0}


def _leases(store: EventStore, stream: str) -> int:
    return len(of(ActivationLeased, list(store.read_stream(stream))))


# Was: DEFECT: after `stalwart session interrupt` the next message waited for the old renewal
def test_a_message_after_an_interrupt_from_another_process_runs_at_the_next_poll(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """An operator interrupts a session whose wake runs in a worker process (``stalwart
    session interrupt``: the interrupt is appended from another process, nobody tells
    the worker), and the user sends the next message. The interrupt lowers the session's
    due row to now, so the worker claims the session at its next poll; but it saw that
    it still ran a wake of the session and did nothing more, at every poll, until its
    renewal of the old lease was fenced out (``renew_every_ms``, 10 s by default): the
    interrupted turn's model call ran on all that while, and the message waited. The
    claim's fold shows the later epoch: the old wake is stopped then, and the message
    leased at that poll."""
    config = runtime_config(fake.base_url, prompt_timeout_ms=600_000, activations=SLOW_RENEWAL)
    stream = "session:s1"
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        fake.add(Hang())
        rt.session("s1", channel="chat").send("a long job")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        interrupt(store, "s1", "wrong customer", ts=clock.now())  # as the CLI does
        send_message(store, "s1", "the right customer", ts=clock.now())
        started = clock.now()
        advance_until(clock, lambda: _leases(store, stream) == 2, config.activations.poll_ms / 1000)
        assert clock.now() - started <= 5.0, "the message waited for the old lease's renewal"
        records = log_until(store, stream, has(ActivationAcked))
        assert [m.text for m in delivered(rt, chat, 1)] == ["default answer"]
        assert [lease.epoch for lease in of(ActivationLeased, records)] == [1, 3]
        [lost] = of(ActivationLeaseLost, records)
        assert (lost.epoch, lost.current_epoch) == (1, 2)
        assert rt.worker().running == {}
