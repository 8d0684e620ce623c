"""The activation policy under random interleavings, against a real LMDB store.

A hypothesis state machine plays the parts that decide on a session's activations, each
the way the runtime does it, without starting actors: users send messages (some with a
platform id, some redelivered), hosts schedule delayed wakes, three workers poll the
work queue and append the pure ``decide_lease`` with ``expected_version`` and a fence
claim (as ``ActivationWorker._poll_queue`` / ``_try_lease`` do), holders settle
(``decide_settlement``, fenced by their epoch, as the Agent does), renew, hand their
lease back (``decide_release``) or die, and operators confirm or interrupt. The clock
only moves forward; a live worker takes over a lease when it runs out (as a polling
worker does), unless its holder renews it in time.

After every step the log, folded anew, must hold: at most one live lease per session,
epochs that never go back, no settlement outside the live lease (and every append the
fence should refuse raised: a wake whose lease its worker handed back may still try to
settle), every activation queued, settled or cancelled exactly once,
a redelivered message id recorded once, a fold cut anywhere (and restored from its
encoded state) equal to the whole fold; and a session whose work is due is handed out by
the work queue. At the end ``replay --verify`` over the whole store finds nothing.

The suite runs a short version (80 examples of 40 steps, about 5 s). To run it
longer, as the review did (3,000 examples of 40 steps, and 600 of 120, found nothing),
set the counts and lift pytest's timeout; ``-s`` prints how often each case came up::

    STALWART_MACHINE_EXAMPLES=3000 STALWART_MACHINE_STEPS=40 python -m pytest -n 0 -q -s \
        --timeout=0 tests/test_activation_machine_s34.py -k machine
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
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
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import ActivationSettings, Config
from stalwart.errors import ConcurrencyError, FencedError, SessionActionError
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
    ActivationReleased,
    ActivationRequeued,
    Event,
    LeaseExpired,
    LeaseRenewed,
    MessageAppended,
    RecordedEvent,
    SessionRequiresAction,
    ToolCall,
    UserInterrupt,
)
from stalwart.runtime import (
    RUNTIME_STREAM,
    confirm,
    interrupt,
    load_session,
    runtime_started,
    schedule_wake,
    send_message,
)
from stalwart.state import (
    ACTIVATIONS,
    ActivationPolicy,
    ActivationsState,
    Lease,
    WakeResult,
    decide_lease,
    decide_release,
    decide_settlement,
    due_at,
)
from stalwart.state._verify_activations import _FOLD as SELECTIVE
from stalwart.store import Due, EventStore, Fence, NewEvent, WorkQueue, load_state

START = 1_800_000_000.0
SESSIONS = ("s1", "s2")
WORKERS = 3
CLAIM_BATCH = 8
CLAIM_HOLD_S = 5.0
LEASE_TRIES = 8
#: the configs a process may run with (a restart may change them): short leases, few
#: attempts and pending wakes, so that the limits are reached in a few steps
SETTINGS = (
    ActivationSettings(
        lease_ttl_ms=30_000,
        renew_every_ms=10_000,
        backoff_base_ms=2_000,
        backoff_cap_ms=8_000,
        max_attempts=3,
        max_pending_wakes=3,
        max_wake_horizon_ms=600_000,
        poll_ms=1_000,
    ),
    ActivationSettings(
        lease_ttl_ms=20_000,
        renew_every_ms=5_000,
        backoff_base_ms=1_000,
        backoff_cap_ms=30_000,
        max_attempts=2,
        max_pending_wakes=2,
        max_wake_horizon_ms=60_000,
        poll_ms=500,
    ),
)


def policy_of(settings: ActivationSettings) -> ActivationPolicy:
    fields = ActivationPolicy.__struct_fields__
    return ActivationPolicy(**{name: getattr(settings, name) for name in fields})


#: what a wake's end settles with (the Agent's ``wake_result``)
RESULTS = {
    "ok": WakeResult(status="ok"),
    "blocked": WakeResult(status="blocked"),
    "retry": WakeResult(status="failed", error_class="provider_unavailable", retryable=True),
    "final": WakeResult(status="failed", error_class="bad_request", retryable=False),
}
#: the settlements; the head and the messages its lease covers leave the queue with them
SETTLING = (ActivationAcked, ActivationBlocked, ActivationAbandoned)


#: how often each interesting case came up (``-s`` prints them after a long run)
SEEN: Counter[str] = Counter()


def note(what: str) -> None:
    SEEN[what] += 1


def stream_of(session: str) -> str:
    return f"session:{session}"


@dataclass
class Holder:
    """A wake run under a lease: ``running`` until it settles, hands its lease back,
    learns it lost it, or its process dies (``dead``: it never acts again). ``released``:
    its worker handed the lease back while the wake still ran (an Agent that did not stop
    in time): it may still try to settle, and the fence must refuse it."""

    owner: str
    stream: str
    epoch: int
    activation_id: str
    status: str = "running"


def fold(records: list[RecordedEvent], stream: str) -> ActivationsState:
    folder = ACTIVATIONS.folder(ACTIVATIONS.initial(stream))
    for record in records:
        folder.add(record)
    return folder.state()


class ActivationMachine(RuleBasedStateMachine):
    #: a fresh directory for each example (set by the test)
    new_location: staticmethod

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(start=START)
        self.location = type(self).new_location()
        # snapshots every few events: the folds the actions and polls load go through them
        self.store: EventStore = store_module.open(
            self.location, clock=self.clock, snapshot_every=4
        )
        assert isinstance(self.store, WorkQueue)
        self.queue: WorkQueue = self.store
        self.settings = SETTINGS[0]
        self.policy = policy_of(self.settings)
        self.started()
        self.generation = itertools.count(1)
        self.owners = [f"w{i}.0" for i in range(WORKERS)]
        self.holders: list[Holder] = []
        self.created: set[str] = set()
        self.given: dict[tuple[str, str], str] = {}  # (session, message id) -> activation id
        self.ids = itertools.count(1)

    # -- helpers -----------------------------------------------------------------------------

    def started(self) -> None:
        """A process starts: it records the config in force (replay verifies under it)."""
        config = Config(activations=self.settings)
        self.store.append(RUNTIME_STREAM, [runtime_started(config, self.store, "machine")])

    def now(self) -> float:
        return self.clock.now()

    def records(self, stream: str) -> list[RecordedEvent]:
        return list(self.store.read_stream(stream))

    def state(self, stream: str) -> ActivationsState:
        return fold(self.records(stream), stream)

    def running(self, owner: str | None = None) -> list[Holder]:
        return [
            h for h in self.holders if h.status == "running" and (owner is None or h.owner == owner)
        ]

    def live(self, holder: Holder) -> bool:
        """Whether ``holder``'s lease is the session's live one (the fence lets it write)."""
        lease = self.state(holder.stream).lease
        return (
            lease is not None
            and lease.epoch == holder.epoch
            and lease.activation_id == holder.activation_id
            and self.store.lease_epoch(holder.stream) == holder.epoch
        )

    def try_lease(self, owner: str, stream: str, now: float) -> None:
        """``ActivationWorker._try_lease`` then the write-back of ``_poll_queue``."""
        for _ in range(LEASE_TRIES):
            state = load_state(self.store, stream, ACTIVATIONS)
            assert state == self.state(stream), "a fold from its snapshot differs"
            if any(h.stream == stream for h in self.running(owner)):
                break  # this worker runs the session's wake: it leases nothing there
            events = (
                decide_lease(state, owner, now, self.policy) if state.queue or state.lease else []
            )
            if not events:
                break
            leased = events[-1] if isinstance(events[-1], ActivationLeased) else None
            claim = leased.epoch if leased is not None else _abandon_epoch(events)
            fence = Fence(claim, claim=True) if claim is not None else None
            news = [NewEvent(event=e, ts=now) for e in events]
            try:
                if leased is not None:
                    due = Due(leased.expires_at)
                    self.queue.append(stream, news, state.version, fence=fence, due=due)
                else:
                    self.store.append(stream, news, expected_version=state.version, fence=fence)
            except (ConcurrencyError, FencedError):
                continue  # another writer came first: fold again (never here: one thread)
            for e in events:
                note(f"lease decision: {type(e).__name__}")
            if leased is not None:
                if leased.covers:
                    note("a lease covering messages")
                self.holders.append(Holder(owner, stream, leased.epoch, leased.activation_id))
                return
        state = self.state(stream)
        self.queue.set_due(stream, state.version, due_at(state), owner)

    def poll_as(self, worker: int) -> list[str]:
        """One poll of worker ``worker``: claim what is due, decide for each, write back."""
        owner, now = self.owners[worker], self.now()
        due_now = {
            stream_of(s)
            for s in self.created
            if (due := due_at(self.state(stream_of(s)))) is not None and due <= now
        }
        work = self.queue.claim_due(owner, now, CLAIM_BATCH, CLAIM_HOLD_S)
        claimed = [c.stream for c in work.claimed]
        missing = due_now - set(claimed)
        assert not missing, f"work due at {now} not handed out by the queue: {missing}"
        for stream in claimed:
            self.try_lease(owner, stream, now)
        return claimed

    def settle(self, holder: Holder, result: WakeResult, jitter_ms: int) -> None:
        """The Agent's end of a wake: the settlement (after the request, for a pause),
        fenced by the wake's epoch; refused exactly when the lease is not live."""
        now = self.now()
        live = self.live(holder)
        state = self.state(holder.stream)
        events: list[Event] = []
        if result.status == "blocked":
            n = next(self.ids)
            request = SessionRequiresAction(
                request_id=f"req-{n}", kind="approval", tool="refund", call_id=f"call-{n}"
            )
            call = ToolCall(id=request.call_id or "", name="refund")
            asked = MessageAppended(message_id=f"a-{n}", role="assistant", tool_calls=(call,))
            events.extend([asked, request])  # the model's call, then the pause it makes
            result = msgspec.structs.replace(result, request_id=request.request_id)
        events.append(
            decide_settlement(
                state,
                holder.activation_id,
                holder.epoch,
                result,
                now,
                self.policy,
                jitter_ms=jitter_ms,
            )
        )
        news = [NewEvent(event=e, ts=now) for e in events]
        holder.status = "done"
        try:
            self.store.append(holder.stream, news, fence=Fence(holder.epoch))
        except FencedError:
            assert not live, "the live lease's holder was fenced out"
            note("settlement fenced out")
            return
        assert live, "a settlement outside the live lease went through the fence"
        note(f"settled: {type(events[-1]).__name__}")

    # -- users and hosts ---------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS), with_id=st.booleans())
    def message(self, session: str, with_id: bool) -> None:
        message_id = f"m-{next(self.ids)}" if with_id else None
        activation_id = send_message(self.store, session, "hello", message_id=message_id)
        self.created.add(session)
        if message_id is not None:
            self.given[(session, message_id)] = activation_id

    @precondition(lambda self: self.given)
    @rule(data=st.data())
    def redelivered(self, data: st.DataObject) -> None:
        session, message_id = data.draw(st.sampled_from(sorted(self.given)))
        before = self.store.stream_version(stream_of(session))
        again = send_message(self.store, session, "hello again", message_id=message_id)
        assert again == self.given[(session, message_id)]
        assert self.store.stream_version(stream_of(session)) == before, "recorded twice"

    @rule(
        session=st.sampled_from(SESSIONS),
        delay=st.sampled_from([0.0, -5.0, 3.0, 45.0, 700.0]),
        key=st.sampled_from([None, "daily", "hourly"]),
    )
    def wake(self, session: str, delay: float, key: str | None) -> None:
        stream = stream_of(session)
        before = self.store.stream_version(stream)
        now = self.now()
        try:
            chosen = schedule_wake(
                self.store,
                session,
                now + delay,
                now=now,
                policy=self.policy,
                text="w",
                dedupe_key=key,
            )
        except SessionActionError as exc:
            refused: str | None = exc.reason
        else:
            refused = None
        if refused is not None:
            assert refused == ("wake_refused" if session in self.created else "no_session")
            assert self.store.stream_version(stream) == before, "a refused wake was recorded"
            return
        state = self.state(stream)
        assert state.find(chosen) is not None, "the wake chosen is not queued"

    # -- workers -----------------------------------------------------------------------------

    @rule(worker=st.integers(0, WORKERS - 1))
    def poll(self, worker: int) -> None:
        self.poll_as(worker)

    @rule(first=st.integers(0, WORKERS - 1), second=st.integers(0, WORKERS - 1))
    def race(self, first: int, second: int) -> None:
        """Two workers fold one session at the same version and both decide to lease it:
        one lease is appended, the other append is refused."""
        if first == second:
            return
        now = self.now()
        for session in sorted(self.created):
            stream = stream_of(session)
            state = load_state(self.store, stream, ACTIVATIONS)
            one = decide_lease(state, self.owners[first], now, self.policy)
            two = decide_lease(state, self.owners[second], now, self.policy)
            if not (one and isinstance(one[-1], ActivationLeased)):
                continue
            if any(h.stream == stream for h in self.running(self.owners[first])):
                continue
            if any(h.stream == stream for h in self.running(self.owners[second])):
                continue
            for events, owner in ((one, self.owners[first]), (two, self.owners[second])):
                leased = events[-1]
                assert isinstance(leased, ActivationLeased)
                news = [NewEvent(event=e, ts=now) for e in events]
                fence = Fence(leased.epoch, claim=True)
                due = Due(leased.expires_at)
                try:
                    self.queue.append(stream, news, state.version, fence=fence, due=due)
                except (ConcurrencyError, FencedError):
                    assert owner == self.owners[second], "the first lease was refused"
                    continue
                assert owner == self.owners[first], "both racing leases went through"
                self.holders.append(Holder(owner, stream, leased.epoch, leased.activation_id))
            return

    @precondition(lambda self: self.running())
    @rule(data=st.data(), how=st.sampled_from(sorted(RESULTS)), jitter=st.integers(0, 500))
    def settle_wake(self, data: st.DataObject, how: str, jitter: int) -> None:
        holder = data.draw(st.sampled_from(self.running()))
        self.settle(holder, RESULTS[how], jitter)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """``ActivationWorker._renew``: fenced by the epoch; fenced out, the holder stops
        and records that it noticed."""
        holder = data.draw(st.sampled_from(self.running()))
        now = self.now()
        live = self.store.lease_epoch(holder.stream) == holder.epoch
        renewed = LeaseRenewed(
            activation_id=holder.activation_id,
            owner=holder.owner,
            epoch=holder.epoch,
            expires_at=now + self.policy.lease_ttl_ms / 1000,
        )
        try:
            self.store.append(
                holder.stream, [NewEvent(event=renewed, ts=now)], fence=Fence(holder.epoch)
            )
        except FencedError as exc:
            assert not live
            note("renewal fenced out")
            holder.status = "done"
            lost = ActivationLeaseLost(
                activation_id=holder.activation_id,
                owner=holder.owner,
                epoch=holder.epoch,
                current_epoch=exc.current,
            )
            self.store.append(holder.stream, [NewEvent(event=lost, ts=now)])
            return
        assert live, "a renewal of a lease taken over went through the fence"

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """``ActivationWorker._release``: a clean stop hands the live lease back; the wake
        (its Agent did not stop in time) may still try to settle afterwards."""
        holder = data.draw(st.sampled_from(self.running()))
        self.release_holder(holder)
        holder.status = "released"

    @precondition(lambda self: self.released())
    @rule(data=st.data(), how=st.sampled_from(sorted(RESULTS)), jitter=st.integers(0, 500))
    def settle_released(self, data: st.DataObject, how: str, jitter: int) -> None:
        """A wake whose lease was handed back settles late: the fence refuses it."""
        holder = data.draw(st.sampled_from(self.released()))
        assert not self.live(holder), "a released lease is still live"
        self.settle(holder, RESULTS[how], jitter)

    def released(self) -> list[Holder]:
        return [h for h in self.holders if h.status == "released"]

    def release_holder(self, holder: Holder) -> None:
        """As the worker does: the release claims the next epoch, at the version it was
        decided on."""
        holder.status = "done"
        state = self.state(holder.stream)
        decided = decide_release(state, holder.owner, holder.epoch)
        if decided is None:
            assert not self.live(holder)
            return
        assert decided.claimed == state.epoch + 1
        now = self.now()
        self.store.append(
            holder.stream,
            [NewEvent(event=decided, ts=now)],
            expected_version=state.version,
            fence=Fence(decided.claimed, claim=True),
        )
        note("released")

    @rule(worker=st.integers(0, WORKERS - 1), now=st.integers(0, 2))
    def crash(self, worker: int, now: int) -> None:
        """The worker's process dies: its wakes never act again; a new one takes its place."""
        if now:  # seldom
            return
        for holder in self.running(self.owners[worker]):
            holder.status = "dead"
        self.owners[worker] = f"w{worker}.{next(self.generation)}"

    @rule(clean=st.booleans(), which=st.sampled_from(range(len(SETTINGS))), now=st.integers(0, 3))
    def restart(self, clean: bool, which: int, now: int) -> None:
        """Every worker process stops (a clean stop hands its live leases back; a crash
        leaves them to expire) and new ones start, maybe with another config."""
        if now:  # seldom
            return
        for holder in self.running():
            if clean:
                self.release_holder(holder)
            holder.status = "dead"
        self.owners = [f"w{i}.{next(self.generation)}" for i in range(WORKERS)]
        self.settings = SETTINGS[which]
        self.policy = policy_of(self.settings)
        self.started()

    # -- operators ---------------------------------------------------------------------------

    def waiting(self) -> list[str]:
        return [s for s in sorted(self.created) if load_session(self.store, s)[0].pending]

    @precondition(lambda self: self.waiting())
    @rule(data=st.data(), allow=st.booleans())
    def answer(self, data: st.DataObject, allow: bool) -> None:
        session = data.draw(st.sampled_from(self.waiting()))
        pending = load_session(self.store, session)[0].pending
        assert pending is not None
        with pytest.raises(SessionActionError):  # an answer to another request: refused
            confirm(self.store, session, "req-none", allow=allow)
        resume = confirm(self.store, session, pending.request_id, allow=allow)
        note("confirmed")
        assert self.state(stream_of(session)).find(resume) is not None

    @rule(session=st.sampled_from(SESSIONS), now=st.integers(0, 3))
    def stop(self, session: str, now: int) -> None:
        if now:  # an operator interrupts seldom (it cancels everything the others built)
            return
        if session not in self.created:
            with pytest.raises(SessionActionError):
                interrupt(self.store, session, "stop")
            return
        queued = [a.activation_id for a in self.state(stream_of(session)).queue]
        cancelled = interrupt(self.store, session, "stop")
        note(f"interrupt cancelled {min(len(cancelled), 2)}+")
        assert cancelled == queued
        state = self.state(stream_of(session))
        assert state.queue == ()
        assert state.lease is None
        assert state.blocked_on is None

    # -- time --------------------------------------------------------------------------------

    @rule(
        seconds=st.floats(0.001, 200.0),
        keep_alive=st.booleans(),
        late=st.booleans(),
    )
    def advance(self, seconds: float, keep_alive: bool, late: bool) -> None:
        """Move the clock on. A holder that keeps its lease alive renews it every
        ``renew_every_ms``; a lease that runs out is taken over at its expiry by a worker
        that runs nothing on that session (workers poll at the due times they know), or
        (``late``) the clock stops up to half a poll after it, before the takeover: the
        holder may still renew or settle then, and the next step takes over."""
        target = self.now() + seconds
        for _ in range(1_000):
            expiries = [
                (state.lease.expires_at, stream_of(s))
                for s in sorted(self.created)
                if (state := self.state(stream_of(s))).lease is not None
            ]
            if not expiries or min(expiries)[0] > target:
                break
            expires_at, stream = min(expiries)
            holder = next((h for h in self.running() if h.stream == stream and self.live(h)), None)
            if keep_alive and holder is not None:
                ahead = (self.policy.lease_ttl_ms - self.policy.renew_every_ms) / 1000
                self.clock.set(max(self.now(), expires_at - ahead))
                self.renew_holder(holder)
                continue
            if late and self.now() <= expires_at:
                self.clock.set(min(target, expires_at + self.settings.poll_ms / 2000))
                return
            self.clock.set(max(self.now(), expires_at))
            self.take_over(stream)
        else:
            raise AssertionError("leases kept running out")
        self.clock.set(max(self.now(), target))

    def renew_holder(self, holder: Holder) -> None:
        now = self.now()
        renewed = LeaseRenewed(
            activation_id=holder.activation_id,
            owner=holder.owner,
            epoch=holder.epoch,
            expires_at=now + self.policy.lease_ttl_ms / 1000,
        )
        self.store.append(
            holder.stream, [NewEvent(event=renewed, ts=now)], fence=Fence(holder.epoch)
        )

    def take_over(self, stream: str) -> None:
        free = [
            i
            for i in range(WORKERS)
            if not any(h.stream == stream for h in self.running(self.owners[i]))
        ]
        if not free:  # every worker runs a wake there: the stale ones learn it first
            for holder in [h for h in self.running() if h.stream == stream]:
                if not self.live(holder):
                    holder.status = "done"
            free = [
                i
                for i in range(WORKERS)
                if not any(h.stream == stream for h in self.running(self.owners[i]))
            ]
        assert stream in self.poll_as(free[0]), "an expired lease was not handed out"
        lease = self.state(stream).lease
        assert lease is None or lease.expires_at > self.now(), "an expired lease was not taken over"

    # -- what the log must say ---------------------------------------------------------------

    @invariant()
    def the_log_holds(self) -> None:
        for session in sorted(self.created):
            stream = stream_of(session)
            records = self.records(stream)
            check_stream(records, stream)
            whole = fold(records, stream)
            assert self.store.lease_epoch(stream) == whole.epoch
            # replay folds only the events that move the activations: the same state
            folder = SELECTIVE.folder(SELECTIVE.initial(stream))
            for record in records:
                folder.add(record)
            assert msgspec.structs.replace(folder.state(), version=whole.version) == whole
            for cut in {len(records) // 3, len(records) // 2, len(records) - 1}:
                prefix = fold(records[:cut], stream)
                restored = msgspec.msgpack.decode(
                    msgspec.msgpack.encode(prefix), type=ActivationsState
                )
                folder = ACTIVATIONS.folder(restored)
                for record in records[cut:]:
                    folder.add(record)
                assert folder.state() == whole

    def teardown(self) -> None:
        try:
            if self.created:
                report = verify_store(self.store, None)
                assert report.clean, [f.message for f in report.findings]
        finally:
            self.store.close()
            shutil.rmtree(self.location, ignore_errors=True)


def check_stream(records: list[RecordedEvent], stream: str) -> None:
    """The stream's walk: one live lease, epochs up, settlements under the live lease,
    each activation queued, settled or cancelled once, each message id recorded once."""
    state = ACTIVATIONS.initial(stream)
    epoch = 0
    ready: list[str] = []
    ended: dict[str, str] = {}
    message_ids: set[str] = set()
    for record in records:
        event = record.event
        lease = state.lease
        if isinstance(event, ActivationReady):
            ready.append(event.activation_id)
            if event.message_id is not None:
                assert event.message_id not in message_ids, "a message id recorded twice"
                message_ids.add(event.message_id)
        elif isinstance(event, ActivationLeased):
            assert lease is None, f"a second live lease at position {record.position}"
            assert event.epoch > epoch, "an epoch went back"
            head = state.find(event.activation_id)
            assert head is not None
            assert head.run_at <= record.ts, "leased before it was due"
            assert state.blocked_on is None, "leased while the session waits for a human"
            if head.kind != "wake":  # user messages and resumes run in arrival order
                first = next(a for a in state.queue if a.kind != "wake")
                assert first.activation_id == head.activation_id, "leased out of order"
            epoch = event.epoch
        elif isinstance(event, UserInterrupt | ActivationReleased):
            epoch = _claim(event, lease, epoch)
        elif isinstance(event, ActivationAbandoned) and event.error_class == "lease_expired":
            assert lease is None
            assert event.epoch > epoch
            epoch = event.epoch
            _end(ended, state, [event.activation_id], "abandoned", record)
        elif isinstance(event, (*SETTLING, ActivationRequeued)):
            under = lease is not None and (lease.epoch, lease.activation_id) == (
                event.epoch,
                event.activation_id,
            )
            assert under, f"a settlement outside the live lease at position {record.position}"
            if isinstance(event, SETTLING):
                assert lease is not None
                ids = [event.activation_id, *lease.covers]
                _end(ended, state, ids, type(event).__name__, record)
        elif isinstance(event, ActivationCancelled):
            _end(ended, state, [event.activation_id], "cancelled", record)
        elif isinstance(event, LeaseExpired):
            assert lease is not None
            assert lease.epoch == event.epoch
        state = ACTIVATIONS.apply(state, record)
        assert state.epoch == epoch or not isinstance(event, ActivationLeased)
    queued = {a.activation_id for a in state.queue}
    assert not queued & set(ended), "an activation both queued and settled"
    assert queued | set(ended) == set(ready), "an activation lost"
    assert len(ready) == len(set(ready))


def _claim(event: UserInterrupt | ActivationReleased, lease: Lease | None, epoch: int) -> int:
    """The epoch an interrupt claims, or a release handing back the live lease: above
    the stream's."""
    if isinstance(event, UserInterrupt):
        assert event.epoch > epoch, "an interrupt's epoch went back"
        return event.epoch
    assert lease is not None, "a release of no lease"
    assert lease.epoch == event.epoch, "a release of another lease"
    assert event.claimed > epoch, "a release's claim went back"
    return event.claimed


def _end(
    ended: dict[str, str],
    state: ActivationsState,
    ids: list[str],
    how: str,
    record: RecordedEvent,
) -> None:
    for activation_id in ids:
        assert activation_id not in ended, (
            f"{activation_id} {how} at position {record.position} after {ended[activation_id]}"
        )
        assert state.find(activation_id) is not None, f"{activation_id} {how} but not queued"
        ended[activation_id] = how


def _abandon_epoch(events: list[Event]) -> int | None:
    for event in events:
        if isinstance(event, ActivationAbandoned):
            return event.epoch
    return None


_EXAMPLES = int(os.environ.get("STALWART_MACHINE_EXAMPLES", "80"))
_STEPS = int(os.environ.get("STALWART_MACHINE_STEPS", "40"))


@pytest.fixture
def machine(tmp_path: Path) -> type[ActivationMachine]:
    counter = itertools.count()

    class Machine(ActivationMachine):
        @staticmethod
        def new_location() -> str:
            return str(tmp_path / f"store{next(counter)}")

    return Machine


def test_activation_machine(machine: type[ActivationMachine]) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=_EXAMPLES,
            stateful_step_count=_STEPS,
            deadline=None,
            database=None,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.filter_too_much,
            ],
        ),
    )
    print(dict(sorted(SEEN.items())))  # shown with -s
