"""Races in how runtime parts hand their work on (session 35, third pass).

A dying part hands the mail it never handled to its successor, a failure notice's direct
send waits out a receiver's Retry-After on a timer, a turn's assembly outlives the
context engine's crash, and a batch's text is made again when the run that records it
cannot be read. Real parts only: an LMDB store in tmp_path, the fake provider over
loopback HTTP, MemoryChannels and a webhook receiver on 127.0.0.1, the runtime's own
actors crashed for real; a FakeClock drives the restarts and the holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import lmdb
import pykka
import pytest
import structlog
from structlog.testing import LogCapture

from stalwart.actors import ContextStoreActor, DeadLetterActor, Enqueue, RunReport
from stalwart.channels import MemoryChannel
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationRequeued,
    AnnouncementDeadLettered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementResent,
    SubagentCompleted,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore, NewEvent
from stalwart.store import open as open_store
from stalwart.testing import FakeProvider
from tests._runtime_support import (
    GUARD,
    crash_decided,
    delivered,
    has,
    log_until,
    of,
    only,
    runtime_config,
    until,
)
from tests._support_s35 import receiver_of, receivers_fixture  # noqa: F401 (the fixture)
from tests.test_channels import Receiver, Step, webhook
from tests.test_notice_hint_s35 import cut_short_batch, queued_completions, runs_stream, sent_again

Logs = list[MutableMapping[str, Any]]
#: the backoffs of a part's first two restarts (supervision's defaults), in seconds
BACKOFFS_S = (0.1, 0.2)


class LogHooks:
    """Run a hook when the library logs an event (on the thread that logs it, as it logs):
    a place to step in at a known point of another thread's work."""

    def __init__(self) -> None:
        self._hooks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self.capture = LogCapture()

    def once(self, event: str, hook: Callable[[], None]) -> None:
        with self._lock:
            self._hooks[event] = hook

    def pending(self, event: str) -> bool:
        """Whether the hook on ``event`` has not run yet."""
        with self._lock:
            return event in self._hooks

    def __call__(self, logger: Any, method: str, event_dict: Any) -> Any:
        with self._lock:
            hook = self._hooks.pop(event_dict.get("event"), None)
        if hook is not None:
            hook()
        return self.capture(logger, method, event_dict)


@pytest.fixture
def hooks() -> Iterator[LogHooks]:
    saved = structlog.get_config()
    structlog.reset_defaults()
    made = LogHooks()
    structlog.configure(processors=[made])
    try:
        yield made
    finally:
        structlog.configure(**saved)


def enqueue(announcement_id: str) -> Enqueue:
    return Enqueue(
        announcement_id=announcement_id,
        channel="chat",
        conversation="c1",
        text=f"answer {announcement_id}",
        reason="timeout",
    )


# -- item 1: the order of the mail a dying part hands on ----------------------------------------


# Was: DEFECT: an entry told while a dying dead-letter queue handed its mail on was queued
# before the older entries it handed on (two failed answers of one conversation reordered)
def test_a_tell_while_a_dying_queue_hands_its_mail_on_is_queued_after_that_mail(
    hooks: LogHooks,
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        assert isinstance(crash_decided(rt, store, DeadLetterActor, 1), SupervisorRestarted)
        assert rt._parts is not None
        queue = rt._parts.dead_letters_ref
        # held while the queue restarts: what kills the restarted one, then two entries
        for message in (object(), enqueue("a1"), enqueue("a2")):
            queue.tell(message)
        # a sender's tell lands while the dying queue hands a1 and a2 on
        handed_over = "deadletter.mail_handed_over"
        hooks.once(handed_over, lambda: queue.tell(enqueue("a3")))
        clock.advance(BACKOFFS_S[0] + 0.005)  # restarted: it dies of the first
        restarts = log_until(store, "runtime", has(SupervisorRestarted, 2))
        assert len(of(SupervisorRestarted, restarts)) == 2
        with rt._restarts_lock:  # the second restart is armed
            pass
        if hooks.pending(handed_over):  # it died before a1 and a2 were told: kept in order
            queue.tell(enqueue("a3"))
        clock.advance(BACKOFFS_S[1] + 0.005)  # the third queue takes them all

        records = log_until(store, "deadletter", has(AnnouncementDeadLettered, 3))
        queued = [entry.announcement_id for entry in of(AnnouncementDeadLettered, records)]
        assert queued == ["a1", "a2", "a3"]


# -- item 2: a notice's hold that ends late, in one process of two ------------------------------

#: what the receiver asks for with its 503 (s)
ASKED_S = 600
#: how far the other process's clock moves at a time while it waits to resend
STEP_S = 30


def hook_runtime(store: EventStore, clock: FakeClock, fake: FakeProvider, url: str) -> Runtime:
    """A runtime whose ``hook`` channel is a webhook to ``url``; a failed run is not tried
    again."""
    config = runtime_config(fake.base_url, subagents={"recovery_max_attempts": 1})
    return Runtime(config, store=store, clock=clock, channels={"hook": webhook(url)})


def failed_run(rt: Runtime) -> str:
    """Spawn a run of parent ``p1`` (on ``hook``) that fails: its stream."""

    async def work(report: RunReport) -> str:
        raise RuntimeError("the work broke")

    rt.session("p1", channel="hook")
    run = rt.spawn("p1", "find the answer", task_class="research", work=work)
    assert run.result(GUARD).outcome == "failed"
    return f"session:{run.run_id}"


def logged(logs: Logs, event: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry.get("event") == event]


# Was: DEFECT: a notice's hold that ended late in one process (its clock behind, or the
# process paused) sent the notice again while another process's resend was in flight
def test_a_hold_that_ends_after_another_process_resent_the_notice_sends_nothing(
    logs: Logs,
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    receivers: list[Receiver],
) -> None:
    retry_after = Step(status=503, headers={"retry-after": str(ASKED_S)})
    receiver = receiver_of(receivers, retry_after, Step(hang=True))  # then 200
    other_clock = FakeClock(start=clock.now())  # the other process's clock runs ahead
    with (
        hook_runtime(store, clock, fake, receiver.url) as held_here,
        hook_runtime(store, other_clock, fake, receiver.url) as other,
    ):
        stream = failed_run(held_here)  # its direct send held for 600 s (here)
        log_until(store, stream, has(AnnouncementFallbackDirect))
        assert len(receiver.requests) == 1

        # the other process resends once the hold and a send's time are over: in flight
        while not of(AnnouncementResent, list(store.read_stream(stream))):
            assert other_clock.now() < clock.now() + 2 * ASKED_S, "never resent"
            other_clock.advance(STEP_S)
            other.runs()
        until(lambda: len(receiver.requests) == 2, what="the resend reached the receiver")

        clock.advance(ASKED_S + 1)  # the hold here ends, late
        held_here.runs()
        until(
            lambda: len(receiver.requests) > 2 or logged(logs, "supervisor.notice_hold_ended"),
            what="the hold's end handled",
        )
        assert len(receiver.requests) == 2
        [ended] = logged(logs, "supervisor.notice_hold_ended")
        assert ended["sent"] is False


# -- item 3: an assembly waiting in the context engine's mailbox when it crashes ----------------


class Stuck:
    """A message the context engine does not understand (it dies of it), which holds the
    engine while it looks at it (its class is read as the engine matches it) until
    ``release`` is set: what comes after it waits in the engine's mailbox meanwhile."""

    def __init__(self) -> None:
        self.looked = threading.Event()
        self.release = threading.Event()

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # read by isinstance, as the engine matches it
        self.looked.set()
        self.release.wait(GUARD)
        return Stuck


# Was: DEFECT: a turn's assembly still waiting in the context engine's mailbox when the
# engine crashed got ActorDeadError: the turn failed as internal and was retried
def test_an_assembly_left_in_the_crashed_engines_mailbox_is_asked_of_the_restarted_one(
    logs: Logs,
    store: EventStore,
    clock: FakeClock,
    fake: FakeProvider,
    chat: MemoryChannel,
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("s1", channel="chat")
        engine = only(ContextStoreActor)
        stuck = Stuck()
        engine.tell(stuck)
        assert stuck.looked.wait(GUARD)
        session.send("hello")  # its turn asks the engine to assemble: behind the stuck one
        until(lambda: engine.actor_inbox.qsize() >= 1, what="the assembly asked")
        stuck.release.set()  # the engine dies of it, the assembly unhandled
        restarted = log_until(store, "runtime", has(SupervisorRestarted))
        assert [r.actor for r in of(SupervisorRestarted, restarted)] == ["context"]
        with rt._restarts_lock:  # the restart is armed
            pass

        def turn_waits_or_failed() -> bool:
            failed = of(ActivationRequeued, list(store.read_stream("session:s1")))
            return bool(logged(logs, "runtime.part_awaited") or failed)

        until(turn_waits_or_failed, what="the turn waited for the engine, or failed")
        assert not of(ActivationRequeued, list(store.read_stream("session:s1")))
        clock.advance(BACKOFFS_S[0] + 0.005)  # the engine's restart
        [answer] = delivered(rt, chat, 1)
        assert answer.text == "default answer"
        assert not of(ActivationRequeued, list(store.read_stream("session:s1")))
        assert rt.given_up() == {}


# -- item 4: a batch's text made again when its holder's record cannot be read -----------------


def damage(directory: Path, position: int) -> None:
    """Bit rot in the record at ``position`` (its store closed)."""
    env = lmdb.open(str(directory), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), b"\xc1garbage", db=env.open_db(b"log", txn=txn))
    finally:
        env.close()


def completed_result(store: EventStore, run_id: str) -> str:
    [completed] = of(SubagentCompleted, list(store.read_stream(f"session:{run_id}")))
    return str(completed.result)


# Was: DEFECT: a batch cut short whose text record could not be read was sent again without
# the result of the run that holds that record (only the runs still in play were in it)
def test_a_batch_sent_again_after_its_text_record_rotted_still_has_every_result(
    clock: FakeClock, fake: FakeProvider, tmp_path: Path
) -> None:
    directory = tmp_path / "second"
    with open_store(tmp_path / "first", clock=clock) as first:
        run_ids = cut_short_batch(first, clock, fake)
        results = {run_id: completed_result(first, run_id) for run_id in run_ids}
        queued = queued_completions(first, run_ids)
        [holder_run] = [r for r, q in zip(run_ids, queued, strict=True) if q.text_run is None]
        with open_store(directory, clock=clock) as second:
            for run_id in run_ids:
                copied = [NewEvent(event=r.event, ts=r.ts) for r in runs_stream(first, run_id)]
                second.append(f"session:{run_id}", copied, expected_version=0)
            [text_record] = [
                record
                for record in runs_stream(second, holder_run)
                if isinstance(record.event, AnnouncementQueued)
            ]
    damage(directory, text_record.position)  # the batch's text cannot be read any more

    with open_store(directory, clock=clock) as second:
        text = sent_again(second, clock, fake)

    assert all(results[run_id] in text for run_id in run_ids), "a run's result left out"
    # (the runs ended at one moment on the FakeClock: in which order is not asserted)
    assert text.startswith("3 sub-agent tasks completed:")


# Was: DEFECT: the crashed context engine never closed its inbox: an ask that passed pykka's
# is-alive check and was put after the engine's end sat unread for its whole timeout (90 s
# for an assembly) instead of being refused at once for the gate to ask the restarted one
def test_an_ask_put_into_the_crashed_engines_inbox_is_refused_at_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        engine = only(ContextStoreActor)
        assert isinstance(crash_decided(rt, store, ContextStoreActor, 1), SupervisorRestarted)
        until(lambda: not engine.is_alive(), what="the engine ended")
        late = pykka.ThreadingFuture[Any]()
        # what pykka's ask does once its is-alive check passed: the put, racing the end
        with contextlib.suppress(pykka.ActorDeadError):
            engine.actor_inbox.put(pykka._envelope.Envelope(object(), reply_to=late))
        with pytest.raises(pykka.ActorDeadError):
            late.get(timeout=GUARD)


# Was: DEFECT: a ctx_* tool's ask still in the crashed engine's mailbox failed the call with
# ActorDeadError (a tool error the model read) instead of being asked of the restarted one
def test_a_recall_tools_ask_left_in_the_crashed_engines_mailbox_is_answered_by_the_next(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    config = runtime_config(fake.base_url)
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("where is my refund?")
        delivered(rt, chat, 1)  # the session is in the engine's store
        assert rt._context is not None
        search = {tool.name: tool for tool in rt._context.tools("s1", None)}["ctx_search"]
        engine = only(ContextStoreActor)
        stuck = Stuck()
        engine.tell(stuck)
        assert stuck.looked.wait(GUARD)
        answers: list[object] = []

        def call() -> None:
            try:
                answers.append(search.fn(query="refund"))
            except Exception as exc:  # what the model would read as a tool error
                answers.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        until(lambda: engine.actor_inbox.qsize() >= 1, what="the search asked")
        stuck.release.set()  # the engine dies of it, the search unhandled
        log_until(store, "runtime", has(SupervisorRestarted))
        with rt._restarts_lock:  # the restart is armed
            pass
        clock.advance(BACKOFFS_S[0] + 0.005)  # the engine's restart
        caller.join(GUARD)
        [answer] = answers
        assert isinstance(answer, str), answer
        assert "refund" in answer, answer  # the restarted engine searched the session
