"""The ActivationWorker: leases due activations, keeps their leases alive, hands the wakes
to the sessions' Agents.

One per process (``owner`` names it: host, pid and a runtime id). On a store with a work
queue (:class:`~stalwart.store.WorkQueue`, both of ours) each poll claims the sessions
whose work is due and that no other worker holds, folds only those (reading each stream
from the version it last folded) and writes back the due time its fold found; N workers
so split the sessions instead of each folding the whole log. On a store without one it
folds the activation state of every session stream from the log (its own appends and
other processes' alike: it reads new records on every poll). Either way, for a session
with work due it appends the pure :func:`~stalwart.state.decide_lease` decision with a
fence claim and the folded version as ``expected_version``: of two workers racing for a
session, one wins and the other refolds. A claim is only a hint; the lease is decided
and fenced the same way whatever the claim said.

A lease is renewed every ``renew_every_ms`` with a fenced append; a renewal that is
fenced out means the lease was taken over (this process froze past the TTL, or an
interrupt claimed the session): the Agent is told to stop (:class:`LeaseLost`) and the
worker records ``activation:lease_lost``. A claim of the session whose fold shows a
later epoch than the running wake's (an interrupt from another process lowers the due
row to now) does the same at once, rather than at the next renewal. A process stopping
cleanly tells the worker :class:`Closing` (no new leases), stops the Agents, then
:class:`Release`: each running wake's lease is handed back (``activation:released``,
claiming the next epoch, so that a wake whose Agent did not stop in time has its later
appends fenced out), so the next worker runs it at once and no failure is counted. The
Agent settles the wake itself, in the same append as the turn's outcome, and tells the
worker :class:`WakeEnded`.

The store may fail under it (a database gone away) without a wake being lost: a claimed
session it cannot settle is put off with a doubling backoff (so it does not starve the
others); a lease append that may or may not have been written (or was not read back) is
looked at again by the next poll (its own live lease found there is run, or handed back
at a clean stop); a wake its Agent could not be started for is a failed wake; a dead
Agent's settlement that failed is tried again at each poll while its lease lasts.

Polls come from the scheduler (every ``poll_ms``, and at the next due time it knows of),
and from :class:`Nudge` when this process appends work; when a wake ends, the worker
decides again for that session (with a work queue, for that one alone).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from typing import Any

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.errors import ConcurrencyError, FencedError, StoreError, StoreUnavailableError
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    ActivationLeaseLost,
    Event,
    LeaseRenewed,
)
from stalwart.state import (
    ACTIVATIONS,
    Activation,
    ActivationPolicy,
    ActivationsState,
    Lease,
    WakeResult,
    decide_lease,
    decide_release,
    decide_settlement,
    due_at,
)
from stalwart.store import Due, DueClaim, EventStore, Fence, NewEvent, WorkQueue, load_state

from ._restarts import crashed
from ._scheduler import Scheduler
from ._supervised import Supervised

__all__ = [
    "ActivationWorker",
    "Closing",
    "LeaseLost",
    "Nudge",
    "Release",
    "Wake",
    "WakeEnded",
    "WakeFailed",
    "WorkerReport",
    "WorkerStatus",
]

log = get_logger(__name__)

SESSION_PREFIX = "session:"
#: How many times a poll decides again for one session after losing a race.
LEASE_TRIES = 8
#: How a claim ends when its own wake settled it (not an expiry or an interrupt).
_SETTLED = frozenset({"acked", "blocked", "requeued", "abandoned"})
#: How many due sessions one poll claims (a full claim polls again at once), by default.
CLAIM_BATCH = 8
#: How long a claim keeps other workers off a session while this one decides for it.
CLAIM_HOLD_MS = 5_000
#: The longest a claimed session this worker could not settle (it cannot be folded) is
#: put off; the first time by one poll interval, doubling each time after.
PUT_OFF_MAX_S = 300.0


class Wake(msgspec.Struct, frozen=True, kw_only=True):
    """Run one bounded wake of ``stream`` under lease ``epoch``: ``activations`` are the
    leased one first, then the user messages its lease covers."""

    stream: str
    activation_id: str
    kind: str
    epoch: int
    expires_at: float
    activations: tuple[Activation, ...]


class LeaseLost(msgspec.Struct, frozen=True):
    """The lease ``epoch`` of ``stream`` is gone (None: whichever the Agent holds, as
    after an interrupt): stop the wake, append nothing more."""

    stream: str
    epoch: int | None


class Abandoned(msgspec.Struct, frozen=True):
    """The worker gave up on an activation of ``stream`` (``activation:abandoned``): its
    Agent tells the user, unless the wake's own end already did."""

    stream: str


class WakeEnded(msgspec.Struct, frozen=True):
    """The Agent settled (or abandoned) the wake it was given."""

    stream: str
    epoch: int


class WakeFailed(msgspec.Struct, frozen=True):
    """The Agent running the wake of ``stream`` died (``error_class``): settle it as a
    retryable failure (requeued with backoff, abandoned after ``max_attempts``)."""

    stream: str
    error_class: str


class _Unsettled(msgspec.Struct, frozen=True):
    """A failed wake whose settlement the store refused: tried again until ``until``."""

    message: WakeFailed
    epoch: int
    until: float


class Nudge(msgspec.Struct, frozen=True):
    """Work was appended: poll now."""


class _Tick(msgspec.Struct, frozen=True):
    pass


class _Renew(msgspec.Struct, frozen=True):
    stream: str
    epoch: int


class Closing(msgspec.Struct, frozen=True):
    """The process is stopping: lease nothing more (the running wakes' leases are kept
    alive until :class:`Release`)."""


class Release(msgspec.Struct, frozen=True):
    """The running wakes' Agents are stopped: hand their leases back
    (``activation:released``, no failure counted). Replies with how many were released."""


class WorkerStatus(msgspec.Struct, frozen=True):
    """Ask for the :class:`WorkerReport`."""


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker runs (``running``: stream -> epoch), how many sessions' folds it
    holds (with a work queue, only those with something due or running), and the log
    position it folded to (0 with a work queue: it reads the sessions it claimed, not the
    log)."""

    owner: str
    position: int
    running: dict[str, int]
    sessions: int


class ActivationWorker(Supervised):
    """Start with ``ActivationWorker.start(store, clock, scheduler, policy, owner=...,
    wake=..., lost=...)``. ``wake(Wake)`` hands a wake to the session's Agent (starting
    it if needed) and returns False when it cannot (a failed wake), None when the process
    is stopping (the lease is kept for :class:`Release`); ``lost(LeaseLost)`` tells it to stop.
    ``jitter_ms()`` is added to the backoff of a failure the worker settles itself (an
    Agent that died, a wake no Agent took), as the Agent adds it to its own, so the
    wakes of many Agents killed together do not all come back at one instant.
    Ask it :class:`WorkerStatus` (with a timeout) for what it runs."""

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        policy: ActivationPolicy,
        *,
        owner: str,
        wake: Callable[[Wake], bool | None],
        lost: Callable[[LeaseLost], object],
        abandoned: Callable[[Abandoned], object] | None = None,
        poll_ms: int = 1_000,
        jitter_ms: Callable[[], int] | None = None,
        claim_batch: int = CLAIM_BATCH,
        claim_hold_ms: int = CLAIM_HOLD_MS,
        on_crash: Callable[[str], object] | None = None,
    ) -> None:
        super().__init__()
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._policy = policy
        self._owner = owner
        self._wake = wake
        self._lost = lost
        self._abandoned = abandoned
        self._poll_ms = poll_ms
        self._jitter_ms = jitter_ms
        self._claim_batch = max(1, claim_batch)
        self._claim_hold_s = claim_hold_ms / 1000
        self._on_crash = on_crash
        self._position = 0
        self._queue = store if isinstance(store, WorkQueue) else None
        self._states: dict[str, ActivationsState] = {}
        self._running: dict[str, int] = {}  # stream -> the epoch this worker holds
        self._failing: dict[str, _Unsettled] = {}  # failed wakes whose settling failed
        #: leases whose wake does not run: their append may or may not have been written,
        #: or their Agent could not start (the store was away); each poll looks again
        self._uncertain: set[str] = set()
        self._unchecked: set[str] = set()  # uncertain ones whose stream could not be read
        #: unsettled claims: how often in a row, at which version of the stream, until when
        self._put_off: dict[str, tuple[int, int, float]] = {}
        #: (when to look, stream): a fold kept, or a claim put off, for a due time that
        #: another worker's claim may serve instead (see :meth:`_forget_stale`)
        self._kept: list[tuple[float, str]] = []
        self._tick_at: float | None = None  # when the armed tick fires
        self._closing = False  # Closing came: no more leases

    # -- lifecycle ------------------------------------------------------------------------------

    def started(self) -> None:
        self._poll()

    def on_stop(self) -> None:
        self._scheduler.cancel(("worker:tick", self._owner))
        for stream in list(self._running):
            self._scheduler.cancel(("worker:renew", self._owner, stream))

    def on_failure(self, *exc_info: object) -> None:
        self.on_stop()
        crashed(self._on_crash, exc_info)

    def on_receive(self, message: Any) -> Any:
        match message:
            case Nudge() | _Tick():
                self._poll()
            case WakeEnded():
                self._ended(message)
                self._next_wake(message.stream)
            case _Renew():
                self._renew(message)
            case WakeFailed():
                self._failed(message)
                self._next_wake(message.stream)
            case Closing():
                self._closing = True
                self._scheduler.cancel(("worker:tick", self._owner))
            case Release():
                return self._release()
            case WorkerStatus():
                return self._report()
            case _:
                raise TypeError(f"ActivationWorker does not understand {message!r}")
        return None

    def _report(self) -> WorkerReport:
        return WorkerReport(
            owner=self._owner,
            position=self._position,
            running=dict(self._running),
            sessions=len(self._states),
        )

    # -- polling --------------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Fold every session record appended since the last poll (any process's)."""
        states = self._states
        for record in self._store.read_all(self._position + 1):
            self._position = record.position
            stream = record.stream
            if not stream.startswith(SESSION_PREFIX):
                continue
            state = states.get(stream)
            if state is None:
                state = ACTIVATIONS.initial(stream)
            states[stream] = ACTIVATIONS.apply(state, record)

    def _refresh(self, stream: str) -> None:
        """Fold the records of ``stream`` appended since this worker last folded it (one
        it does not hold, from its newest snapshot)."""
        state = self._states.get(stream)
        if state is None:
            state = load_state(self._store, stream, ACTIVATIONS)
        else:
            for record in self._store.read_stream(stream, state.version + 1):
                state = ACTIVATIONS.apply(state, record)
        self._states[stream] = state

    def _let_go(self, stream: str, due: float | None) -> None:
        """With a work queue, forget the fold of a session with nothing due, no lease and
        no wake here: the claim that brings it back folds it again (from its snapshot), so
        a worker that runs for weeks holds no fold per session it ever served. One with
        work due later is kept for the claim at that time, which may be another worker's:
        :meth:`_forget_stale` forgets it then."""
        if stream in self._running or stream in self._uncertain:
            return
        if due is None:
            self._states.pop(stream, None)
        else:
            self._look_later(stream, due)

    def _look_later(self, stream: str, at: float) -> None:
        """With a work queue, have :meth:`_forget_stale` look at the stream's fold after
        ``at`` (a wake of it ended, or its lease was lost, or it has work due then)."""
        if self._queue is not None:
            heapq.heappush(self._kept, (at, stream))

    def _forget_stale(self, now: float) -> None:
        """Forget the folds kept, and the claims put off, whose due time passed a claim's
        hold and a poll ago with no claim of this worker since: another worker claimed
        the session and ran its work (its next wake needs no claim), so nothing would
        ever bring them back here, and what was appended since is not in them."""
        grace = self._claim_hold_s + self._poll_ms / 1000
        kept = self._kept
        while kept and kept[0][0] + grace <= now:
            _, stream = heapq.heappop(kept)
            if stream in self._running or stream in self._uncertain:
                continue
            state = self._states.get(stream)
            due = due_at(state) if state is not None else None
            if state is not None and (due is None or due + grace <= now):
                del self._states[stream]
            put_off = self._put_off.get(stream)
            if put_off is not None and put_off[2] + grace <= now:
                del self._put_off[stream]

    def _sync(self, stream: str) -> None:
        if self._queue is not None:
            self._refresh(stream)
        else:
            self._catch_up()

    def _poll(self) -> None:
        if self._closing:
            return
        self._settle_pending()
        if self._queue is not None:
            self._poll_queue(self._queue)
            return
        try:
            self._catch_up()
        except StoreError as exc:
            log.warning("worker.read_failed", error_class=type(exc).__name__)
            self._arm(None)
            return
        now = self._clock.now()
        for stream in list(self._states):
            self._try_lease(stream, now)
        self._arm(self._next_due(now))

    def _poll_queue(self, queue: WorkQueue) -> None:
        """Claim the due sessions no other worker holds, decide for each, write back."""
        now = self._clock.now()
        try:
            work = queue.claim_due(self._owner, now, self._claim_batch, self._claim_hold_s)
        except StoreError as exc:
            log.warning("worker.claim_failed", error_class=type(exc).__name__)
            self._arm(None)
            return
        for claim in work.claimed:
            stream = claim.stream
            try:
                self._refresh(stream)
                if not self._try_lease(stream, now):
                    state = self._states[stream]
                    due = due_at(state)
                    queue.set_due(stream, state.version, due, self._owner)
                    self._let_go(stream, due)
            except StoreError as exc:
                log.warning("worker.claim_unsettled", stream=stream, error=type(exc).__name__)
                self._put_off_claim(queue, claim, now)
            else:
                self._put_off.pop(stream, None)
        for stream in list(self._uncertain):  # its due row says "leased": no claim comes
            try:
                self._refresh(stream)
                self._try_lease(stream, now)
            except StoreError as exc:  # said once, not at every poll while it lasts
                level = log.debug if stream in self._unchecked else log.warning
                level("worker.lease_unchecked", stream=stream, error=type(exc).__name__)
                self._unchecked.add(stream)
            else:
                self._unchecked.discard(stream)
        self._unchecked &= self._uncertain  # one settled meanwhile is forgotten
        self._forget_stale(now)
        if len(work.claimed) >= self._claim_batch:
            self._tell(Nudge())
        self._arm(work.next_at)

    def _put_off_claim(self, queue: WorkQueue, claim: DueClaim, now: float) -> None:
        """Put a claimed session this worker could not settle (its fold or decision
        failed: a corrupt record, a read that failed) off by a backoff that doubles each
        time in a row, up to :data:`PUT_OFF_MAX_S`: the claims hand out the other due
        sessions meanwhile instead of this one again at once. The write-back is that of a
        fold of the claimed row's version, so an append since (new work) still wins."""
        tries, version, _ = self._put_off.get(claim.stream, (0, claim.version, now))
        if version != claim.version:  # appended to since (new work): a fresh start
            tries = 0
        delay = min(self._poll_ms / 1000 * 2 ** min(tries, 16), PUT_OFF_MAX_S)
        self._put_off[claim.stream] = (tries + 1, claim.version, now + delay)
        self._look_later(claim.stream, now + delay)
        try:
            queue.set_due(claim.stream, claim.version, now + delay, self._owner)
        except StoreError:  # the store is away: the claim's hold runs out instead
            return
        log.warning("worker.claim_put_off", stream=claim.stream, seconds=delay)

    def _next_wake(self, stream: str) -> None:
        """After a wake of ``stream`` ended: with a work queue, decide for that session at
        once (it needs no claim: the lease is fenced all the same) and write back its due
        time, so its settlement costs no other worker a look; else poll everything."""
        queue = self._queue
        if queue is None or self._closing:
            self._poll()
            return
        try:
            self._refresh(stream)
            if not self._try_lease(stream, self._clock.now()):
                state = self._states[stream]
                due = due_at(state)
                queue.set_due(stream, state.version, due, self._owner)
                self._let_go(stream, due)
                if due is not None and (self._tick_at is None or due < self._tick_at):
                    self._arm(due)  # a retry's backoff, not the next poll, says when
        except StoreError as exc:  # its due row still says "look now": a poll will
            log.warning("worker.claim_unsettled", stream=stream, error=type(exc).__name__)

    def _try_lease(self, stream: str, now: float) -> bool:
        """Lease the stream's due work; on a race, fold what won and decide again.

        True when this worker leased it (the lease's append set the stream's due time:
        the lease's expiry).
        """
        for _ in range(LEASE_TRIES):
            state = self._states[stream]
            if stream in self._running and not self._lost_meanwhile(stream, state):
                return False
            if stream in self._uncertain and self._recover(stream, state, now):
                return True
            if not state.queue and state.lease is None:
                return False
            events = decide_lease(state, self._owner, now, self._policy)
            if not events:
                return False
            leased = events[-1] if isinstance(events[-1], ActivationLeased) else None
            claim = leased.epoch if leased is not None else _abandon_epoch(events)
            fence = Fence(claim, claim=True) if claim is not None else None
            news = [NewEvent(event=e, ts=now) for e in events]
            try:
                if self._queue is not None and leased is not None:
                    due = Due(leased.expires_at)  # what due_at folds from the new lease
                    self._queue.append(stream, news, state.version, fence=fence, due=due)
                else:
                    self._store.append(stream, news, expected_version=state.version, fence=fence)
            except (ConcurrencyError, FencedError):
                self._sync(stream)  # another worker, the Agent or an action appended first
                continue
            except StoreError as exc:  # it may or may not have been written: look again
                log.warning("worker.lease_uncertain", stream=stream, error=type(exc).__name__)
                self._uncertain.add(stream)
                return False
            try:
                self._sync(stream)
            except StoreError as exc:  # written, not read back: the next poll runs it
                if leased is not None:
                    log.warning("worker.lease_unread", stream=stream, error=type(exc).__name__)
                    self._uncertain.add(stream)
                    return False
            if leased is None:
                log.warning("worker.abandoned_on_expiry", stream=stream)
                if claim is not None:
                    self._gave_up(stream)
                return False
            self._start(stream, self._states[stream], leased)
            return True
        return False

    def _lost_meanwhile(self, stream: str, state: ActivationsState) -> bool:
        """Whether the lease of this worker's running wake of ``stream`` is gone in
        ``state``, a fold newer than the lease: a later epoch was claimed (an interrupt
        from another process, a takeover). The wake is stopped now, as the next renewal
        would find it fenced out (up to ``renew_every_ms`` later, while its model call
        ran on and the session's next message waited), and the stream is folded again:
        its work may be leased at once. False while the lease is still the stream's."""
        held = self._running[stream]
        if state.epoch <= held:
            return False
        if self._settled(stream, held):  # its own end came first: WakeEnded is on its way
            self._ended(WakeEnded(stream, held))
        else:
            claim = next((c for c in state.history if c.epoch == held), None)
            activation_id = claim.activation_id if claim is not None else ""
            self._lose(stream, held, activation_id, state.epoch)
        self._sync(stream)  # with the lease_lost just recorded
        return True

    def _recover(self, stream: str, state: ActivationsState, now: float) -> bool:
        """After a lease append that may or may not have been written, or a wake whose
        Agent could not start while the store was away, with ``state`` folded since: when
        the log holds this worker's live lease, run its wake (and renew at once: the lease
        was taken a while ago) rather than let it expire and count as a failure. True
        when it did."""
        self._uncertain.discard(stream)
        lease = state.lease
        if lease is None or lease.owner != self._owner or lease.expires_at <= now:
            return False
        log.info("worker.lease_recovered", stream=stream, epoch=lease.epoch)
        self._start(stream, state, lease)
        self._tell(_Renew(stream, lease.epoch))
        return True

    def _start(
        self, stream: str, state: ActivationsState, leased: ActivationLeased | Lease
    ) -> None:
        head = state.find(leased.activation_id)
        assert head is not None
        covered = [state.find(a) for a in leased.covers]
        wake = Wake(
            stream=stream,
            activation_id=leased.activation_id,
            kind=head.kind,
            epoch=leased.epoch,
            expires_at=leased.expires_at,
            activations=(head, *(a for a in covered if a is not None)),
        )
        self._running[stream] = leased.epoch
        log.info("worker.leased", stream=stream, epoch=leased.epoch, kind=head.kind)
        self._arm_renewal(stream, leased.epoch)
        error: str | None = None
        try:
            taken = self._wake(wake)
        except StoreUnavailableError as exc:  # the store is away: nothing was handed over
            log.warning("worker.wake_deferred", stream=stream, error=type(exc).__name__)
            self._ended(WakeEnded(stream, leased.epoch))
            self._uncertain.add(stream)  # the next poll that reads the log runs it again
            return
        except StoreError as exc:  # starting its Agent read or wrote the store, and failed
            taken, error = False, type(exc).__name__
        if taken is None:  # the process is stopping: the lease is kept for Release
            log.info("worker.wake_held", stream=stream, epoch=leased.epoch)
        elif not taken:  # no Agent takes it (it cannot start): a failed wake,
            log.warning("worker.wake_refused", stream=stream, error=error)  # retried, then
            self._failed(WakeFailed(stream, error_class="wake_refused"))  # given up

    def _next_due(self, now: float) -> float | None:
        """The earliest future time some session's work becomes due or a lease expires."""
        times: list[float] = []
        for stream, state in self._states.items():
            if stream in self._running:
                continue
            if state.lease is not None:
                times.append(state.lease.expires_at)
            elif state.blocked_on is None:
                times.extend(a.run_at for a in state.queue if a.run_at > now)
        return min(times) if times else None

    def _arm(self, due: float | None) -> None:
        at = self._clock.now() + self._poll_ms / 1000
        if due is not None:
            at = min(at, due)
        self._tick_at = at
        self._scheduler.schedule(at, self._tick, key=("worker:tick", self._owner))

    def _tick(self, at: float) -> None:
        self._tell(_Tick())

    # -- leases ---------------------------------------------------------------------------------

    def _arm_renewal(self, stream: str, epoch: int) -> None:
        at = self._clock.now() + self._policy.renew_every_ms / 1000
        key = ("worker:renew", self._owner, stream)
        self._scheduler.schedule(at, lambda _at: self._tell(_Renew(stream, epoch)), key=key)

    def _renew(self, message: _Renew) -> None:
        stream, epoch = message.stream, message.epoch
        if self._running.get(stream) != epoch:
            return
        now = self._clock.now()
        state = self._states.get(stream)
        activation_id = state.lease.activation_id if state and state.lease else ""
        renewed = LeaseRenewed(
            activation_id=activation_id,
            owner=self._owner,
            epoch=epoch,
            expires_at=now + self._policy.lease_ttl_ms / 1000,
        )
        try:
            self._store.append(stream, [NewEvent(event=renewed, ts=now)], fence=Fence(epoch))
        except FencedError as exc:
            if self._settled(stream, epoch):  # the Agent's WakeEnded is on its way
                self._ended(WakeEnded(stream, epoch))
                return
            self._lose(stream, epoch, activation_id, exc.current)
            return
        except StoreError as exc:
            log.warning("worker.renew_failed", stream=stream, error_class=type(exc).__name__)
        self._arm_renewal(stream, epoch)

    def _settled(self, stream: str, epoch: int) -> bool:
        """Whether the log shows the lease ``epoch`` settled by its wake (so a fenced
        renewal raced the next lease, by any worker, after a normal end: nothing was lost)."""
        with contextlib.suppress(StoreError):
            self._sync(stream)
        state = self._states.get(stream)
        history = state.history if state is not None else ()
        return any(c.epoch == epoch and c.ended in _SETTLED for c in history)

    def _lose(self, stream: str, epoch: int, activation_id: str, current: int) -> None:
        """The lease was taken over: stop the wake, record that this holder noticed."""
        self._running.pop(stream, None)
        self._scheduler.cancel(("worker:renew", self._owner, stream))
        if self._queue is not None:  # its fold is another holder's now: kept until it is due
            state = self._states.get(stream)
            self._let_go(stream, due_at(state) if state is not None else None)
        log.warning("worker.lease_lost", stream=stream, epoch=epoch, current=current)
        self._lost(LeaseLost(stream, epoch))
        lost = ActivationLeaseLost(
            activation_id=activation_id, owner=self._owner, epoch=epoch, current_epoch=current
        )
        with contextlib.suppress(StoreError):
            self._store.append(stream, [NewEvent(event=lost, ts=self._clock.now())])

    def _failed(self, message: WakeFailed) -> None:
        """Settle a failed wake: requeued with backoff, or abandoned."""
        epoch = self._running.get(message.stream)
        if epoch is None:  # it ended meanwhile (the lease was lost)
            return
        self._ended(WakeEnded(message.stream, epoch))
        until = self._clock.now() + self._policy.lease_ttl_ms / 1000
        self._settle_failed(_Unsettled(message, epoch, until))

    def _settle_pending(self) -> None:
        """Try again the settlements the store refused."""
        for unsettled in list(self._failing.values()):
            self._settle_failed(unsettled)

    def _settle_failed(self, unsettled: _Unsettled) -> None:
        """Append the settlement of a failed wake. When the store fails (the database is
        away: when Agents die), it is tried again at each poll until the lease would have
        expired (it is no longer renewed); after that the lease's expiry counts the
        failure instead, once either way (a settlement is fenced by the lease's epoch)."""
        message, epoch = unsettled.message, unsettled.epoch
        stream = message.stream
        self._failing.pop(stream, None)
        try:
            self._sync(stream)
            state = self._states[stream]
            lease = state.lease
            # settled (an earlier try's append was written after all; an abandonment is
            # said by the Agent the supervisor restarts), or taken over
            if lease is None or lease.epoch != epoch:
                return
            now = self._clock.now()
            result = WakeResult(status="failed", error_class=message.error_class, retryable=True)
            jitter = self._jitter_ms() if self._jitter_ms is not None else 0
            settlement = decide_settlement(
                state, lease.activation_id, epoch, result, now, self._policy, jitter_ms=jitter
            )
            self._store.append(stream, [NewEvent(event=settlement, ts=now)], fence=Fence(epoch))
        except FencedError:  # taken over meanwhile: the new holder decides
            log.warning("worker.settle_failed", stream=stream, error="FencedError")
            return
        except StoreError as exc:
            if self._clock.now() < unsettled.until:
                log.warning("worker.settle_deferred", stream=stream, error=type(exc).__name__)
                self._failing[stream] = unsettled
            else:  # the lease's expiry counts the failure
                log.warning("worker.settle_failed", stream=stream, error=type(exc).__name__)
            return
        if isinstance(settlement, ActivationAbandoned):
            self._gave_up(stream)

    def _release(self) -> int:
        """Hand back the lease of every wake still running (its Agent was stopped): a
        fenced ``activation:released``, so the next worker leases it at once and counts
        no failure. A lease the wake settled or another worker took is left alone."""
        self._settle_pending()  # now, if the store is back
        for stream in list(self._uncertain):  # a lease append that was written after all
            with contextlib.suppress(StoreError):
                self._sync(stream)
                lease = self._states[stream].lease
                if lease is not None and lease.owner == self._owner:
                    self._running.setdefault(stream, lease.epoch)
        self._uncertain.clear()
        released = 0
        for stream, epoch in list(self._running.items()):
            self._ended(WakeEnded(stream, epoch))
            try:
                done = self._release_one(stream, epoch)
            except StoreError as exc:  # fenced, or the store failed: the lease expires
                log.warning("worker.release_failed", stream=stream, error=type(exc).__name__)
                continue
            if done:
                released += 1
                log.info("worker.released", stream=stream, epoch=epoch)
        return released

    def _release_one(self, stream: str, epoch: int) -> bool:
        """Append the release of lease ``epoch`` of ``stream``, claiming the next epoch
        (the wake, should it still run, is fenced out from then on), at the version it
        was decided on: the wake appending first (its settlement) is folded and decided
        on again. False when the lease is no longer this worker's to hand back."""
        for _ in range(LEASE_TRIES):
            self._sync(stream)
            state = self._states[stream]
            decided = decide_release(state, self._owner, epoch)
            if decided is None:
                return False
            news = [NewEvent(event=decided, ts=self._clock.now())]
            fence = Fence(decided.claimed, claim=True)
            try:
                self._store.append(stream, news, expected_version=state.version, fence=fence)
            except ConcurrencyError:
                continue
            return True
        log.warning("worker.release_failed", stream=stream, error="ConcurrencyError")
        return False

    def _gave_up(self, stream: str) -> None:
        """An activation was abandoned: its session's Agent must tell the user."""
        log.error("worker.gave_up", stream=stream)
        if self._abandoned is None:
            return
        try:
            self._abandoned(Abandoned(stream))
        except StoreError as exc:  # its Agent could not be started: the log says it all
            log.error("worker.abandoned_untold", stream=stream, error=type(exc).__name__)

    def _ended(self, message: WakeEnded) -> None:
        if self._running.get(message.stream) == message.epoch:
            del self._running[message.stream]
            self._scheduler.cancel(("worker:renew", self._owner, message.stream))
            self._look_later(message.stream, self._clock.now())

    def _tell(self, message: object) -> None:
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(message)


def _abandon_epoch(events: list[Event]) -> int | None:
    """An abandonment on expiry claims its epoch (so the dead holder is fenced out)."""
    for event in events:
        if isinstance(event, ActivationAbandoned):
            return event.epoch
    return None
