"""The dead-letter queue under random interleavings, against a real LMDB store.

A hypothesis state machine plays what happens around the queue: senders queue replies and
failure notices of several conversations on two webhook channels (some with the
receiver's Retry-After from their own first send, some refused for good), the receivers
answer 200, 503, 503 with a Retry-After or 401 as the machine sets them, the clock moves
(from one deadline to the next, or in one jump), a provider is degraded and recovers
(the queues drain), a queue is stopped and another started on the same store (a restart,
the same runtime or a new one), and two runtimes' queues run on the store at once.

After every step, once every send ended and its outcome is recorded, the log and the
receivers' requests must say: an announcement is delivered at most once (the receivers'
2xx by idempotency key, one per delivery the log records); within a conversation the
entries are delivered in the order they were queued; no request reaches a receiver
before the Retry-After it gave for that entry has passed; no entry is retried, nor sent,
after it is recorded delivered or expired. At the end, past the max age, every entry is
delivered or expired and ``replay --verify`` finds nothing in the ``deadletter`` stream.

Real parts only: an LMDB store in a temp dir, real webhook receivers on 127.0.0.1
(tests/test_channels.py's), the DeadLetterActors, a real Scheduler and IoPortal; time
from a FakeClock.

The suite runs a short version (15 examples of 25 steps, derandomized, about 3 s). To
run it longer, as the review did, set the counts, draw new examples and lift pytest's
timeout; ``-s`` prints how often each case came up::

    STALWART_MACHINE_RANDOM=1 STALWART_MACHINE_EXAMPLES=1000 STALWART_MACHINE_STEPS=30 \
        python -m pytest -n 0 -q -s --timeout=0 --hypothesis-seed=11 \
        tests/test_deadletter_machine_s35.py -k test_deadletter_machine

The review's runs (2,000 examples of 30 steps, 300 of 30, 200 of 80) found one defect,
fixed (the tests after the machine): a queue took in what another runtime appended only
when it appended itself, so an entry queued by a runtime that then stopped for good was
never retried nor expired by the queue still running.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pykka
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from stalwart import store as store_module
from stalwart.actors import (
    DeadLetterActor,
    Drain,
    Enqueue,
    InFlight,
    IoPortal,
    QueueState,
    Scheduler,
)
from stalwart.channels import Channel
from stalwart.clock import FakeClock
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    ProviderDegraded,
    ProviderRecovered,
    RecordedEvent,
)
from stalwart.state import DEADLETTER, DeadLetterState
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, of
from tests._support_s35 import (
    DEAD_LETTERS,
    SEND_WAIT_S,
    assert_dead_letters_verify,
    dead_letters,
    receiver_of,
    receivers_fixture,  # noqa: F401 (the fixture)
    start_queue,
    step_queues,
)
from tests.test_channels import Received, Receiver, Step, webhook

D = DEAD_LETTERS
START = 1_800_000_000.0
CHANNELS = ("hook-a", "hook-b")
CONVERSATIONS = ("c1", "c2")
SLOTS = ("a", "b")
PROVIDER = "main"
#: what a receiver may ask for (s): all above the webhook's own 2 s cap, so its send stops
#: at once and leaves the wait to the queue; the last one runs past the max age
RETRY_AFTERS = (45, 300, 1_800, 7_200)
#: what a receiver answers (see :class:`Script`): mostly 200
MODES = ("ok", "ok", "down", "busy", "refuse")
#: what the clock moves by (s): below, at and past the backoffs, and past the max age
ADVANCES = (1.0, 29.0, 30.0, 61.0, 200.0, 900.0, 1_800.0, D.max_age_ms / 1000 + 1)

#: how often each interesting case came up (``-s`` prints them after a long run)
SEEN: Counter[str] = Counter()


def note(what: str) -> None:
    SEEN[what] += 1


# -- the receivers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One request a receiver got: whose (idempotency key), where, when (FakeClock), and
    what it answered."""

    key: str
    conversation: str
    at: float
    status: int
    retry_after_s: int | None


@dataclass
class Script:
    """A receiver's answers by the mode the machine set (``ok`` 200, ``down`` 503,
    ``busy`` 503 with ``Retry-After``, ``refuse`` 401), recording every request. It
    stands in for both the :class:`Receiver`'s ``requests`` and ``steps``: the handler
    appends the request, then pops the answer decided for it (on the same thread)."""

    clock: FakeClock
    mode: str = "ok"
    retry_after_s: int = RETRY_AFTERS[0]
    answers: list[Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _step: threading.local = field(default_factory=threading.local)

    def __bool__(self) -> bool:
        return True

    def append(self, received: Received) -> None:
        body = json.loads(received.body)
        hint = self.retry_after_s if self.mode == "busy" else None
        status = {"ok": 200, "down": 503, "busy": 503, "refuse": 401}[self.mode]
        headers = {} if hint is None else {"retry-after": str(hint)}
        with self._lock:
            at = self.clock.now()
            self.answers.append(
                Answer(body["idempotency_key"], body["conversation"], at, status, hint)
            )
        self._step.value = Step(status=status, headers=headers)

    def popleft(self) -> Step:
        step: Step = self._step.value
        return step

    def seen(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)


# -- the machine -------------------------------------------------------------------------------


@dataclass
class Queued:
    """An announcement the machine queued: its place among all queued, its route, and
    the earliest a receiver may be sent it (its sender's Retry-After)."""

    seq: int
    route: tuple[str, str]
    entry_id: str
    not_before: float


class DeadLetterMachine(RuleBasedStateMachine):
    """Queues on one store, senders, receivers, a provider and the clock (see the module)."""

    portal: ClassVar[IoPortal]
    receivers: ClassVar[dict[str, Receiver]]
    channels: ClassVar[dict[str, Channel]]

    @staticmethod
    def new_location() -> str:
        raise NotImplementedError  # the fixture's subclass gives a fresh directory

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(start=START)
        self.scheduler = Scheduler(self.clock).start()
        self.location = self.new_location()
        self.store: EventStore = store_module.open(self.location, clock=self.clock)
        self.scripts = {name: Script(self.clock) for name in CHANNELS}
        for name, receiver in self.receivers.items():
            receiver.requests = self.scripts[name]  # type: ignore[assignment]
            receiver.steps = self.scripts[name]  # type: ignore[assignment]
        self.generation = itertools.count(1)
        self.queues: dict[str, tuple[str, pykka.ActorRef[Any]]] = {}
        self.degraded = False
        self.queued: dict[str, Queued] = {}
        self.numbers = itertools.count(1)
        #: the requests a receiver had got for an announcement when its entry ended
        self.sent_when_ended: dict[str, int] = {}
        self.start_queue("a")

    # -- parts ---------------------------------------------------------------------------

    def start_queue(self, slot: str, runtime: str | None = None) -> None:
        runtime = runtime or f"rt-{slot}.{next(self.generation)}"
        ref = DeadLetterActor.start(
            store=self.store,
            clock=self.clock,
            scheduler=self.scheduler,
            portal=self.portal,
            channels=self.channels,
            settings=D,
            runtime=runtime,
            any_degraded=lambda: self.degraded,
        )
        self.queues[slot] = (runtime, ref)
        self.settle()

    def stop_queue(self, slot: str) -> str:
        runtime, ref = self.queues.pop(slot)
        ref.stop(block=True, timeout=GUARD)
        return runtime

    def refs(self) -> list[pykka.ActorRef[Any]]:
        return [ref for _, ref in self.queues.values()]

    def settle(self) -> None:
        """Wait until no send of any queue is in flight, every outcome is recorded, every
        queue took in what the others appended and no timer is overdue, twice in a row (a
        timer armed in the past fires on a thread)."""
        give_up = time.monotonic() + SEND_WAIT_S
        calm = 0
        while calm < 2:
            assert time.monotonic() < give_up, "the queues never settled"
            busy = [ref for ref in self.refs() if ref.ask(InFlight(), timeout=GUARD)]
            due = self.scheduler.next_deadline()
            overdue = due is not None and due <= self.clock.now()
            # behind the outcomes' own message
            states = [ref.ask(QueueState(), timeout=GUARD) for ref in self.refs()]
            head = self.store.stream_version("deadletter")
            behind = [s for s in states if s.version != head]
            if busy or overdue or behind:
                calm = 0
                time.sleep(0.002)  # real-time: sends run on the portal's loop
                continue
            calm += 1

    def records(self) -> list[RecordedEvent]:
        return list(self.store.read_stream("deadletter"))

    def fold(self) -> DeadLetterState:
        folder = DEADLETTER.folder(DEADLETTER.initial("deadletter"))
        for record in self.records():
            folder.add(record)
        return folder.state()

    def queued_now(self) -> list[str]:
        """The announcements whose entries the log holds queued with retries left."""
        entries = self.fold().entries
        return sorted(
            e.announcement_id for e in entries if e.attempts < D.max_retries and not e.refused
        )

    # -- senders -------------------------------------------------------------------------

    @rule(
        channel=st.sampled_from(CHANNELS),
        conversation=st.sampled_from(CONVERSATIONS),
        kind=st.sampled_from(("reply", "failure_notice")),
        reason=st.sampled_from(("timeout", "server_error", "server_error", "rejected:final")),
        hint=st.sampled_from((None, None, 45_000, 1_800_000)),
        via=st.sampled_from(SLOTS),
    )
    def enqueue(
        self, channel: str, conversation: str, kind: str, reason: str, hint: int | None, via: str
    ) -> None:
        """A sender's first send failed: it queues the announcement (with the receiver's
        Retry-After when it gave one) through its runtime's queue."""
        _, ref = self.queues.get(via) or next(iter(self.queues.values()))
        number = next(self.numbers)
        announcement = f"ann-{number}"
        hint = hint if reason == "server_error" else None
        message = Enqueue(
            announcement,
            channel,
            conversation,
            f"text {number}",
            reason,
            kind=kind,  # type: ignore[arg-type]
            retry_after_ms=hint,
        )
        entry_id = ref.ask(message, timeout=GUARD)
        not_before = self.clock.now() + (hint or 0) / 1000
        self.queued[announcement] = Queued(number, (channel, conversation), entry_id, not_before)
        note(f"queued {reason}" + (" with a hint" if hint else ""))
        self.settle()

    @precondition(lambda self: self.queued_now())
    @rule(data=st.data(), via=st.sampled_from(SLOTS))
    def enqueue_again(self, data: st.DataObject, via: str) -> None:
        """A sender tells the queue again (after a store error): the entry queued stands."""
        announcement = data.draw(st.sampled_from(self.queued_now()))
        _, ref = self.queues.get(via) or next(iter(self.queues.values()))
        queued = self.queued[announcement]
        channel, conversation = queued.route
        message = Enqueue(announcement, channel, conversation, "again", "timeout")
        assert ref.ask(message, timeout=GUARD) == queued.entry_id
        note("told again")
        self.settle()

    # -- receivers -----------------------------------------------------------------------

    @rule(
        channel=st.sampled_from(CHANNELS),
        mode=st.sampled_from(MODES),
        retry_after_s=st.sampled_from(RETRY_AFTERS),
    )
    def receiver_answers(self, channel: str, mode: str, retry_after_s: int) -> None:
        script = self.scripts[channel]
        script.mode = mode
        script.retry_after_s = retry_after_s

    @rule(
        modes=st.tuples(*(st.sampled_from(MODES) for _ in CHANNELS)),
        retry_after_s=st.sampled_from(RETRY_AFTERS),
    )
    def receivers_answer(self, modes: tuple[str, ...], retry_after_s: int) -> None:
        """Both receivers change what they answer (a rule of its own: the answers change
        as often as the clock moves)."""
        for channel, mode in zip(CHANNELS, modes, strict=True):
            self.receiver_answers(channel, mode, retry_after_s)

    # -- time and health -----------------------------------------------------------------

    @rule(seconds=st.sampled_from(ADVANCES), stepwise=st.booleans())
    def advance(self, seconds: float, stepwise: bool) -> None:
        """Move the clock on: from one deadline to the next (each send ended and recorded
        before the next), or in one jump (the timers fire late, at the new time)."""
        target = self.clock.now() + seconds
        while stepwise:
            self.settle()
            due = self.scheduler.next_deadline()
            if due is None or due > target:
                break
            self.clock.advance(max(0.0, due - self.clock.now()))
        self.clock.advance(max(0.0, target - self.clock.now()))
        self.settle()

    @rule()
    def next_deadline(self) -> None:
        """Move the clock to the queues' next deadline, exactly."""
        due = self.scheduler.next_deadline()
        if due is not None:
            self.clock.advance(max(0.0, due - self.clock.now()))
        self.settle()

    @precondition(lambda self: not self.degraded)
    @rule()
    def degrade(self) -> None:
        self.provider(ProviderDegraded(provider=PROVIDER, rule="consecutive", failures=3))
        self.degraded = True
        note("degraded")

    @precondition(lambda self: self.degraded)
    @rule(drained=st.sampled_from(SLOTS))
    def recover(self, drained: str) -> None:
        """The provider recovers: every runtime's health listener tells its queue to
        drain (all at once), or (``drained`` not running) only the first's does."""
        self.provider(ProviderRecovered(provider=PROVIDER))
        self.degraded = False
        refs = self.refs() if drained in self.queues else self.refs()[:1]
        for ref in refs:
            ref.tell(Drain(PROVIDER))
        note(f"drained by {len(refs)}")
        self.settle()

    def provider(self, event: ProviderDegraded | ProviderRecovered) -> None:
        stream = f"provider:{PROVIDER}"
        self.store.append(stream, [NewEvent(event=event, ts=self.clock.now())])

    # -- runtimes ------------------------------------------------------------------------

    @rule(slot=st.sampled_from(SLOTS), same_runtime=st.booleans(), now=st.integers(0, 1))
    def restart(self, slot: str, same_runtime: bool, now: int) -> None:
        """The queue stops and another starts on the store: the runtime's supervisor
        restarting it (the same runtime), or the next process (a new one)."""
        if now or slot not in self.queues:  # seldom
            return
        runtime = self.stop_queue(slot)
        self.start_queue(slot, runtime if same_runtime else None)
        note("restarted")

    @precondition(lambda self: len(self.queues) < len(SLOTS))
    @rule()
    def start_second(self) -> None:
        """A second runtime starts on the store."""
        slot = next(s for s in SLOTS if s not in self.queues)
        self.start_queue(slot)
        note("two runtimes")

    @precondition(lambda self: len(self.queues) > 1)
    @rule(slot=st.sampled_from(SLOTS))
    def stop_one(self, slot: str) -> None:
        """One of two runtimes stops for good; the other goes on."""
        self.stop_queue(slot)
        note("one runtime stopped")

    # -- what the log and the receivers must say -----------------------------------------

    @invariant()
    def delivered_once_in_order_and_when_asked(self) -> None:
        records = self.records()
        walk_log(records)
        delivered = Counter(
            self.announcement_of(r.event.entry_id, records)
            for r in records
            if isinstance(r.event, AnnouncementDeadLetterDelivered)
        )
        for name, script in self.scripts.items():
            answers = script.seen()
            accepted = Counter(a.key for a in answers if a.status == 200)
            for key, count in accepted.items():
                assert count == 1, f"{key} delivered {count} times to {name}"
                assert delivered[key] == 1, (
                    f"{key} accepted by {name}, the log says {delivered[key]}"
                )
            self.check_order(name, answers)
            self.check_waits(answers)
        ended = self.ended(records)
        for key in ended:
            sent = sum(1 for s in self.scripts.values() for a in s.seen() if a.key == key)
            before = self.sent_when_ended.setdefault(key, sent)
            assert sent == before, f"{key} sent after its entry was recorded delivered or expired"

    def announcement_of(self, entry_id: str, records: list[RecordedEvent]) -> str:
        for record in records:
            event = record.event
            if isinstance(event, AnnouncementDeadLettered) and event.entry_id == entry_id:
                return event.announcement_id
        raise AssertionError(f"{entry_id} delivered but never queued")

    def check_order(self, channel: str, answers: list[Answer]) -> None:
        """The 2xx of each conversation come in the order its entries were queued."""
        last: dict[str, int] = {}
        for answer in answers:
            if answer.status != 200:
                continue
            seq = self.queued[answer.key].seq
            assert seq > last.get(answer.conversation, 0), (
                f"{answer.key} delivered to {channel}/{answer.conversation} after a later one"
            )
            last[answer.conversation] = seq

    def check_waits(self, answers: list[Answer]) -> None:
        """No request for an announcement before the Retry-After it was given ran out."""
        not_before = {key: q.not_before for key, q in self.queued.items()}
        for answer in answers:
            assert answer.at >= not_before[answer.key], (
                f"{answer.key} sent at {answer.at - START:.0f} s, "
                f"asked to wait until {not_before[answer.key] - START:.0f} s"
            )
            if answer.retry_after_s is not None:
                until = answer.at + answer.retry_after_s
                not_before[answer.key] = max(not_before[answer.key], until)

    def ended(self, records: list[RecordedEvent]) -> set[str]:
        """The announcements whose entries were recorded delivered or expired."""
        ids = {
            r.event.entry_id
            for r in records
            if isinstance(r.event, AnnouncementDeadLetterDelivered | AnnouncementDeadLetterExpired)
        }
        return {key for key, q in self.queued.items() if q.entry_id in ids}

    def teardown(self) -> None:
        try:
            self.finish()
        finally:
            for slot in list(self.queues):
                self.stop_queue(slot)
            self.scheduler.stop()
            self.store.close()
            shutil.rmtree(self.location, ignore_errors=True)

    def finish(self) -> None:
        """Past the max age (the provider healthy or not), every entry is delivered or
        expired, and replay re-derives every decision."""
        self.advance(D.max_age_ms / 1000 + 1, stepwise=False)
        self.delivered_once_in_order_and_when_asked()
        left = self.fold().entries
        assert left == (), f"left in the queue past the max age: {[e.entry_id for e in left]}"
        for _, ref in self.queues.values():
            state = ref.ask(QueueState(), timeout=GUARD)
            assert state.entries == (), "a queue still holds an entry the log ended"
        assert_dead_letters_verify(self.store)
        for record in self.records():
            note(outcome_of(record))


def outcome_of(record: RecordedEvent) -> str:
    """What a record of the stream was, for the counts ``-s`` prints."""
    event = record.event
    match event:
        case AnnouncementDeadLetterExpired():
            return f"expired {event.reason}"
        case AnnouncementDeadLetterRetried():
            return f"retried by {event.reason}"
        case AnnouncementSendFailed() if event.retry_after_ms is not None:
            return "failed with a hint"
        case AnnouncementSendFailed():
            return f"failed {event.error_class}"
        case _:
            return type(event).__struct_config__.tag or type(event).__name__


def walk_log(records: list[RecordedEvent]) -> None:
    """Each entry queued once, ended once; no retry, nor its outcome, of an entry that
    ended; no more attempts than allowed."""
    queued: dict[str, int] = {}  # attempts
    ended: set[str] = set()
    for record in records:
        event = record.event
        where = f"at version {record.version}"
        match event:
            case AnnouncementDeadLettered():
                assert event.entry_id not in queued, f"{event.entry_id} queued twice {where}"
                queued[event.entry_id] = 0
            case AnnouncementDeadLetterRetried():
                assert event.entry_id not in ended, (
                    f"{event.entry_id} retried after it ended {where}"
                )
                assert event.attempt == queued[event.entry_id] + 1, f"attempt skipped {where}"
                assert event.attempt <= D.max_retries or event.reason == "drain"
            case AnnouncementSendFailed() if event.entry_id is not None:
                if event.error_class != "held_back":
                    queued[event.entry_id] += 1
            case AnnouncementDeadLetterDelivered() | AnnouncementDeadLetterExpired():
                assert event.entry_id not in ended, f"{event.entry_id} ended twice {where}"
                ended.add(event.entry_id)
            case _:
                pass


# -- the test ----------------------------------------------------------------------------------

_EXAMPLES = int(os.environ.get("STALWART_MACHINE_EXAMPLES", "15"))
_STEPS = int(os.environ.get("STALWART_MACHINE_STEPS", "25"))
#: set to draw new examples (with pytest's ``--hypothesis-seed=N`` to repeat a run)
_RANDOM = bool(os.environ.get("STALWART_MACHINE_RANDOM"))


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[type[DeadLetterMachine]]:
    counter = itertools.count()
    receivers = {name: Receiver() for name in CHANNELS}
    try:
        with IoPortal() as portal:

            class Machine(DeadLetterMachine):
                @staticmethod
                def new_location() -> str:
                    return str(tmp_path / f"store{next(counter)}")

            Machine.portal = portal
            Machine.receivers = receivers
            Machine.channels = {name: webhook(r.url) for name, r in receivers.items()}
            yield Machine
    finally:
        for receiver in receivers.values():
            receiver.close()


def test_deadletter_machine(machine: type[DeadLetterMachine]) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=_EXAMPLES,
            stateful_step_count=_STEPS,
            deadline=None,
            database=None,
            derandomize=not _RANDOM,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
    print(dict(sorted(SEEN.items())))  # shown with -s


# -- what the machine found ------------------------------------------------------------------


def taken_in(ref: pykka.ActorRef[Any], entry_id: str) -> None:
    """Wait until the queue ``ref`` holds entry ``entry_id``."""
    give_up = time.monotonic() + SEND_WAIT_S
    while entry_id not in {e.entry_id for e in ref.ask(QueueState(), timeout=GUARD).entries}:
        assert time.monotonic() < give_up, "the queue never took in the other runtime's entry"
        time.sleep(0.01)  # real-time: the queue follows what another runtime appends


def delivered_by_the_other_runtime(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    second: pykka.ActorRef[Any],
    entry_id: str,
    receiver: Receiver,
) -> None:
    """``second`` alone sends entry ``entry_id`` at its first backoff, once."""
    taken_in(second, entry_id)
    step_queues(
        clock, scheduler, (second,), for_s=D.max_age_ms / 1000, done=lambda s: not s[0].entries
    )
    log = dead_letters(store)
    retried = of(AnnouncementDeadLetterRetried, log)
    assert [(r.entry_id, r.runtime, r.reason) for r in retried] == [(entry_id, "rt-b", "backoff")]
    assert [d.entry_id for d in of(AnnouncementDeadLetterDelivered, log)] == [entry_id]
    assert [r.headers["idempotency-key"] for r in receiver.requests] == ["ann-1"]
    assert_dead_letters_verify(store)


# Was: DEFECT: an entry queued by one runtime that then stopped for good was never retried
# nor expired by the other runtime's queue on the store (it folded the stream only when it
# appended something itself): the user never got the reply, the log never said why
@pytest.mark.parametrize("kind", ["lmdb", "pg"])
def test_an_entry_another_runtime_queued_before_it_stopped_is_retried_here(
    kind: str,
    request: pytest.FixtureRequest,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    store: EventStore = request.getfixturevalue(f"{kind}_store")
    receiver = receiver_of(receivers)
    hooks: dict[str, Channel] = {"hook": webhook(receiver.url)}
    first = start_queue(store, clock, scheduler, portal, hooks, actors, runtime="rt-a")
    second = start_queue(store, clock, scheduler, portal, hooks, actors, runtime="rt-b")
    second.ask(QueueState(), timeout=GUARD)  # started, the stream empty
    entry_id = first.ask(Enqueue("ann-1", "hook", "conv-1", "one", "timeout"), timeout=GUARD)
    first.stop(block=True, timeout=GUARD)

    delivered_by_the_other_runtime(store, clock, scheduler, second, entry_id, receiver)


# Was: DEFECT: a sender that told the other runtime's queue again took in the entry there
# (the queue answered with its id) but armed no timer for it: with the runtime that queued
# it gone, it was never retried nor expired
def test_an_entry_taken_in_by_a_sender_told_again_is_retried_when_its_runtime_stops(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
    receivers: list[Receiver],
) -> None:
    receiver = receiver_of(receivers)
    hooks: dict[str, Channel] = {"hook": webhook(receiver.url)}
    first = start_queue(lmdb_store, clock, scheduler, portal, hooks, actors, runtime="rt-a")
    second = start_queue(lmdb_store, clock, scheduler, portal, hooks, actors, runtime="rt-b")
    second.ask(QueueState(), timeout=GUARD)
    enqueue = Enqueue("ann-1", "hook", "conv-1", "one", "timeout")
    entry_id = first.ask(enqueue, timeout=GUARD)
    assert second.ask(enqueue, timeout=GUARD) == entry_id
    first.stop(block=True, timeout=GUARD)

    delivered_by_the_other_runtime(lmdb_store, clock, scheduler, second, entry_id, receiver)
