"""The ContextStore's summarizer ledger: one stream per tenant in the event store.

Every worker on a store (LMDB shared by processes, or PostgreSQL) admits a tenant's
summarizer calls through the tenant's stream, ``context-ledger:<tenant>`` (see
:func:`ledger_stream`), so the spend caps and the breaker hold across them, and every
verdict can be re-derived from the log:

1. fold the stream from where this worker last read it;
2. decide (pure, at the clock's reading);
3. append ``context:summarizer_reserved`` with the version folded as the expected
   version: when another worker appended first, the append conflicts and the worker
   folds again and decides again.

A refusal is recorded the same way (``context:summarizer_refused``, with the version
folded expected), once while neither the ledger nor the verdict changes: a worker refused
for every summary of an assembly writes one refusal, not one per summary.

Each decision is made at the clock's reading, or at the ledger's newest record's time
when that is later (another worker's clock ahead of this one's): spend recorded "after"
a worker's clock would otherwise be left out of its windows, and its cap passed. It goes
at most :data:`MAX_LEAD_S` past the clock: a record further ahead is a host's clock gone
wrong (logged once, ``context_ledger.clock_ahead``), and following it would record every
later call at that one time, so the windows would stop moving and the caps refuse every
call until the clocks reached it.

A call's end, ``context:summarizer_released``, needs no expected version (it only frees
what its reservation held). When it cannot be appended (the store is down), it is kept
and appended before the next admission; until then the reservation counts, at most for
its lease.

The stream's first event, ``context:ledger_opened``, carries the governor folded from the
``context:<session>`` streams for a log that is older than the ledger: spend and
breaker counts made before the upgrade still hold. That fold is recorded too, in
``context-legacy`` (``context:legacy_counted``, with the log position it covers), so a
worker starts from the last count and reads only the records after it, not every
session's stream again (see :func:`count_legacy`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable
from operator import attrgetter

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.context import Decide
from stalwart.errors import ConcurrencyError, InvalidStreamError
from stalwart.events import (
    ContextLedgerOpened,
    ContextLegacyCounted,
    ContextSummarizerFailed,
    ContextSummarizerRefused,
    ContextSummarizerReleased,
    ContextSummarizerReserved,
    ContextSummaryCreated,
    LegacyGovernor,
    RecordedEvent,
)
from stalwart.ids import new_id
from stalwart.state import (
    DAY_S,
    SUMMARIZER_LEDGER,
    GovernorFolder,
    GovernorState,
    SummarizerVerdict,
    apply_governor_event,
    refusal,
)
from stalwart.store import (
    DEFAULT_SNAPSHOT_EVERY,
    EventStore,
    NewEvent,
    StreamInfo,
    check_stream,
    load_state,
    save_snapshot,
    snapshot_name,
)

__all__ = [
    "LEDGER_STREAM",
    "LEGACY_STREAM",
    "TENANT_LEDGER",
    "StoreLedger",
    "TenantLedger",
    "count_legacy",
    "governor_records",
    "ledger_stream",
]

log = get_logger(__name__)

#: the ledger of the sessions that name no tenant; a tenant's is ``context-ledger:<tenant>``
LEDGER_STREAM = "context-ledger"
#: the legacy count's stream: the governors the ``context:`` streams recorded for the
#: tenants that had no ledger yet (``context:legacy_counted``)
LEGACY_STREAM = "context-legacy"
#: a stream's records after a count are found by halving its versions down to a run
#: this short, which is then read
READ_RUN = 32
#: how many times an admission folds and decides again when other workers keep
#: appending to the same ledger first
ADMIT_ATTEMPTS = 64
#: how far past its own clock a worker follows the ledger's newest record (see the module)
MAX_LEAD_S = 300.0


def ledger_stream(tenant: str | None) -> str:
    """The stream of ``tenant``'s summarizer ledger. A tenant whose name cannot be part
    of a stream id (too long, not UTF-8) gets one named by its SHA-256."""
    if tenant is None:
        return LEDGER_STREAM
    stream = f"{LEDGER_STREAM}:{tenant}"
    try:
        check_stream(stream)
    except InvalidStreamError:
        digest = hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()
        return f"{LEDGER_STREAM}#sha256:{digest}"
    return stream


class TenantLedger(msgspec.Struct, frozen=True, kw_only=True):
    """A ledger stream's governor and the version it was folded to (what an admission
    expects: the version must be the fold's own, never read beside it)."""

    governor: GovernorState
    version: int = 0


class _TenantLedgerFolder:
    __slots__ = ("governor", "version")

    def __init__(self, state: TenantLedger) -> None:
        self.governor = SUMMARIZER_LEDGER.folder(state.governor)
        self.version = state.version

    def add(self, record: RecordedEvent) -> None:
        self.governor.add(record)
        self.version = record.version

    def state(self) -> TenantLedger:
        return TenantLedger(governor=self.governor.state(), version=self.version)


class TenantLedgerAggregate:
    """:data:`~stalwart.state.SUMMARIZER_LEDGER` with its version, for ``load_state``: a
    worker's first admission for a tenant starts from the ledger's snapshot (saved every
    ``snapshot_every`` events folded past the last one), not from its first event."""

    name = "tenant_ledger"
    #: follows the governor's fold (a change of it changes this snapshot's content)
    version = SUMMARIZER_LEDGER.version
    state_type = TenantLedger

    def initial(self, stream: str) -> TenantLedger:
        return TenantLedger(governor=SUMMARIZER_LEDGER.initial(stream))

    def apply(self, state: TenantLedger, record: RecordedEvent) -> TenantLedger:
        folder = self.folder(state)
        folder.add(record)
        return folder.state()

    def folder(self, state: TenantLedger) -> _TenantLedgerFolder:
        return _TenantLedgerFolder(state)


TENANT_LEDGER = TenantLedgerAggregate()


class _Folded:
    """A tenant's ledger as this worker folded it: the governor's fold, the version (and
    position) of the newest record folded, the latest time of a record folded (from a
    snapshot: of its spend, releases and failures), and the version the next snapshot
    is due at."""

    __slots__ = ("due", "folder", "latest", "position", "version")

    def __init__(self, governor: GovernorState, version: int, due: int) -> None:
        self.folder = GovernorFolder(governor)
        self.version = version
        self.position = 0  # none folded yet past the loaded state
        self.latest = _newest(governor)
        self.due = due


def _newest(governor: GovernorState) -> float:
    """The latest time ``governor`` recorded spend, a release or a failure at."""
    times = [ts for ts, _ in governor.spend] + [ts for ts, _ in governor.released]
    return max(times, default=governor.last_failure_at or 0.0)


class StoreLedger:
    """A :class:`~stalwart.context.SummarizerLedger` over an event store (see the module).
    Lanes admit side by side: the store's expected version orders their admissions as it
    orders other workers'."""

    def __init__(
        self,
        store: EventStore,
        clock: Clock,
        *,
        lease_ms: int,
        make_id: Callable[[], str] = new_id,
    ) -> None:
        self._store = store
        self._clock = clock
        self._lease_ms = lease_ms
        self._make_id = make_id
        #: per tenant: its governor's fold, the ledger's version and time it folded
        self._folded: dict[str | None, _Folded] = {}
        #: per tenant: held while its ledger is folded (lanes admit side by side)
        self._folding: dict[str | None, threading.Lock] = {}
        #: releases not appended yet (the store refused them), oldest first
        self._unreleased: list[tuple[str, NewEvent]] = []
        #: per tenant: the ledger's version after this worker's last refusal, and its rule
        #: and numbers
        self._refused: dict[str | None, tuple[int, tuple[object, ...]]] = {}
        #: the governors folded from the ``context:`` streams (older logs), once
        self._legacy: dict[str | None, GovernorState] | None = None
        #: held while the releases are flushed
        self._lock = threading.Lock()
        #: held while the older logs are counted (a tenant with a ledger admits meanwhile)
        self._counting = threading.Lock()
        #: the tenants whose ledger was found too far ahead of the clock (said once each)
        self._ahead: set[str | None] = set()

    def governor(self, tenant: str | None) -> GovernorState:
        return self._fold(tenant)[0]

    def admit(
        self, tenant: str | None, session: str | None, tokens: int, decide: Decide
    ) -> tuple[SummarizerVerdict, ContextSummarizerReserved | None]:
        self._flush()
        stream = ledger_stream(tenant)
        for _ in range(ADMIT_ATTEMPTS):
            state, version, latest = self._fold(tenant)
            now = self._ledger_now(tenant, latest)
            first: list[NewEvent] = []
            if version == 0:  # a new ledger: it opens with what older records hold
                opened = self._opening(tenant, now)
                first.append(NewEvent(event=opened, ts=now))
                state = apply_governor_event(state, opened, now)
            verdict = decide(state, now)
            if not verdict.allowed:
                refused = refusal(verdict, tenant=tenant, session=session, tokens=tokens)
                if self._refused.get(tenant) == (version, _rule(refused)):
                    return verdict, None  # recorded already, on this very ledger
                recorded: ContextSummarizerRefused | ContextSummarizerReserved = refused
            else:
                recorded = ContextSummarizerReserved(
                    call_id=self._make_id(),
                    tenant=tenant,
                    session=session,
                    tokens=tokens,
                    trial=verdict.trial,
                    lease_ms=self._lease_ms,
                )
            event = NewEvent(event=recorded, ts=now)
            try:
                self._store.append(stream, [*first, event], expected_version=version)
            except ConcurrencyError:
                continue  # another worker appended first: fold it, decide again
            if isinstance(recorded, ContextSummarizerRefused):
                self._refused[tenant] = (version + len(first) + 1, _rule(recorded))
                return verdict, None
            return verdict, recorded
        raise ConcurrencyError(stream, version, self._store.stream_version(stream))

    def release(self, end: ContextSummarizerReleased) -> None:
        stream = ledger_stream(end.tenant)
        # at the ledger's time as the admission was (never before its own reservation: a
        # success recorded before the breaker's last failure would not close it)
        known = self._folded.get(end.tenant)
        now = self._ledger_now(end.tenant, known.latest if known is not None else 0.0)
        self._unreleased.append((stream, NewEvent(event=end, ts=now)))
        self._flush()

    def _ledger_now(self, tenant: str | None, latest: float) -> float:
        """The time to decide and record at: the clock's reading, or the ledger's newest
        record's time ``latest`` when that is later (another worker's clock is ahead), but
        never more than :data:`MAX_LEAD_S` past the clock (a clock gone wrong, said once)."""
        now = self._clock.now()
        if latest <= now + MAX_LEAD_S:
            return max(now, latest)
        if tenant not in self._ahead:
            self._ahead.add(tenant)
            log.warning(
                "context_ledger.clock_ahead",
                stream=ledger_stream(tenant),
                lead_s=round(latest - now),
                max_lead_s=MAX_LEAD_S,
            )
        return now + MAX_LEAD_S

    def _flush(self) -> None:
        """Append the releases the store refused before, oldest first."""
        with self._lock:
            while self._unreleased:
                stream, event = self._unreleased[0]
                try:
                    self._store.append(stream, [event])
                except Exception as exc:
                    log.warning(
                        "context_ledger.release_not_recorded",
                        stream=stream,
                        waiting=len(self._unreleased),
                        error_class=type(exc).__name__,
                        error_kind="dependency",
                    )
                    return
                self._unreleased.pop(0)

    def _fold(self, tenant: str | None) -> tuple[GovernorState, int, float]:
        """The tenant's governor with what its ledger gained since the last fold (the
        first fold starts from the ledger's snapshot), the version it was folded to and
        the time of the newest record folded. A snapshot is saved every twice
        ``snapshot_every`` records folded (see :meth:`_keep`), so a worker that ran for
        months leaves the next one as little to fold as one that had just started."""
        stream = ledger_stream(tenant)
        with self._lock:
            folding = self._folding.setdefault(tenant, threading.Lock())
        with folding:
            known = self._folded.get(tenant)
            if known is None:
                known = self._start(tenant, stream)
            folder = known.folder
            try:
                for record in self._store.read_stream(stream, known.version + 1):
                    folder.add_event(record.event, record.ts)
                    known.version, known.position = record.version, record.position
                    known.latest = max(known.latest, record.ts)
            except BaseException:
                # the folder took in part of the read (a store that went away between two
                # batches): folded again from the version it holds, those records would
                # count twice, so the next fold starts again from the snapshot
                self._folded.pop(tenant, None)
                raise
            self._folded[tenant] = known
            governor = folder.state()
            self._keep(stream, known, governor)
            return governor, known.version, known.latest

    def _start(self, tenant: str | None, stream: str) -> _Folded:
        """The tenant's fold from the ledger's snapshot and the records after it."""
        start = load_state(self._store, stream, TENANT_LEDGER)
        governor = start.governor if start.version else GovernorState(tenant=tenant)
        return _Folded(governor, start.version, start.version + self._snapshot_every())

    def _snapshot_every(self) -> int:
        """Records folded between two snapshots of a ledger this worker folds as it goes:
        twice the store's cadence (a ledger's snapshot holds the day's spend and release
        ids, thousands of entries); 0 when the store saves none."""
        every: int = getattr(self._store, "snapshot_every", DEFAULT_SNAPSHOT_EVERY)
        return 2 * every if every > 0 else 0

    def _keep(self, stream: str, known: _Folded, governor: GovernorState) -> None:
        """Save the ledger's snapshot when it is due: ``load_state`` saves one only at a
        worker's first fold, so without these the next worker to start would fold every
        record since this one started (a month at 8,000 calls a day: 480,000, 1.8 s)."""
        every = self._snapshot_every()
        if every <= 0 or known.position == 0 or known.version < known.due:
            return
        state = TenantLedger(governor=governor, version=known.version)
        name = snapshot_name(TENANT_LEDGER)
        if save_snapshot(self._store, stream, name, known.version, known.position, state):
            known.due = known.version + every
        else:  # a snapshot only saves time: the governor is still right
            known.due = known.version + 1  # tried again at the next fold

    def _opening(self, tenant: str | None, now: float) -> ContextLedgerOpened:
        with self._counting:
            if self._legacy is None:
                self._legacy = count_legacy(self._store, now)
            legacy = self._legacy.get(tenant) or GovernorState(tenant=tenant)
        return ContextLedgerOpened(
            tenant=tenant,
            spend=tuple(entry for entry in legacy.spend if entry[0] > now - DAY_S),
            consecutive_failures=legacy.consecutive_failures,
            last_failure_at=legacy.last_failure_at,
        )


def _rule(refusal: ContextSummarizerRefused) -> tuple[object, ...]:
    """What makes a refusal another one: its rule and numbers (not its session or
    estimate: on the same ledger, those are the same refusal)."""
    return (refusal.reason, refusal.knob, refusal.used, refusal.limit, refusal.until)


def count_legacy(store: EventStore, now: float) -> dict[str | None, GovernorState]:
    """The governors of the tenants with no ledger yet, as the ``context:`` streams record
    them: the last count (``context:legacy_counted`` in :data:`LEGACY_STREAM`) and the
    records after the position it covers. When there were any, the result is recorded as
    the next count, with the last one's version expected: of workers counting at once,
    one records (the others' counts are as good: each covers the head it read first).

    A count covers positions, not streams: a session's stream that grew after it (an
    older stalwart, which knows no ledger, wrote a summary there) is read from its
    first record after the count."""
    version = store.stream_version(LEGACY_STREAM)
    counted = _last_count(store, version)
    covers = 0 if counted is None else counted.covers
    head = store.head()  # first: every record up to it is in the listing below
    infos = store.streams()
    changed = [
        info for info in infos if info.stream.startswith("context:") and covers < info.last_position
    ]
    ledgers = {info.stream for info in infos if info.stream.startswith(LEDGER_STREAM)}
    folded = {} if counted is None else _folders(counted)
    for record in governor_records(store, changed, after=covers, upto=head):
        owner = getattr(record.event, "tenant", None)
        if ledger_stream(owner) in ledgers:
            continue  # its ledger is open: what it spends is recorded there
        folder = folded.get(owner)
        if folder is None:
            folder = folded[owner] = GovernorFolder(GovernorState(tenant=owner))
        folder.add_event(record.event, record.ts)
    governors = _kept(folded, ledgers, now)
    if changed and head > covers:
        count = ContextLegacyCounted(
            covers=head,
            governors=tuple(_legacy_governor(governor) for governor in governors.values()),
        )
        # another worker may have recorded its count first: this one is as good
        with contextlib.suppress(ConcurrencyError):
            store.append(LEGACY_STREAM, [NewEvent(event=count, ts=now)], expected_version=version)
    return governors


def _last_count(store: EventStore, version: int) -> ContextLegacyCounted | None:
    for record in store.read_stream(LEGACY_STREAM, version, version) if version else ():
        if isinstance(record.event, ContextLegacyCounted):
            return record.event
    return None


def _folders(counted: ContextLegacyCounted) -> dict[str | None, GovernorFolder]:
    return {
        governor.tenant: GovernorFolder(
            GovernorState(
                tenant=governor.tenant,
                spend=governor.spend,
                consecutive_failures=governor.consecutive_failures,
                last_failure_at=governor.last_failure_at,
            )
        )
        for governor in counted.governors
    }


def _kept(
    folded: dict[str | None, GovernorFolder], ledgers: set[str], now: float
) -> dict[str | None, GovernorState]:
    """The governors a ledger opened from now on can start from: those of tenants with
    no ledger, their spend within the day before ``now``, none left as it started."""
    kept: dict[str | None, GovernorState] = {}
    for tenant, folder in folded.items():
        if ledger_stream(tenant) in ledgers:
            continue
        state = folder.state()
        spend = tuple(entry for entry in state.spend if entry[0] > now - DAY_S)
        governor = GovernorState(
            tenant=tenant,
            spend=spend,
            consecutive_failures=state.consecutive_failures,
            last_failure_at=state.last_failure_at,
        )
        if governor != GovernorState(tenant=tenant):
            kept[tenant] = governor
    return kept


def _legacy_governor(state: GovernorState) -> LegacyGovernor:
    return LegacyGovernor(
        tenant=state.tenant,
        spend=state.spend,
        consecutive_failures=state.consecutive_failures,
        last_failure_at=state.last_failure_at,
    )


def governor_records(
    store: EventStore, streams: list[StreamInfo], *, after: int = 0, upto: int | None = None
) -> list[RecordedEvent]:
    """What the tenants' summarizer governors fold from ``streams`` (``context:`` ones)
    at positions after ``after`` and up to ``upto``, in log order: a tenant's sessions
    interleave, and its breaker counts failures in the order they came, across them.
    Summaries are kept without their bodies."""
    found: list[RecordedEvent] = []
    for info in streams:
        for record in store.read_stream(info.stream, _first_after(store, info, after)):
            if upto is not None and record.position > upto:
                break
            if record.position <= after:
                continue
            event = record.event
            if isinstance(event, ContextSummaryCreated):
                bare = msgspec.structs.replace(event, body="", covers=(), topics=())
                found.append(msgspec.structs.replace(record, event=bare))
            elif isinstance(event, ContextSummarizerFailed):
                found.append(record)
    found.sort(key=attrgetter("position"))
    return found


def _first_after(store: EventStore, info: StreamInfo, after: int) -> int:
    """A version of ``info.stream`` at or before its first record stored after position
    ``after``. Positions have no gaps, so at most ``info.last_position - after`` of its
    records are after it; the rest is halved down to :data:`READ_RUN` versions."""
    low = max(1, info.version - (info.last_position - after) + 1)
    high = info.version
    if high - low > READ_RUN and _stored_after(store, info.stream, low, after):
        return low
    while high - low > READ_RUN:
        middle = (low + high) // 2
        if _stored_after(store, info.stream, middle, after):
            high = middle
        else:
            low = middle + 1
    return low


def _stored_after(store: EventStore, stream: str, version: int, after: int) -> bool:
    """Whether ``stream``'s record at ``version`` is stored after position ``after`` (a
    version not found reads as after: the halving then reads more, never less)."""
    return all(record.position > after for record in store.read_stream(stream, version, version))
