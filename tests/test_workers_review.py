"""Review of the workers, activations and scheduler: defects proven by failing tests.

Each test states what is wrong and what a user should be able to expect instead."""

from __future__ import annotations

from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    LeaseExpired,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, FakeProvider, FakeToolCall, Hang
from tests._runtime_support import (
    GUARD,
    crashed_mid_wake,
    delivered,
    has,
    log_until,
    of,
    runtime_config,
)


def test_a_wake_rescheduled_by_its_own_run_with_its_dedupe_key_is_not_lost(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A periodic check re-arms itself from inside its own wake ("check the order again
    in a minute", same ``dedupe_key``). ``decide_wake`` treats the wake that is running
    right now (leased, about to be acked) as *pending*, returns its id and appends
    nothing, so the next wake is silently lost: the ack of the running wake consumes it.
    A running wake is no longer pending: re-arming it must schedule a new wake that runs
    a minute later."""
    with Runtime(
        runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat}
    ) as rt:
        rearmed: list[str] = []

        @rt.tool
        def check_again_later() -> str:
            """Look at the order again in a minute."""
            at = clock.now() + 60
            rearmed.append(rt.wake_at("s1", at, "check the order", dedupe_key="order-7"))
            return "scheduled"

        rt.session("s1", channel="chat")
        first = rt.wake_at("s1", clock.now() + 60, "check the order", dedupe_key="order-7")
        call = FakeToolCall(name="check_again_later")
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="still pending"))
        clock.advance(60)
        delivered(rt, chat, 1)
        log_until(store, "session:s1", has(ActivationAcked))
        assert rearmed, "the tool never ran"
        assert rearmed[0] != first, (
            "re-arming the running wake returned the running wake's own id: nothing was "
            "scheduled for a minute later"
        )
        clock.advance(60)
        records = log_until(store, "session:s1", has(ActivationAcked, 2))
        assert len(of(ActivationReady, records)) == 2
        assert len(of(ActivationLeased, records)) == 2


def test_a_retry_runs_at_its_backoff_time_not_at_the_next_poll(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A wake whose Agent crashed is requeued with a 2 s backoff (``run_at`` = now + 2).
    With a work queue, the worker writes that time back to the due row after the wake
    ends (``_next_wake``) but never arms its own tick for it: the retry waits for the next
    periodic poll, here ``poll_ms`` = 10 s, so every backoff step (2, 4, 8, 16 s) is
    stretched to a multiple of ``poll_ms``. The docs promise retries after 2, 4, 8, 16,
    30 s and that work of this process is picked up at once: the retry must be leased
    when its backoff has passed."""
    config = runtime_config(fake.base_url, activations={"poll_ms": 10_000})
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        _, records = crashed_mid_wake(rt, fake, store)
        [requeued] = of(ActivationRequeued, records)
        assert requeued.run_at == clock.now() + 2.0
        assert rt.worker().running == {}  # the worker is done with the failed wake
        clock.advance(0.5)  # the supervisor restarts the Agent
        clock.advance(1.5)  # the retry is due
        records = log_until(store, "session:s1", has(ActivationLeased, 2))
        assert of(ActivationLeased, records)[1].epoch == 2


def test_a_clean_close_mid_wake_does_not_use_up_the_activations_attempts(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """``Runtime.close()`` (and ``stalwart worker`` on SIGTERM, "stops it cleanly") while
    a wake runs just stopped renewing: the lease was left to expire, the next runtime
    waited the whole ``lease_ttl_ms`` and then recorded ``lease:expired``, a *failure* of
    the user's message. Enough routine restarts during a long wake (here ``max_attempts``
    = 2, by default 5) abandoned the message and told the user it failed, though nothing
    failed. A clean stop hands its leases back (``activation:released``, no failure
    counted), so the next runtime runs the wake at once and answers the message."""
    config = runtime_config(fake.base_url, activations={"max_attempts": 2})
    for restart in range(2):  # two routine restarts, each while the wake is running
        fake.add(Hang())
        with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
            if restart == 0:
                rt.session("s1", channel="chat").send("a long job")
            # the next runtime leases the released wake at once: no clock advance
            fake.wait_for(lambda requests, n=restart + 1: len(requests) == n, GUARD)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        records = log_until(store, "session:s1", has((ActivationAcked, ActivationAbandoned)))
        assert [m.text for m in delivered(rt, chat, 1)] == ["default answer"]
    assert of(ActivationAbandoned, records) == [], "the message was given up after restarts"
    assert of(LeaseExpired, records) == [], "a clean close was recorded as an expired lease"
    released = of(ActivationReleased, records)
    leased = of(ActivationLeased, records)
    assert [r.epoch for r in released] == [1, 3]  # each release claims the next epoch
    assert [lease.epoch for lease in leased] == [1, 3, 5]
    assert len({lease.activation_id for lease in leased}) == 1
    report = verify_store(store, "session:s1")
    assert report.checked.get("activation:released") == 2
    assert report.clean, report.findings
