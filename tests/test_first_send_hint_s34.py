"""A first send's Retry-After reaching the dead-letter entry (session 34).

The dead-letter queue waits for a receiver's Retry-After recorded with a failure; but an
announcement's first send (the Agent's reply, the supervisor's notices, the announcer's
batch, a give-up notice) did not note it: its ``announcement:send_failed`` and the
queue's entry had no hint, and the first retry went 30 s later to a receiver that had
asked for ten minutes.

Real parts only: an LMDB store in tmp_path, the fake provider over loopback HTTP, a real
webhook receiver on 127.0.0.1 that answers 503 with ``Retry-After: 600`` while it is busy
(by the FakeClock's time), the runtime's own actors; the log checked with
``replay --verify``'s own verification.
"""

from __future__ import annotations

from typing import Any

from stalwart.actors import GAVE_UP_TEXT, RunReport
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    AnnouncementFallbackDirect,
    AnnouncementSendFailed,
    SupervisorGaveUp,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, has, log_until, of, runtime_config
from tests._support_s35 import (
    BusyUntil,
    busy_receiver,
    dead_letters,
    receivers_fixture,  # noqa: F401 (the fixture)
)
from tests.test_channels import Receiver, webhook

#: what the busy receiver asks for (s): far past the queue's first backoff (30 s)
ASKED_S = 600
#: how far the test moves the clock at a time while the receiver is busy: a retry on the
#: queue's own backoff (30 s) would go at the first step
STEP_S = 30


def hooked_runtime(
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    receivers: list[Receiver],
    script: BusyUntil,
    **sections: Any,
) -> Runtime:
    """A runtime whose ``hook`` channel is a webhook to a receiver that follows ``script``."""
    hook = webhook(busy_receiver(receivers, script).url)
    config = runtime_config(fake.base_url, **sections)
    return Runtime(config, store=store, clock=clock, channels={"hook": hook})


def wait_out_the_receiver(rt: Runtime, store: EventStore, clock: FakeClock, start: float) -> None:
    """Move the clock to the receiver's time a step at a time, each step's retries (if
    any: they are appended before they are sent) decided before the next; the entry is
    delivered at the last step."""
    rt.dead_letters()  # the entry's timer is armed
    while clock.now() < start + ASKED_S - STEP_S:
        clock.advance(STEP_S)
        rt.dead_letters()  # the timers that fired are told and handled
        assert not of(AnnouncementDeadLetterRetried, dead_letters(store)), "retried early"
    clock.advance(start + ASKED_S - clock.now())
    log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered))


def queued_with_the_hint(
    store: EventStore, failed_on: str
) -> tuple[AnnouncementSendFailed, AnnouncementDeadLettered]:
    """The first send's failure (recorded in ``failed_on``) and the dead-letter entry it
    queued, once both are in the log: each with the receiver's hint."""
    queued = log_until(store, "deadletter", has(AnnouncementDeadLettered))
    [entry] = of(AnnouncementDeadLettered, queued)
    assert entry.retry_after_ms == 600_000
    failing = log_until(store, failed_on, has(AnnouncementSendFailed))
    [failed] = of(AnnouncementSendFailed, failing)
    assert (failed.error_class, failed.retry_after_ms) == ("server_error", 600_000)
    return failed, entry


def assert_verifies(store: EventStore) -> None:
    assert verify_store(store, None).findings == ()


# Was: DEFECT: the Agent's reply refused with 503 + Retry-After: 600 was queued without the
# hint, and the dead-letter queue sent it again 30 s later (refused again) instead of waiting
def test_an_agents_reply_refused_with_a_retry_after_is_queued_with_it_and_waits(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + ASKED_S, retry_after=str(ASKED_S))
    with hooked_runtime(store, clock, fake, receivers, script) as rt:
        rt.session("s1", channel="hook").send("hello")
        failed, entry = queued_with_the_hint(store, "session:s1")
        assert entry.announcement_id == failed.announcement_id

        wait_out_the_receiver(rt, store, clock, start)

        assert script.asked_at == [start, start + ASKED_S]
        [delivered] = of(AnnouncementDeadLetterDelivered, dead_letters(store))
        assert (delivered.entry_id, delivered.attempts) == (entry.entry_id, 1)
    assert_verifies(store)


# Was: DEFECT: a give-up notice refused with 503 + Retry-After: 600 was queued without the
# hint, and the dead-letter queue sent it again 30 s later (refused again) instead of waiting
def test_a_give_up_notice_refused_with_a_retry_after_is_queued_with_it_and_waits(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + ASKED_S, retry_after=str(ASKED_S))
    given_up_at_once = {"supervision": {"max_restarts": 0}}
    with hooked_runtime(store, clock, fake, receivers, script, **given_up_at_once) as rt:
        session = rt.session("s1", channel="hook")
        session.ref.tell(object())  # not understood: it crashes, and is given up on
        _, entry = queued_with_the_hint(store, "runtime")
        [gave_up] = of(SupervisorGaveUp, list(store.read_stream("runtime")))
        assert gave_up.session == "s1"
        assert (entry.text, entry.kind) == (GAVE_UP_TEXT, "failure_notice")

        wait_out_the_receiver(rt, store, clock, start)

        assert script.asked_at == [start, start + ASKED_S]
    assert_verifies(store)


# Was: DEFECT: a sub-agent's completion refused with 503 + Retry-After: 600 was queued
# without the hint, and the dead-letter queue sent it again 30 s later instead of waiting
def test_a_completion_refused_with_a_retry_after_is_queued_with_it_and_waits(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    async def work(report: RunReport) -> str:
        return "the answer"

    start = clock.now()
    debounce_s = 1.0  # past the announcer's debounce: the batch is sent at start + 1
    script = BusyUntil(clock, start + debounce_s + ASKED_S, retry_after=str(ASKED_S))
    with hooked_runtime(store, clock, fake, receivers, script) as rt:
        rt.session("p1", channel="hook")
        run = rt.spawn("p1", "find the answer", task_class="research", work=work)
        assert run.result(GUARD).outcome == "succeeded"
        clock.advance(debounce_s)
        _, entry = queued_with_the_hint(store, f"session:{run.run_id}")
        assert entry.text == "Sub-agent task completed:\nthe answer"

        wait_out_the_receiver(rt, store, clock, start + debounce_s)

        assert script.asked_at == [start + debounce_s, start + debounce_s + ASKED_S]
    assert_verifies(store)


# Was: DEFECT: a sub-agent's failure notice refused with 503 + Retry-After: 600 was queued
# without the hint, and the dead-letter queue sent it again 30 s later instead of waiting
def test_a_failure_notice_refused_with_a_retry_after_is_queued_with_it_and_waits(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    async def work(report: RunReport) -> str:
        raise RuntimeError("the work broke")

    start = clock.now()
    script = BusyUntil(clock, start + 2 * ASKED_S, retry_after=str(ASKED_S))
    no_second_attempt = {"subagents": {"recovery_max_attempts": 1}}
    with hooked_runtime(store, clock, fake, receivers, script, **no_second_attempt) as rt:
        rt.session("p1", channel="hook")
        run = rt.spawn("p1", "find the answer", task_class="research", work=work)
        assert run.result(GUARD).outcome == "failed"
        log_until(store, f"session:{run.run_id}", has(AnnouncementFallbackDirect))
        clock.advance(ASKED_S)  # the direct send waits for the announce send's hint
        _, entry = queued_with_the_hint(store, f"session:{run.run_id}")
        assert entry.kind == "failure_notice"

        wait_out_the_receiver(rt, store, clock, start + ASKED_S)

        # the announce path's send, its direct fallback and the retry: each as asked
        assert script.asked_at == [start, start + ASKED_S, start + 2 * ASKED_S]
    assert_verifies(store)
