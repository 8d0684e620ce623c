"""A failure notice's direct send waits for the receiver's Retry-After; a batch's text is
written to the log once (session 35).

A sub-agent's failure notice goes through the announce path first and, when that send
fails, directly on the run's channel. In a runtime both sends go to the same receiver:
one that answered 503 with ``Retry-After: 600`` was asked again at once (and the notice
dead-lettered). And a batch of completions wrote its whole text into every run's stream.

Real parts only: an LMDB store in tmp_path, the fake provider over loopback HTTP, a real
webhook receiver on 127.0.0.1 that answers 503 with ``Retry-After: 600`` while it is busy
(by the FakeClock's time), the runtime's own actors; the log checked with
``replay --verify``'s own verification.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    RecordedEvent,
    SubagentCompleted,
)
from stalwart.runtime import Runtime
from stalwart.state import batch_text
from stalwart.store import EventStore, NewEvent
from stalwart.store import open as open_store
from stalwart.testing import FakeProvider
from tests._runtime_support import GUARD, delivered, has, log_until, of, runtime_config
from tests._support_s35 import (
    BusyUntil,
    busy_receiver,
    dead_letters,
    receivers_fixture,  # noqa: F401 (the fixture)
)
from tests.test_channels import Receiver, webhook

#: what the busy receiver asks for (s)
ASKED_S = 600
#: how far the test moves the clock at a time while the receiver is busy
STEP_S = 30
#: a run that fails once is not tried again (one notice, no second run)
ONE_ATTEMPT = {"subagents": {"recovery_max_attempts": 1}}


def hooked(store: EventStore, clock: FakeClock, fake: FakeProvider, url: str) -> Runtime:
    """A runtime whose ``hook`` channel is a webhook to the receiver at ``url``."""
    config = runtime_config(fake.base_url, **ONE_ATTEMPT)
    return Runtime(config, store=store, clock=clock, channels={"hook": webhook(url)})


def failed_run(rt: Runtime) -> str:
    """Spawn a run of parent ``p1`` (on ``hook``) that fails: its stream."""

    async def work(report: RunReport) -> str:
        raise RuntimeError("the work broke")

    rt.session("p1", channel="hook")
    run = rt.spawn("p1", "find the answer", task_class="research", work=work)
    assert run.result(GUARD).outcome == "failed"
    return f"session:{run.run_id}"


def step_to(rt: Runtime, clock: FakeClock, until: float, script: BusyUntil, asked: int) -> None:
    """Move the clock to ``until`` a step at a time, the supervisor's timers handled at each
    step (``rt.runs()`` asks it), and the receiver asked no more than ``asked`` times."""
    while clock.now() < until:
        clock.advance(min(STEP_S, until - clock.now()))
        rt.runs()
        assert len(script.asked_at) == asked, f"asked again at {script.asked_at}"


def assert_verifies(store: EventStore) -> None:
    assert verify_store(store, None).findings == ()


# Was: DEFECT: a failure notice whose announce send got 503 + Retry-After: 600 was sent
# directly to the same receiver at once (refused again, dead-lettered) instead of waiting
def test_a_notices_direct_send_waits_for_the_announce_sends_retry_after(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + ASKED_S, retry_after=str(ASKED_S))
    receiver = busy_receiver(receivers, script)
    with hooked(store, clock, fake, receiver.url) as rt:
        stream = failed_run(rt)
        fell_back = log_until(store, stream, has(AnnouncementFallbackDirect))
        [fallback] = of(AnnouncementFallbackDirect, fell_back)
        assert (fallback.error_class, fallback.retry_after_ms) == ("server_error", 600_000)

        step_to(rt, clock, start + ASKED_S - 1, script, asked=1)
        clock.advance(1)
        log_until(store, stream, has(AnnouncementDelivered))

        assert script.asked_at == [start, start + ASKED_S]
        [delivered] = of(AnnouncementDelivered, list(store.read_stream(stream)))
        assert delivered.path == "direct"
        assert not of(AnnouncementDeadLettered, dead_letters(store))
    assert_verifies(store)


# Was: DEFECT: a notice whose direct send was held for the receiver's Retry-After was sent
# again by the next runtime 35 s after its fallback, ignoring the hint
def test_a_notice_held_when_its_runtime_stops_is_sent_by_the_next_after_the_hold(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + ASKED_S, retry_after=str(ASKED_S))
    receiver = busy_receiver(receivers, script)
    with hooked(store, clock, fake, receiver.url) as rt:
        stream = failed_run(rt)
        log_until(store, stream, has(AnnouncementFallbackDirect))
        step_to(rt, clock, start + 60, script, asked=1)
    # the runtime stopped during the hold: the log says a direct send is owed
    with hooked(store, clock, fake, receiver.url) as rt:
        step_to(rt, clock, start + ASKED_S, script, asked=1)
        # the next runtime cannot tell whether the one before began the send at the
        # hold's end: it leaves it the send's time, then sends it again
        step_to(rt, clock, start + ASKED_S + 30, script, asked=1)
        clock.advance(STEP_S + 60)  # past the wait and the next sweep
        records = log_until(store, stream, has(AnnouncementDelivered))

        assert len(script.asked_at) == 2
        assert start + ASKED_S + 35 <= script.asked_at[1] <= start + ASKED_S + 125
        assert len(of(AnnouncementResent, records)) == 1
        assert not of(AnnouncementDeadLettered, dead_letters(store))
    assert_verifies(store)


def test_a_notice_refused_again_after_the_hold_is_dead_lettered_with_the_new_hint(
    store: EventStore, clock: FakeClock, fake: FakeProvider, receivers: list[Receiver]
) -> None:
    start = clock.now()
    script = BusyUntil(clock, start + 2 * ASKED_S, retry_after=str(ASKED_S))
    receiver = busy_receiver(receivers, script)
    with hooked(store, clock, fake, receiver.url) as rt:
        stream = failed_run(rt)
        log_until(store, stream, has(AnnouncementFallbackDirect))
        step_to(rt, clock, start + ASKED_S - 1, script, asked=1)
        clock.advance(1)  # the hold ends: the direct send, refused again
        failing = log_until(store, stream, has(AnnouncementSendFailed))
        [failed] = of(AnnouncementSendFailed, failing)
        assert failed.retry_after_ms == 600_000
        [entry] = of(AnnouncementDeadLettered, dead_letters(store))
        assert (entry.kind, entry.retry_after_ms) == ("failure_notice", 600_000)

        rt.dead_letters()  # the entry's timer is armed
        step_to(rt, clock, start + 2 * ASKED_S - 1, script, asked=2)
        clock.advance(1)  # retried as asked
        log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered))
        assert script.asked_at == [start, start + ASKED_S, start + 2 * ASKED_S]
    assert_verifies(store)


# -- a batch's text, once ------------------------------------------------------------------

#: how many runs finish together, and how long each one's result is
RUNS = 12
RESULT_CHARS = 2_000
#: past the announcer's debounce (0.5 s): the batch is due
DEBOUNCE_S = 1.0
#: after a batch's send is cut short, past the supervisor's wait for its outcome (the
#: announcer's max wait and the send's timeout, 5 + 30 s) and its next sweep (60 s)
RESEND_AFTER_S = 100.0


def chat_runtime(store: EventStore, clock: FakeClock, fake: FakeProvider, chat: Any) -> Runtime:
    return Runtime(runtime_config(fake.base_url), store=store, clock=clock, channels={"chat": chat})


def finished_together(rt: Runtime, count: int) -> list[str]:
    """Spawn ``count`` runs of parent ``p1`` (on ``chat``) that succeed at the same moment,
    each with a result of its own: their run ids, in the order they were spawned."""
    rt.session("p1", channel="chat")
    handles = []
    for index in range(count):
        result = f"result {index}: " + "x" * RESULT_CHARS

        async def work(report: RunReport, result: str = result) -> str:
            return result

        handles.append(rt.spawn("p1", f"task {index}", task_class="research", work=work))
    for handle in handles:
        assert handle.result(GUARD).outcome == "succeeded"
    return [handle.run_id for handle in handles]


def queued_completions(store: EventStore, run_ids: list[str]) -> list[AnnouncementQueued]:
    return [
        queued
        for run_id in run_ids
        for queued in of(AnnouncementQueued, list(store.read_stream(f"session:{run_id}")))
        if queued.kind == "completion"
    ]


# Was: DEFECT: N runs finishing together wrote the whole batch's text into each of their
# streams: N x (batch text) in the log (100 runs of 20 KB: 200 MB instead of 2 MB)
def test_a_batch_of_completions_records_its_text_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    chat = MemoryChannel("chat")
    with chat_runtime(store, clock, fake, chat) as rt:
        run_ids = finished_together(rt, RUNS)
        clock.advance(DEBOUNCE_S)
        [message] = delivered(rt, chat, 1)
        for run_id in run_ids:
            log_until(store, f"session:{run_id}", has(AnnouncementDelivered))

    queued = queued_completions(store, run_ids)
    assert len(queued) == RUNS
    assert len({q.announcement_id for q in queued}) == 1
    [holder] = [q for q in queued if q.text_run is None]
    assert holder.text == message.text
    [holder_run] = [r for r, q in zip(run_ids, queued, strict=True) if q is holder]
    assert all(q.text_run == holder_run for q in queued if q is not holder)
    assert sum(len(q.text) for q in queued) == len(message.text)
    assert all(f"result {index}: " in message.text for index in range(RUNS))
    assert_verifies(store)


def cut_short_batch(store: EventStore, clock: FakeClock, fake: FakeProvider) -> list[str]:
    """A batch whose send hangs until its runtime closes (the close cuts it): the runs."""
    chat = MemoryChannel("chat")
    chat.hang_next()
    with chat_runtime(store, clock, fake, chat) as rt:
        run_ids = finished_together(rt, 3)
        clock.advance(DEBOUNCE_S)
        delivered(rt, chat, 1, attempted=True)
    for run_id in run_ids:
        records = list(store.read_stream(f"session:{run_id}"))
        assert not of(AnnouncementDelivered, records), "the send was not cut short"
    return run_ids


def sent_again(store: EventStore, clock: FakeClock, fake: FakeProvider) -> str:
    """What the next runtime's supervisor sends for a batch cut short (directly)."""
    chat = MemoryChannel("chat")
    with chat_runtime(store, clock, fake, chat) as rt:
        rt.runs()  # its first sweep: the batch's outcome is not owed yet
        clock.advance(RESEND_AFTER_S)
        [message] = delivered(rt, chat, 1)
        rt.runs()
        return message.text


def test_a_batch_cut_short_is_sent_again_whole_from_the_run_that_records_its_text(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    run_ids = cut_short_batch(store, clock, fake)
    [holder] = [q for q in queued_completions(store, run_ids) if q.text_run is None]

    text = sent_again(store, clock, fake)

    assert text == holder.text
    assert all(f"result {index}: " in text for index in range(3))
    assert_verifies(store)


def test_a_batch_cut_short_in_an_older_log_with_its_text_in_every_run_is_sent_again_whole(
    store: EventStore, clock: FakeClock, fake: FakeProvider, tmp_path: Path
) -> None:
    with open_store(tmp_path / "first", clock=clock) as first:
        run_ids = cut_short_batch(first, clock, fake)
        [holder] = [q for q in queued_completions(first, run_ids) if q.text_run is None]
        for run_id in reversed(run_ids):  # the runs in another order than the batch's
            older = [_as_older(record, holder.text) for record in runs_stream(first, run_id)]
            store.append(f"session:{run_id}", older, expected_version=0)
    assert all(q.text == holder.text for q in queued_completions(store, run_ids))

    assert sent_again(store, clock, fake) == holder.text
    assert_verifies(store)


def runs_stream(store: EventStore, run_id: str) -> list[RecordedEvent]:
    return list(store.read_stream(f"session:{run_id}"))


def _as_older(record: RecordedEvent, text: str) -> NewEvent:
    """The record as a log written before a batch's text was recorded once holds it."""
    event = record.event
    if isinstance(event, AnnouncementQueued) and event.kind == "completion":
        event = msgspec.structs.replace(event, text=text, text_run=None)
    return NewEvent(event=event, ts=record.ts)


def test_a_batch_cut_short_whose_text_run_is_not_in_the_log_is_sent_again_from_results(
    store: EventStore, clock: FakeClock, fake: FakeProvider, tmp_path: Path
) -> None:
    with open_store(tmp_path / "first", clock=clock) as first:
        run_ids = cut_short_batch(first, clock, fake)
        queued = queued_completions(first, run_ids)
        [holder_run] = [r for r, q in zip(run_ids, queued, strict=True) if q.text_run is None]
        others = sorted(run_id for run_id in run_ids if run_id != holder_run)
        for run_id in others:  # the stream that records the text is lost
            copied = [NewEvent(event=r.event, ts=r.ts) for r in runs_stream(first, run_id)]
            store.append(f"session:{run_id}", copied, expected_version=0)
        results = {run_id: _result(first, run_id) for run_id in others}

    text = sent_again(store, clock, fake)

    assert text == batch_text(tuple((run_id, results[run_id]) for run_id in others))


def _result(store: EventStore, run_id: str) -> str:
    [completed] = of(SubagentCompleted, runs_stream(store, run_id))
    return completed.result
