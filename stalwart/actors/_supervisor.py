"""Supervisor: the sub-agent safety nets of seeds 000 and 002 (layers 2 and 3).

* **Ghost sweep** (every ``ghost_sweep_interval_ms``): folds every run from the log (each
  ``session:*`` stream that starts with ``subagent:spawned``) and appends
  ``subagent:ghost_swept`` to each run :func:`~stalwart.state.decide_ghost` finds due. It
  reads only the log, so it catches a run a crashed process left ``running``. Each sweep
  reads the log from the head the one before read, and reads again only the runs
  appended to there and the streams a run began in (a session that is no run costs
  nothing, and nothing is kept of it). A run with nothing left to decide
  (:func:`settled`) is set aside after each sweep: only its version is kept, and it is
  folded again when its stream moves on (``GetRuns`` reads it back).
* **Its start**: the sweeps' index of every run is saved as a snapshot
  (:class:`RunIndex`) with the log position it covers; a supervisor that starts loads the
  newest one and reads the log from there. Without one (none saved, or none that can be
  read) its first sweep lists every stream and reads the first records of each session
  stream, :data:`LOOK_CHUNK` streams per message it tells itself, so what it is told
  meanwhile (crashes, run ends, send outcomes) is handled between two chunks.
* **Heartbeat sweep** (every ``heartbeat_interval_ms``, detection only):
  :func:`~stalwart.state.decide_suspicious` -> ``subagent:suspicious``; it never kills.
* **Failure notice** for a run that ended ``timed_out``, ``swept`` or ``failed``: static
  text (:func:`~stalwart.actors.failure_notice`), ``announcement:queued``, a send through
  the parent's announcement system (``announcer``) bounded by ``announce_timeout_ms``; on
  failure ``announcement:fallback_direct`` and a direct send on the run's channel; if that
  fails too, ``announcement:send_failed`` and an :class:`Enqueue` to the dead-letter
  actor. A notice is never lost and never sent twice on one path. When the announce
  send's receiver asked to be left alone (its Retry-After, recorded on the fallback) and
  the direct send goes to it too (no ``announcer``: both go on the run's channel), the
  direct send waits that long (at most ``MAX_NOTICE_HOLD_MS``): a timer keyed by the
  run; a supervisor that starts meanwhile reads the hold from the log.
* **Recovery**: :func:`~stalwart.state.decide_recovery` -> ``subagent:recovery_decided``;
  a respawn goes through the host's ``spawner`` as a :class:`Spawn` with ``attempt + 1``
  (and the continuation context after the task for ``respawn_continue``). When the run's
  lineage has a splitter (``splitters(run_id)``), an exhausted run is ``split``: the
  splitter is called here, on the supervisor's thread (so it must be cheap: no I/O), with
  the task and the continuation context; its subtasks are recorded in the event and each
  goes through the ``spawner`` as a first attempt. A splitter that raises or gives no
  subtask turns the decision into ``escalate`` (``splitter_failed:<error class>`` or
  ``splitter_empty``).
* **Next runs never started**: a run's ``subagent:spawned`` names the id its recovery
  gives the next run (:func:`next_run_ids`); one the log does not hold
  ``ghost_sweep_interval_ms`` after the decision (its process died or closed before the
  spawner call, or the spawner raised) goes through the ``spawner`` again. Its spawn
  expects an empty stream, so two supervisors starting it start one run.

The supervisor writes these decisions into the run's own stream, always expecting the
version it folded: a live SubAgent's writes are never raced; on a conflict it reads what
was added, folds it and decides again. Runs are settled (notice, recovery) when told
:class:`RunEnded` and at every sweep, so a run that ended while nobody listened is settled
too. One timer, keyed by the actor, at the earlier of the two sweeps.

* **Completions a crash lost**: a run that succeeded and recorded ``announce=True`` but
  whose completion announcement is not in its stream ``announce_max_wait_ms +
  announce_timeout_ms`` after it ended (the announcer or its process died with the
  batch), or whose announcement was queued that long ago and never ended (a crash cut
  its send), is announced at a sweep with a direct send on the run's channel (the
  interrupted one again with its own id, once per batch); a failed send goes to the
  dead-letter queue. A result is never lost.
* **Restarts** (``supervision``): a supervised actor that crashed tells :class:`Crashed`;
  one_for_one with restart intensity and backoff (:mod:`._restarts`). A run's actor given
  up on ends its run: ``subagent:given_up`` (status ``failed``), then the notice and the
  recovery decision as above.

A run this supervisor ends (swept, given up) is handed to ``on_run_ended`` as a
:class:`RunEnded` (the runtime resolves the run's handle and stops its actor), since the
run's own actor will never tell it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Literal, cast

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.channels import (
    Channel,
    MessageKind,
    OutboundMessage,
    RetryAfterNoted,
    channel_named,
)
from stalwart.clock import Clock
from stalwart.config import SubagentSettings, SupervisionSettings
from stalwart.errors import ConcurrencyError, CorruptRecordError, StoreError
from stalwart.events import (
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    RecordedEvent,
    SubagentGivenUp,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SupervisorGaveUp,
)
from stalwart.ids import new_id
from stalwart.state import (
    RUN,
    RunState,
    batch_text,
    continuation_context,
    decide_ghost,
    decide_suspicious,
    notice_outcome,
)
from stalwart.store import DEFAULT_SNAPSHOT_EVERY, EventStore, NewEvent, StreamInfo

from ._deadletter import Enqueue, dead_letter
from ._portal import IoPortal
from ._restarts import Crashed, RestartNoticeSent, Restarts, crashed, tell_later
from ._scheduler import Scheduler
from ._send import RESEND_GRACE_S, noting, retry_after_of, send_by_clock
from ._subagent import RunEnded, RunOutcome, Spawn
from ._subagent_notice import UNRECORDED_TASK, NoticeSent, Path, failure_notice, sent
from ._supervised import Supervised
from ._supervisor_fold import (
    RUN_WATCH,
    UNSUCCESSFUL,
    RunIndex,
    RunWatch,
    completion_interrupted,
    load_index,
    next_run_ids,
    notice_interrupted,
    owed_completion,
    recovery,
    respawn,
    save_index,
    settled,
    split_spawns,
)

__all__ = ["GetRuns", "Recovered", "SupervisorActor", "Sweep", "SweepReport"]

log = get_logger(__name__)

#: How many append conflicts in a row the supervisor folds and retries before it fails.
MAX_CONFLICTS = 64
#: How many records of a stream not yet folded are read to see whether it is a run (a
#: run's stream starts with its spawn, and most runs are shorter than this).
FIRST_READ = 8
#: How many listed streams a sweep that lists every stream reads per message it tells
#: itself (about 10 ms of reads on LMDB): its mailbox is handled between two chunks.
LOOK_CHUNK = 256


class Sweep(msgspec.Struct, frozen=True):
    """Run both sweeps now; ``ask`` replies with a :class:`SweepReport`."""


class _Due(msgspec.Struct, frozen=True):
    at: float


class _CompletionSent(msgspec.Struct, frozen=True):
    outcome: NoticeSent


class _HoldEnded(msgspec.Struct, frozen=True):
    """The receiver's Retry-After ran out: the run's notice goes directly now, if the log
    still records the hold this was scheduled for (the fallback at ``notice_at``)."""

    stream: str
    announcement_id: str
    notice_at: float


class _Look(msgspec.Struct, frozen=True):
    """Read the next chunk of the listing under way (told by the supervisor to itself)."""


class _Listing:
    """A listing of the session streams that moved, read a chunk at a time; the sweep it
    is for (``ghosts``, ``heartbeats``) runs once every stream in it is read."""

    __slots__ = ("ghosts", "head", "heartbeats", "read", "streams")

    def __init__(
        self, head: int, streams: dict[str, int], *, ghosts: bool, heartbeats: bool
    ) -> None:
        self.head = head  # the log's head before the rows were listed
        self.streams = list(streams.items())
        self.read = 0  # how many of them are read
        self.ghosts = ghosts
        self.heartbeats = heartbeats

    def rest(self, size: int | None = None) -> list[tuple[str, int]]:
        """The next ``size`` streams not read yet (all of them: None), with their versions."""
        end = None if size is None else self.read + size
        return self.streams[self.read : end]


class GetRuns(msgspec.Struct, frozen=True):
    """Ask for every run the supervisor folded: ``{stream: RunWatch}``."""


class SweepReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one sweep appended: the streams swept as ghosts and found suspicious."""

    swept: tuple[str, ...] = ()
    suspicious: tuple[str, ...] = ()


class Recovered(msgspec.Struct, frozen=True, kw_only=True):
    """Told to listeners once ``subagent:recovery_decided`` is in the run's log;
    ``next_run_id`` names the respawned run (None when nothing was respawned)."""

    stream: str
    action: str
    reason: str
    context: str = ""
    next_run_id: str | None = None
    #: ``split``: the runs spawned for the subtasks
    next_run_ids: tuple[str, ...] = ()


Spawner = Callable[[Spawn], object]
#: the host's ``(task, context) -> subtasks``
Splitter = Callable[[str, str], Sequence[str]]
#: the splitter of a run's lineage, given the run's id; None for none
Splitters = Callable[[str], Splitter | None]
#: ``works(run_id)``: whether this process holds the host code of the run's lineage (so
#: a respawn, whose :class:`Spawn` names the run in ``retry_of``, can run it again). By
#: run, never by its text: runs of one parent may share a task and each have a work.
Works = Callable[[str], bool]


class SupervisorActor(Supervised):
    """Ghost and heartbeat sweeps, failure notices and recovery of sub-agent runs.

    Start with ``SupervisorActor.start(store=..., clock=..., scheduler=..., portal=...,
    channels={name: channel}, dead_letters=<DeadLetterActor ref>, spawner=...,
    settings=SubagentSettings(), announce_timeout_ms=30_000, announcer=None,
    default_channel="", listeners=(), supervision=SupervisionSettings(),
    splitters=None, works=None)``.
    ``announcer`` is the parent's announcement system (any
    :class:`~stalwart.channels.Channel`); without one the announce send goes to the run's
    channel too. Tell it :class:`RunEnded` (and :class:`Crashed`); ask :class:`Sweep` or
    :class:`GetRuns`.
    """

    def __init__(
        self,
        *,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        channels: Mapping[str, Channel],
        dead_letters: pykka.ActorRef[Any] | None = None,
        spawner: Spawner | None = None,
        settings: SubagentSettings | None = None,
        announce_timeout_ms: int = 30_000,
        announcer: Channel | None = None,
        default_channel: str = "",
        listeners: Sequence[pykka.ActorRef[Any]] = (),
        supervision: SupervisionSettings | None = None,
        splitters: Splitters | None = None,
        works: Works | None = None,
        on_crash: Callable[[str], object] | None = None,
        runtime: str = "",
        on_run_ended: Callable[[RunEnded], object] | None = None,
        retell: Callable[[object], object] | None = None,
        hand_over: Callable[[list[Any]], object] | None = None,
    ) -> None:
        super().__init__()
        #: what this supervisor's unhandled mail goes to when it dies, in one piece (the
        #: runtime's ref: kept ahead of what is told meanwhile); None: told on one by one
        self._hand_over_to = hand_over
        self._on_crash = on_crash  # called once if this actor dies of an exception
        self._on_run_ended = on_run_ended
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._channels = dict(channels)
        self._dead_letters = dead_letters
        self._spawner = spawner
        self._splitters = splitters
        self._works = works
        self._settings = settings or SubagentSettings()
        self._announce_s = announce_timeout_ms / 1000
        self._announce_ms = announce_timeout_ms
        #: how long after a success its announcement is owed (see owed_completion)
        self._completion_wait_s = (self._settings.announce_max_wait_ms + announce_timeout_ms) / 1000
        self._announcer = announcer
        self._default_channel = default_channel
        self._listeners = tuple(listeners)
        self._restarts = Restarts(
            store=store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels=self._channels,
            dead_letters=dead_letters,
            settings=supervision or SupervisionSettings(),
            send_timeout_s=self._announce_s,
            default_channel=default_channel,
            tell=self._tell_on,
            key=self.actor_urn,
            runtime=runtime,
            end_run=self._given_up,
            retry=retell,
        )
        #: how a message whose record met a store error is told again (the runtime's
        #: reaches this actor's successor too)
        self._retell = retell or self._tell
        #: the runs in play: what the sweeps decide on
        self._runs: dict[str, RunWatch] = {}
        #: the runs set aside (nothing left to decide): the version each was folded at, so
        #: the sweeps and memory follow the runs in play, not every run ever seen; and the
        #: completion ids of those that had one (a batch's resend looks for its outcome)
        self._settled: dict[str, int] = {}
        self._settled_batches: set[str] = set()
        #: the streams left out of the sweeps for good (a record or row cannot be read)
        self._left_alone: set[str] = set()
        #: the log's head when the sweeps last looked: every session stream that moved
        #: since is found by reading the log from there (:meth:`_refresh`)
        self._looked_to = 0
        #: whether the next sweep lists every stream's row instead (the first one without
        #: a saved index, and one after a sweep that failed or a log record that could
        #: not be read)
        self._list_rows = True
        #: a listing being read a chunk at a time (:meth:`_look_on`)
        self._look: _Listing | None = None
        #: the log position the newest run index saved or loaded covers (:meth:`_keep_index`)
        self._index_at = 0
        self._snapshot_every: int = getattr(store, "snapshot_every", DEFAULT_SNAPSHOT_EVERY)
        #: announcement id -> the ids of its sends in flight (a resend may be under way
        #: while a late outcome of the send before it is recorded)
        self._sending: dict[str, set[str]] = {}
        #: the failed runs whose recorded next runs are not all in the log yet (kept in
        #: play until they are), and when this supervisor last gave each such next run's
        #: stream to the spawner
        self._unstarted: set[str] = set()
        self._asked: dict[str, float] = {}
        #: the runs set aside while a next run they name is not in the log and this
        #: process cannot start it (a process holding its code may: saved to be reread)
        self._unavailable: set[str] = set()
        self._timer_key = ("supervisor", self.actor_urn)
        #: the runs whose notice's direct send waits for a receiver's Retry-After
        self._holding: set[str] = set()
        self._look_key = ("supervisor-look", self.actor_urn)
        self._next_ghost = 0.0
        self._next_heartbeat = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    def started(self) -> None:
        now = self._clock.now()
        self._next_ghost = now + self._settings.ghost_sweep_interval_ms / 1000
        self._next_heartbeat = now + self._settings.heartbeat_interval_ms / 1000
        self._restore_index()
        self._sweep_soon(ghosts=True, heartbeats=True)  # what a crash left behind, at once
        self._arm()

    def on_stop(self) -> None:
        self._scheduler.cancel(self._timer_key)
        self._scheduler.cancel(self._look_key)
        for stream in self._holding:  # the log says the send is owed: the next one sends
            self._scheduler.cancel(self._hold_key(stream))

    def on_failure(self, *exc_info: object) -> None:
        self._scheduler.cancel(self._timer_key)
        self._scheduler.cancel(self._look_key)
        self._hand_over(self.take_inbox())
        crashed(self._on_crash, exc_info)

    def _hand_over(self, told: list[Any]) -> None:
        """What was told to this supervisor and never handled, for its successor (through
        ``hand_over`` in one piece, ahead of what is told meanwhile; without it, through
        ``retell`` one by one): pykka would drop it, and a :class:`Crashed` lost here
        would leave its actor down for good, with nothing in the log. Sweeps and timers
        are not handed over: the successor sweeps as it starts. (Each message is safe to
        tell again.)"""
        kept = [message for message in told if isinstance(message, _HANDED_OVER)]
        if not kept:
            return
        log.warning("supervisor.mail_handed_over", count=len(kept))
        if self._hand_over_to is not None:
            with contextlib.suppress(pykka.ActorDeadError):  # the runtime's ref keeps it all
                self._hand_over_to(kept)
                return
        for message in kept:
            self._tell_on(message)

    # -- messages ----------------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        match message:
            case _Due(at=at):
                ghosts, heartbeats = at >= self._next_ghost, at >= self._next_heartbeat
                if ghosts:
                    self._next_ghost = at + self._settings.ghost_sweep_interval_ms / 1000
                if heartbeats:
                    self._next_heartbeat = at + self._settings.heartbeat_interval_ms / 1000
                try:
                    self._sweep_soon(ghosts=ghosts, heartbeats=heartbeats)
                except StoreError as exc:  # the store is away: the next sweep looks again
                    log.warning("supervisor.sweep_failed", error=type(exc).__name__)
                self._arm()
            case _Look():
                self._look_on()
            case Sweep():
                return self._sweep(ghosts=True, heartbeats=True)
            case RunEnded() | NoticeSent() | _CompletionSent() | RestartNoticeSent() | _HoldEnded():
                try:
                    self._record(message)
                except StoreError as exc:  # the store is away: told again in a second
                    log.warning(
                        "supervisor.record_deferred",
                        message=type(message).__name__,
                        error=type(exc).__name__,
                    )
                    tell_later(self._scheduler, self._clock, self._retell, message)
            case GetRuns():
                if self._look is not None:  # the sweep under way first, as a start's
                    self._sweep(ghosts=self._look.ghosts, heartbeats=self._look.heartbeats)
                return self._every_run()
            case Crashed():
                self._restarts.crashed(message)
            case _:
                raise TypeError(f"SupervisorActor does not understand {message!r}")
        return None

    def _record(
        self, message: RunEnded | NoticeSent | _CompletionSent | RestartNoticeSent | _HoldEnded
    ) -> None:
        """A run's end or a send's outcome, settled and recorded; each is safe to tell
        again (what the log already holds is not decided twice)."""
        match message:
            case RunEnded(run_id=run_id):
                stream = f"session:{run_id}"
                if self._catch_up(stream) is not None:
                    self._settle(stream)
            case NoticeSent():
                self._notice_sent(message)
            case _CompletionSent(outcome=outcome):
                self._completion_sent(outcome)
            case RestartNoticeSent():
                self._restarts.notice_sent(message)
            case _HoldEnded():
                self._hold_ended(message)

    # -- the sweeps ----------------------------------------------------------------------------

    def _sweep(self, *, ghosts: bool, heartbeats: bool) -> SweepReport:
        """A sweep now (a listing under way is read to its end first)."""
        try:
            self._finish_look()
            return self._sweep_runs(ghosts=ghosts, heartbeats=heartbeats)
        except BaseException:  # the next sweep lists every stream's row (a damaged one)
            self._list_rows = True
            raise

    def _sweep_soon(self, *, ghosts: bool, heartbeats: bool) -> None:
        """A sweep: now, unless it must list the streams' rows (no index at a start, or
        after a failure); then the listed streams are read a chunk per :class:`_Look`, and
        the sweep runs once they all are."""
        look = self._look
        if look is not None:  # one under way: this sweep's too
            look.ghosts, look.heartbeats = look.ghosts or ghosts, look.heartbeats or heartbeats
            return
        if not self._list_rows:
            self._sweep(ghosts=ghosts, heartbeats=heartbeats)
            return
        head = self._store.head()
        listed = self._listed_since(self._looked_to)
        self._look = _Listing(head, listed, ghosts=ghosts, heartbeats=heartbeats)
        self._look_on()  # its first chunk now: a short listing is swept at once

    def _look_on(self) -> None:
        """Read the next chunk of the listing under way; at its end, its sweep."""
        look = self._look
        if look is None:
            return  # read to its end by a sweep asked meanwhile
        try:
            chunk = look.rest(LOOK_CHUNK)
            self._fold_moved(chunk)
            look.read += len(chunk)
            if look.read < len(look.streams):
                self._tell(_Look())
                return
            self._sweep(ghosts=look.ghosts, heartbeats=look.heartbeats)
        except StoreError as exc:  # the store is away: the chunk again in a second
            log.warning("supervisor.sweep_failed", error=type(exc).__name__)
            if self._look is look:  # else the next sweep lists the rows again
                tell_later(self._scheduler, self._clock, self._tell, _Look(), self._look_key)

    def _finish_look(self) -> None:
        """Read the rest of the listing under way, if any; the log is then read from the
        head it was listed at."""
        look = self._look
        if look is None:
            return
        self._look = None
        self._fold_moved(look.rest())
        self._looked_to, self._list_rows = look.head, False

    def _sweep_runs(self, *, ghosts: bool, heartbeats: bool) -> SweepReport:
        self._refresh()
        swept: list[str] = []
        suspicious: list[str] = []
        settings = self._settings
        for stream in list(self._runs):
            if ghosts and self._decide(stream, self._ghost):
                log.error("supervisor.ghost_swept", run=stream)
                swept.append(stream)
            if heartbeats and self._decide(stream, self._suspicious):
                log.warning(
                    "supervisor.suspicious", run=stream, interval=settings.heartbeat_interval_ms
                )
                suspicious.append(stream)
            self._settle(stream)
            if swept[-1:] == [stream]:
                self._ended_here(stream)
            self._announce_owed(stream)
        self._set_aside()
        self._resend_notices()
        self._keep_index()
        return SweepReport(swept=tuple(swept), suspicious=tuple(suspicious))

    def _restore_index(self) -> None:
        """Start from the newest run index saved (:meth:`_keep_index`): the runs set aside
        as they were, those to fold again read from their start, and the log read from
        the position it covers at the first sweep (every session stream listed when none
        can be used)."""
        loaded = load_index(self._store, self._store.head())
        if loaded is None:
            return
        position, index = loaded
        self._settled = dict(index.settled)
        self._settled_batches = set(index.batches)
        for stream in index.reread:
            self._catch_up(stream)
        self._looked_to, self._list_rows, self._index_at = position, False, position
        log.info("supervisor.index_loaded", position=position, runs=len(self._settled))

    def _keep_index(self) -> None:
        """Save the run index once the log moved past the last one saved by the store's
        ``snapshot_every`` records, or by as many as the index holds runs if that is more
        (saving it costs as much as reading that many records back at a start)."""
        every, known = self._snapshot_every, len(self._runs) + len(self._settled)
        if every <= 0 or self._list_rows or self._looked_to - self._index_at < max(every, known):
            return
        reread = set(self._runs) | self._unavailable | self._left_alone
        index = RunIndex(
            reread=tuple(sorted(reread)),
            settled=self._settled,
            batches=tuple(sorted(self._settled_batches)),
        )
        try:
            save_index(self._store, index, self._looked_to)
        except StoreError as exc:  # it only saves time: tried again at the next sweep
            log.warning("supervisor.index_not_saved", error=type(exc).__name__)
            return
        self._index_at = self._looked_to

    def _resend_notices(self) -> None:
        """The give-up notices a crash or a close cut short, sent again (see
        :meth:`Restarts.resend_cut_short`); a store error waits for the next sweep."""
        try:
            self._restarts.resend_cut_short()
        except StoreError as exc:
            log.warning("supervisor.notice_resend_failed", error=type(exc).__name__)
        except Exception:  # a bug (or a portal already stopped): the sweep goes on
            log.exception("supervisor.notice_resend_failed")

    def _set_aside(self) -> None:
        """Forget the folded runs with nothing left to decide, keeping the version each
        was folded at (a run whose stream moves on is folded again at the next sweep). A
        run whose completion batch still has a send without an outcome stays: its batch's
        resend looks at it. So does one with a send of its own under way."""
        open_batches = {w.completion_id for w in self._runs.values() if w.completion == "queued"}
        in_play = len(self._runs)
        for stream, watch in list(self._runs.items()):
            busy = watch.notice_id in self._sending or watch.completion_id in self._sending
            busy = busy or stream in self._unstarted
            if settled(watch) and not busy and watch.completion_id not in open_batches:
                del self._runs[stream]
                self._settled[stream] = watch.run.version
                if watch.completion_id:
                    self._settled_batches.add(watch.completion_id)
        if len(self._runs) < in_play // 2:  # a dict keeps its largest table: copied smaller
            self._runs = dict(self._runs)

    def _every_run(self) -> dict[str, RunWatch]:
        """Every run folded: those in play, and those set aside, read back from the log
        (one that can no longer be read is left out)."""
        runs: dict[str, RunWatch] = {}
        for stream in list(self._settled):
            watch = self._read_back(stream)
            if watch is not None:
                runs[stream] = watch
        runs.update(self._runs)
        return runs

    def _read_back(self, stream: str) -> RunWatch | None:
        watch = RUN_WATCH.initial(stream)
        try:
            for record in self._store.read_stream(stream):
                watch = RUN_WATCH.apply(watch, record)
        except CorruptRecordError as exc:
            self._unreadable(stream, exc)
            return None
        return watch

    def _unreadable(self, stream: str, exc: CorruptRecordError) -> None:
        """Report a stream with a record that cannot be read, once, and leave it alone."""
        log.error("supervisor.stream_unreadable", stream=stream, position=exc.position)
        self._leave_alone(stream)

    def _leave_alone(self, stream: str) -> None:
        """Out of the sweeps for good: one damaged stream never stops those of the others."""
        self._left_alone.add(stream)
        self._runs.pop(stream, None)
        self._settled.pop(stream, None)
        self._unavailable.discard(stream)

    def _ghost(self, watch: RunWatch, now: float) -> list[Event]:
        return decide_ghost(watch.run, now, ghost_grace_ms=self._settings.ghost_grace_ms)

    def _suspicious(self, watch: RunWatch, now: float) -> list[Event]:
        settings = self._settings
        return decide_suspicious(
            watch.run,
            now,
            per_step_timeout_ms=settings.per_step_timeout_ms,
            expected_fraction=settings.expected_fraction,
            heartbeat_interval_ms=settings.heartbeat_interval_ms,
        )

    def _refresh(self) -> None:
        """Fold what is new in the session streams that moved since the sweeps last looked:
        read from the log what was appended since (its records name their streams), or
        list every stream's row when that cannot be done (the first sweep, one after a
        failure); only runs, and streams that begin a run there, are read again."""
        head = self._store.head()
        moved = None if self._list_rows else self._appended_since(self._looked_to, head)
        if moved is None:
            self._list_rows = True  # until a listing has been folded
            moved = self._listed_since(self._looked_to)
        self._fold_moved(moved.items())
        self._looked_to, self._list_rows = head, False

    def _fold_moved(self, moved: Iterable[tuple[str, int]]) -> None:
        """Fold the streams that moved past the version each is folded at."""
        for stream, version in moved:
            if self._folded_version(stream) < version:
                self._catch_up(stream)

    def _appended_since(self, position: int, head: int) -> dict[str, int] | None:
        """The runs appended to after ``position`` (to ``head``), and the streams a run
        began in there, each with the newest version read; None when a record there
        cannot be read (its stream is not known: the rows say what moved)."""
        moved: dict[str, int] = {}
        try:
            for record in self._store.read_all(position + 1, head):
                stream = record.stream
                if stream in self._runs or stream in self._settled:
                    moved[stream] = record.version
                elif record.version == 1 and _begins_run(record):
                    moved[stream] = 1
        except CorruptRecordError as exc:
            log.warning("supervisor.log_record_unreadable", position=exc.position)
            return None
        return {name: v for name, v in moved.items() if name not in self._left_alone}

    def _listed_since(self, position: int) -> dict[str, int]:
        """The session streams whose rows say they moved after ``position`` (every one
        for 0), with their versions."""
        return {
            info.stream: info.version
            for info in self._stream_rows()
            if info.last_position > position
            and info.stream.startswith("session:")
            and info.stream not in self._left_alone
        }

    def _stream_rows(self) -> list[StreamInfo]:
        """Every stream's row. A store that can say which rows cannot be read (LMDB's
        ``stream_rows``) gives the others: a damaged row of a session stream is reported
        once and its stream left alone, as one whose records cannot be read."""
        stream_rows = getattr(self._store, "stream_rows", None)
        if not callable(stream_rows):
            return self._store.streams()
        readable, damaged = stream_rows()
        for stream in damaged:
            if stream.startswith("session:") and stream not in self._left_alone:
                log.error("supervisor.stream_row_unreadable", stream=stream)
                self._leave_alone(stream)
        return cast(list[StreamInfo], readable)

    def _folded_version(self, stream: str) -> int:
        """How far the run's stream is folded, in play or set aside (0: not yet)."""
        known = self._runs.get(stream)
        if known is not None:
            return known.run.version
        return self._settled.get(stream, 0)

    def _catch_up(self, stream: str) -> RunWatch | None:
        """The run after reading what is new in its stream; None when it is no run (its
        first record, read alone, is not a spawn), or when a record of it cannot be read
        (reported once and left alone: one damaged stream never stops the sweeps of the
        others)."""
        watch = self._runs.get(stream) or RUN_WATCH.initial(stream)
        try:
            rest = True
            if watch.run.version == 0:  # its first records only: a long session's are not
                first = list(self._store.read_stream(stream, 1, FIRST_READ))
                if not first or not isinstance(first[0].event, SubagentSpawned):
                    return None  # a run's stream starts with its spawn
                watch, rest = _folded(watch, first), len(first) == FIRST_READ
            if rest:
                watch = _folded(watch, self._store.read_stream(stream, watch.run.version + 1))
        except CorruptRecordError as exc:
            self._unreadable(stream, exc)
            return None
        if not watch.is_run:
            return None
        self._runs[stream] = watch
        self._settled.pop(stream, None)  # in play again (folded anew from its start)
        return watch

    def _given_up(self, stream: str, gave_up: SupervisorGaveUp) -> None:
        """Supervision gave up on the run's actor: end the run as failed, settle it. A run
        given up before its spawn was recorded (the log refused it) is only handed to
        ``on_run_ended``, as failed: there is no run in the log to write to or settle."""
        if self._catch_up(stream) is None:
            self._ended_unrecorded(stream, gave_up)
            return
        given_up = SubagentGivenUp(restarts=gave_up.restarts, reason=gave_up.reason)
        if self._decide(stream, lambda watch, now: [given_up] if _running(watch) else []):
            log.error("supervisor.run_given_up", run=stream, restarts=gave_up.restarts)
        self._settle(stream)
        self._ended_here(stream)

    def _ended_unrecorded(self, stream: str, gave_up: SupervisorGaveUp) -> None:
        """Hand a run whose spawn is not in the log to ``on_run_ended`` as failed, with the
        static notice (its task is not recorded, so the notice cannot quote it)."""
        log.error("supervisor.unrecorded_run_given_up", run=stream, restarts=gave_up.restarts)
        self._tell_ended(stream, "failed", failure_notice(UNRECORDED_TASK, "failed", 0))

    def _ended_here(self, stream: str) -> None:
        """Hand a run this supervisor ended to ``on_run_ended`` (its actor never will)."""
        watch = self._runs.get(stream)
        if watch is None or watch.run.status not in UNSUCCESSFUL:
            return
        self._tell_ended(stream, cast(RunOutcome, watch.run.status), watch.notice_text)

    def _tell_ended(self, stream: str, outcome: RunOutcome, notice: str) -> None:
        """``on_run_ended`` (the host's callback: a failure is logged, never ours to raise)."""
        if self._on_run_ended is None:
            return
        ended = RunEnded(run_id=stream.removeprefix("session:"), outcome=outcome, notice=notice)
        try:
            self._on_run_ended(ended)
        except Exception:
            log.exception("supervisor.on_run_ended_failed", run=stream)

    # -- fold, decide, append, then act ------------------------------------------------------

    def _decide(self, stream: str, decide: Callable[[RunWatch, float], list[Event]]) -> bool:
        """Decide on the folded run at ``now`` and append expecting its version; on a
        conflict (the run's own actor wrote meanwhile) fold what was added and decide
        again. True when something was appended."""
        for attempt in range(1, MAX_CONFLICTS + 1):
            watch = self._runs[stream]
            now = self._clock.now()
            events = decide(watch, now)
            if not events:
                return False
            try:
                records = self._store.append(
                    stream,
                    [NewEvent(event=event, ts=now) for event in events],
                    expected_version=watch.run.version,
                )
            except ConcurrencyError:
                if attempt == MAX_CONFLICTS:
                    raise  # the actor fails; its supervisor restarts it from the log
                self._catch_up(stream)
                continue
            for record in records:
                watch = RUN_WATCH.apply(watch, record)
            self._runs[stream] = watch
            return True
        raise AssertionError("unreachable")

    def _settle(self, stream: str) -> None:
        """A run that ended without success gets its notice and its recovery decision."""
        watch = self._runs[stream]
        if watch.run.status not in UNSUCCESSFUL:
            return
        if watch.notice == "none" and self._decide(stream, self._queue_notice):
            self._send(stream, "announce")
        elif watch.notice_id not in self._sending and self._decide(
            stream,
            partial(
                notice_interrupted,
                wait_s=self._announce_s + RESEND_GRACE_S,
                held=self._held(watch),
            ),
        ):
            self._send(stream, "direct")  # a send a crash interrupted: send again, directly
        splits: dict[str, tuple[tuple[str, ...], str]] = {}  # one splitter call per settle
        if self._decide(stream, partial(self._recovery, splits=splits)):
            self._recover(stream)
        self._start_unstarted(stream)

    def _recovery(
        self, watch: RunWatch, now: float, *, splits: dict[str, tuple[tuple[str, ...], str]]
    ) -> list[Event]:
        """The recovery decision; a ``split`` asks the lineage's splitter for its subtasks
        and escalates when it raises or gives none."""
        run = watch.run
        splitter = self._splitter_of(watch)
        max_attempts = self._settings.recovery_max_attempts
        events = recovery(
            watch,
            now,
            max_attempts=max_attempts,
            can_split=splitter is not None,
            can_respawn=self._can_respawn(watch),
        )
        match events:
            case [SubagentRecoveryDecided(action="split") as decided] if splitter is not None:
                if run.stream not in splits:
                    splits[run.stream] = self._split(splitter, watch)
                subtasks, failure = splits[run.stream]
                if failure:
                    escalate = msgspec.structs.replace(decided, action="escalate", reason=failure)
                    return [escalate]
                return [msgspec.structs.replace(decided, subtasks=subtasks)]
        return events

    def _can_respawn(self, watch: RunWatch) -> bool:
        """False for a run of the host's own code whose code this process does not hold
        (the process that spawned it is gone); True when nothing can say (no ``works``)."""
        run = watch.run
        if not run.host_work or self._works is None:
            return True
        try:
            return self._works(run.stream.removeprefix("session:"))
        except Exception:  # the host's lookup: the code is not known then
            log.exception("supervisor.works_failed", run=run.stream)
            return False

    def _splitter_of(self, watch: RunWatch) -> Splitter | None:
        if self._splitters is None or watch.run.status not in UNSUCCESSFUL:
            return None
        if watch.run.split_from is not None:  # a split's subtask is not split again
            return None
        try:
            return self._splitters(watch.run.stream.removeprefix("session:"))
        except Exception:  # the host's lookup: no splitter then
            log.exception("supervisor.splitters_failed", run=watch.run.stream)
            return None

    def _split(self, splitter: Splitter, watch: RunWatch) -> tuple[tuple[str, ...], str]:
        """The splitter's subtasks (stripped, none empty) and "", or () and why not."""
        run = watch.run
        context = continuation_context(run) if run.step or run.artifacts else ""
        try:
            given = splitter(run.task, context)
            items = [given] if isinstance(given, str) else list(given)
            subtasks = tuple(str(item).strip() for item in items if str(item).strip())
        except Exception as exc:  # the host's callback: escalate instead
            log.exception("supervisor.splitter_failed", run=run.stream)
            return (), f"splitter_failed:{type(exc).__name__}"
        if not subtasks:
            return (), "splitter_empty"
        return subtasks, ""

    def _queue_notice(self, watch: RunWatch, now: float) -> list[Event]:
        if watch.notice != "none":
            return []
        run = watch.run
        ended = run.ended_at if run.ended_at is not None else now
        runtime_ms = round((ended - (run.started_at or ended)) * 1000)
        text = failure_notice(run.task, run.status, runtime_ms)
        return [
            AnnouncementQueued(
                announcement_id=new_id(),
                channel=watch.channel or self._default_channel,
                kind="failure_notice",
                text=text,
            )
        ]

    def _recover(self, stream: str) -> None:
        watch = self._runs[stream]
        decided = watch.run.recovery
        if decided is None:
            return
        log.warning("supervisor.recovery", run=stream, action=decided.action, reason=decided.reason)
        spawns = self._next_spawns(watch) if self._spawner is not None else []
        for spawn in spawns:
            self._start_next(stream, spawn)
        started = tuple(spawn.run_id for spawn in spawns)
        split = decided.action == "split"
        recovered = Recovered(
            stream=stream,
            action=decided.action,
            reason=decided.reason,
            context=decided.context,
            next_run_id=None if split or not started else started[0],
            next_run_ids=started if split else (),
        )
        for listener in self._listeners:
            with contextlib.suppress(pykka.ActorDeadError):
                listener.tell(recovered)

    def _next_spawns(self, watch: RunWatch) -> list[Spawn]:
        """The runs the run's recovery decision starts: its next attempt, or a split's
        subtasks (named as the run's spawn named them: :func:`next_run_ids`)."""
        decided = watch.run.recovery
        if decided is None:
            return []
        if decided.action in ("respawn", "respawn_continue"):
            return [respawn(watch, decided.context)]
        if decided.action == "split":
            return split_spawns(watch, decided.subtasks)
        return []

    def _start_next(self, stream: str, spawn: Spawn) -> None:
        """Give ``spawn`` to the host's spawner (its failure is logged, not ours to raise:
        a run it named is started again by :meth:`_start_unstarted`)."""
        assert self._spawner is not None
        self._asked[spawn.stream] = self._clock.now()
        try:
            self._spawner(spawn)
        except Exception:  # the host's callback: logged, the other subtasks still go
            log.exception("supervisor.spawner_failed", run=stream, next_run=spawn.stream)

    def _start_unstarted(self, stream: str) -> None:
        """Start the runs the run's recovery decision named (:func:`next_run_ids`) that
        the log does not hold: the process that decided died, or closed, before it
        started them, or the spawner raised. A run is left to whoever started it for
        ``ghost_sweep_interval_ms`` after the decision (or after this supervisor last
        gave it to the spawner), so a start under way is not doubled; two supervisors
        that start it all the same start one run (its spawn expects an empty stream)."""
        watch = self._runs[stream]
        named = next_run_ids(watch)
        if self._spawner is None or not named:
            return
        missing = {f"session:{run_id}" for run_id in named} - self._in_log(named)
        if not missing:
            self._unstarted.discard(stream)
            self._unavailable.discard(stream)
            for run_id in named:
                self._asked.pop(f"session:{run_id}", None)
            return
        if not self._can_restart(watch):
            return
        self._unstarted.add(stream)
        now = self._clock.now()
        grace = self._settings.ghost_sweep_interval_ms / 1000
        for spawn in self._next_spawns(watch):
            asked = self._asked.get(spawn.stream, watch.recovery_at or now)
            if spawn.stream in missing and now >= asked + grace:
                log.warning("supervisor.next_run_unstarted", run=stream, next_run=spawn.stream)
                self._start_next(stream, spawn)

    def _in_log(self, run_ids: tuple[str, ...]) -> set[str]:
        """The streams of ``run_ids`` that hold something (a run started there)."""
        found: set[str] = set()
        for run_id in run_ids:
            stream = f"session:{run_id}"
            known = stream in self._runs or stream in self._settled or stream in self._left_alone
            if known or self._store.stream_version(stream) > 0:
                found.add(stream)
        return found

    def _can_restart(self, watch: RunWatch) -> bool:
        """Whether the next attempt of a respawn can be started here: not when it runs
        the host's code that this process does not hold (its process died): no model
        stands in for it (reported once; the run is then set aside)."""
        if watch.run.recovery is None or watch.run.recovery.action == "split":
            return True  # a split's subtasks are model-driven
        if self._can_respawn(watch):
            return True
        self._unstarted.discard(watch.run.stream)
        self._unavailable.add(watch.run.stream)
        log.error("supervisor.next_run_unavailable", run=watch.run.stream)
        return False

    # -- the notice's sends ------------------------------------------------------------------

    def _send(self, stream: str, path: Path) -> None:
        watch = self._runs[stream]
        self._dispatch(stream, watch.notice_id, watch.notice_text, "failure_notice", path)

    def _dispatch(
        self,
        stream: str,
        announcement_id: str,
        text: str,
        kind: Literal["failure_notice", "reply"],
        path: Path,
        told: Callable[[NoticeSent], object] = lambda outcome: outcome,
    ) -> None:
        """Send ``text`` for the run (through the announcer, or directly on its channel),
        bounded on the Clock; its outcome comes back as ``told(NoticeSent)``."""
        watch = self._runs[stream]
        message = OutboundMessage(
            conversation=watch.conversation or watch.run.parent or stream,
            thread=watch.thread,
            text=text,
            idempotency_key=announcement_id,
            kind=kind,
        )
        channel = channel_named(self._channels, watch.channel or self._default_channel)
        if path == "announce" and self._announcer is not None:
            channel = self._announcer
        noted = noting(channel)  # the receiver's Retry-After goes with a failure
        future = send_by_clock(
            self._portal, self._scheduler, self._clock, noted, message, self._announce_s
        )
        send_id = new_id()
        self._sending.setdefault(announcement_id, set()).add(send_id)
        done = partial(sent, stream, announcement_id, path, send_id)
        future.add_done_callback(lambda f: self._tell_on(told(_noted(done(f), noted))))

    def _ended_send(self, outcome: NoticeSent) -> bool:
        """Forget the send ``outcome`` ended (told again, it is forgotten once); whether
        another send of the same announcement is still under way here (a resend begun
        while this outcome waited for the store): then a failure of this one is moot."""
        sends = self._sending.get(outcome.announcement_id, set())
        sends.discard(outcome.send_id)
        if not sends:
            self._sending.pop(outcome.announcement_id, None)
        return bool(sends)

    def _notice_sent(self, outcome: NoticeSent) -> None:
        stream, announcement_id = outcome.stream, outcome.announcement_id
        if self._ended_send(outcome) and not outcome.ok and outcome.path == "direct":
            log.info("supervisor.outcome_superseded", run=stream, path=outcome.path)
            return  # the resend under way says how the notice went
        if self._catch_up(stream) is None:
            return
        failure = None if outcome.ok else outcome.error_class or "unknown"
        event = _with_hint(
            notice_outcome(announcement_id, outcome.path, failure, timeout_ms=self._announce_ms),
            outcome.retry_after_ms,
        )
        pending = _notice_pending(self._runs[stream], announcement_id, outcome.path)
        if failure is not None and outcome.path != "announce" and pending:
            # the queue's entry first, then the failure
            self._dead_letter(stream, failure, outcome.retry_after_ms)
        self._decide(stream, partial(_ends_notice, announcement_id, outcome.path, event))
        log.info("supervisor.notice_sent", run=stream, path=outcome.path, ok=outcome.ok)
        watch = self._runs[stream]
        falls_back = (  # and its direct send not already under way (an earlier try's)
            watch.notice == "fallback"
            and watch.notice_id == announcement_id
            and announcement_id not in self._sending
        )
        if failure is not None and outcome.path == "announce" and falls_back:
            self._send_direct(stream)

    def _held(self, watch: RunWatch) -> bool:
        """Whether the run's direct send waits for the Retry-After of the announce send's
        receiver: when it goes to that receiver too (no announcer, or the same channel)."""
        if self._announcer is None:
            return True
        return self._announcer is channel_named(
            self._channels, watch.channel or self._default_channel
        )

    def _send_direct(self, stream: str) -> None:
        """The notice's direct send: now, or once the hold the log records for it ends."""
        watch = self._runs[stream]
        if not watch.notice_hold_ms or not self._held(watch):
            self._send(stream, "direct")
            return
        assert watch.notice_at is not None  # set with the fallback
        until = watch.notice_at + watch.notice_hold_ms / 1000
        ended = _HoldEnded(stream, watch.notice_id, watch.notice_at)
        self._holding.add(stream)
        log.info("supervisor.notice_held", run=stream, hold_ms=watch.notice_hold_ms)
        self._scheduler.schedule(
            until, lambda _at: self._tell_on(ended), key=self._hold_key(stream)
        )

    def _hold_key(self, stream: str) -> tuple[str, str, str]:
        return ("supervisor-hold", self.actor_urn, stream)

    def _hold_ended(self, ended: _HoldEnded) -> None:
        """Send the held notice directly, unless it moved on meanwhile: its outcome is in
        the log, or a supervisor (this one, or another process's on the log) sent it
        again (``announcement:resent`` ends the hold and moves ``notice_at``: that
        resend may still be in flight, and its outcome, or the next sweep, says how it
        went). A hold that ends late (this process paused, or its clock behind) is
        then not a second send."""
        stream, announcement_id = ended.stream, ended.announcement_id
        self._holding.discard(stream)
        watch = self._catch_up(stream)
        send = (
            watch is not None
            and watch.notice == "fallback"
            and watch.notice_id == announcement_id
            and watch.notice_hold_ms > 0
            and watch.notice_at == ended.notice_at
            and announcement_id not in self._sending
        )
        log.info("supervisor.notice_hold_ended", run=stream, sent=send)
        if send:
            self._send(stream, "direct")

    def _dead_letter(self, stream: str, reason: str, retry_after_ms: int | None) -> None:
        watch = self._runs[stream]
        text = watch.notice_text
        self._enqueue(stream, watch.notice_id, text, reason, "failure_notice", retry_after_ms)

    def _enqueue(
        self,
        stream: str,
        announcement_id: str,
        text: str,
        reason: str,
        kind: MessageKind,
        retry_after_ms: int | None,
    ) -> None:
        """Queue the failed send for retries (the first waits for the receiver's
        Retry-After, ``retry_after_ms``, when it asked)."""
        watch = self._runs[stream]
        enqueue = Enqueue(
            announcement_id=announcement_id,
            channel=watch.channel or self._default_channel,
            conversation=watch.conversation or watch.run.parent or stream,
            text=text,
            reason=reason,
            thread=watch.thread,
            kind=kind,
            retry_after_ms=retry_after_ms,
        )
        if not dead_letter(self._dead_letters, enqueue):
            log.error("supervisor.notice_lost", run=stream, announcement_id=announcement_id)

    # -- completions a crash lost ----------------------------------------------------------

    def _announce_owed(self, stream: str) -> None:
        """Announce a success whose announcement a crash lost or cut short (directly)."""
        watch = self._runs[stream]
        if watch.announce is not True or watch.run.status != "succeeded":
            return  # most runs, at every sweep: nothing to decide
        wait_s = self._completion_wait_s
        owed = partial(owed_completion, wait_s=wait_s, channel=self._default_channel)
        if self._decide(stream, owed):
            log.warning("supervisor.completion_owed", run=stream)
            self._send_completion(stream, [stream])
            return
        watch = self._runs[stream]  # as the decision left it
        if watch.completion_id in self._sending or watch.completion != "queued":
            return  # this batch's send is under way (another run of it started it)
        batched = {
            other: known
            for other, known in list(self._runs.items())
            if known.completion_id == watch.completion_id
        }
        if (
            any(known.completion != "queued" for known in batched.values())
            or watch.completion_id in self._settled_batches
        ):
            return  # a run of the batch holds its outcome (one set aside too): it was sent
        batch = sorted(batched)
        if stream != batch[0]:  # the batch's first run decides for all (when swept)
            return
        # the resend is decided on the first run's stream, expecting its version: of two
        # supervisors, one appends there and sends, the other folds it and waits again
        if self._decide(stream, partial(completion_interrupted, wait_s=wait_s)):
            log.warning("supervisor.completion_interrupted", run=stream)
            resent: list[Event] = [AnnouncementResent(announcement_id=watch.completion_id)]
            for other in batch[1:]:  # the batch's other runs say so too
                self._decide(other, partial(_unless_ended, watch.completion_id, resent))
            self._send_completion(stream, batch)

    def _send_completion(self, stream: str, batch: Sequence[str]) -> None:
        announcement_id = self._runs[stream].completion_id
        text = self._batch_text(batch)
        self._dispatch(stream, announcement_id, text, "reply", "direct", _CompletionSent)

    def _batch_text(self, batch: Sequence[str]) -> str:
        """The text of the completion the runs ``batch`` (in play) share: as the run that
        records it has it (one of them, or the run they name), or, where that record
        cannot be read, made again from the results in the order the runs ended: the
        batch's, and the recording run's own as far as its stream can be read (it is
        left out of play once a record of it cannot be read)."""
        watches = [self._runs[stream] for stream in batch if stream in self._runs]
        for watch in watches:
            if not watch.completion_text_run:
                return watch.completion_text
        holder = f"session:{watches[0].completion_text_run}"
        text, holder_run = self._recorded_text(holder, watches[0].completion_id)
        if text is not None:
            return text
        runs = [watch.run for watch in watches]
        if holder_run.status == "succeeded" and holder not in batch:
            runs.append(holder_run)
        runs.sort(key=lambda run: (run.ended_at or 0.0, run.stream))
        return batch_text(tuple((run.stream.removeprefix("session:"), run.result) for run in runs))

    def _recorded_text(self, stream: str, announcement_id: str) -> tuple[str | None, RunState]:
        """The text ``stream`` records for completion ``announcement_id`` (None: none, or
        the stream cannot be read), and its run as far as it was read."""
        run = RUN.initial(stream)
        try:
            for record in self._store.read_stream(stream):
                event = record.event
                if (
                    isinstance(event, AnnouncementQueued)
                    and event.announcement_id == announcement_id
                    and event.text_run is None
                ):
                    return event.text, run
                run = RUN.apply(run, record)
        except CorruptRecordError as exc:
            self._unreadable(stream, exc)
        return None, run

    def _completion_sent(self, outcome: NoticeSent) -> None:
        """Record the send's outcome in every run of its batch; dead-letter a failure once."""
        announcement_id = outcome.announcement_id
        if self._ended_send(outcome) and not outcome.ok:
            log.info("supervisor.outcome_superseded", path="direct")
            return  # the resend under way says how the batch went
        failure = None if outcome.ok else outcome.error_class or "unknown"
        event = _with_hint(
            notice_outcome(announcement_id, "direct", failure, timeout_ms=self._announce_ms),
            outcome.retry_after_ms,
        )
        batch = [
            stream
            for stream, watch in list(self._runs.items())
            if watch.completion_id == announcement_id and self._catch_up(stream) is not None
        ]
        if failure is not None and batch:  # the queue's entry first, then the failure
            text = self._batch_text(batch)
            hint = outcome.retry_after_ms
            self._enqueue(batch[0], announcement_id, text, failure, "reply", hint)
        for stream in batch:
            self._decide(stream, partial(_unless_ended, announcement_id, [event]))
        log.info("supervisor.completion_sent", runs=len(batch), ok=outcome.ok)

    # -- the timer -----------------------------------------------------------------------------

    def _arm(self) -> None:
        due = min(self._next_ghost, self._next_heartbeat)
        self._scheduler.schedule(due, self._due, key=self._timer_key)

    def _due(self, at: float) -> None:
        self._tell(_Due(at))

    def _tell(self, message: object) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile
            self.actor_ref.tell(message)

    def _tell_on(self, message: object) -> None:
        """Tell ``message`` to whichever supervisor runs (``retell``: this one, or its
        successor once it died); while none does (the restart's backoff), again in
        :data:`~stalwart.actors._restarts.DECISION_RETRY_S`. Never raises (a send's
        done-callback, a dying supervisor's hand-over)."""
        try:
            self._retell(message)
        except pykka.ActorDeadError:
            tell_later(self._scheduler, self._clock, self._retell, message)


#: what a dying supervisor hands to its successor (each is safe to tell again)
_HANDED_OVER = (Crashed, RunEnded, NoticeSent, _CompletionSent, RestartNoticeSent, _HoldEnded)


def _folded(watch: RunWatch, records: Iterable[RecordedEvent]) -> RunWatch:
    for record in records:
        watch = RUN_WATCH.apply(watch, record)
    return watch


def _begins_run(record: RecordedEvent) -> bool:
    """Whether the record is the spawn a run's session stream starts with."""
    return record.stream.startswith("session:") and isinstance(record.event, SubagentSpawned)


def _running(watch: RunWatch) -> bool:
    return watch.run.status == "running"


def _notice_pending(watch: RunWatch, announcement_id: str, path: Path) -> bool:
    """Whether a send of the run's notice by ``path`` still waits for its outcome: the
    announce send while it is queued, the direct one until it is delivered or failed."""
    stages = ("queued",) if path == "announce" else ("queued", "fallback")
    return watch.notice_id == announcement_id and watch.notice in stages


def _noted(outcome: NoticeSent, noted: RetryAfterNoted | None) -> NoticeSent:
    """A send's outcome with the receiver's Retry-After of its failure, when it asked."""
    hint = retry_after_of(noted, outcome.error_class)
    return outcome if hint is None else msgspec.structs.replace(outcome, retry_after_ms=hint)


def _with_hint(event: Event, hint: int | None) -> Event:
    """A failed send's record with the receiver's Retry-After (None: it asked nothing)."""
    if isinstance(event, AnnouncementSendFailed | AnnouncementFallbackDirect) and hint is not None:
        return msgspec.structs.replace(event, retry_after_ms=hint)
    return event


def _ends_notice(
    announcement_id: str, path: Path, event: Event, watch: RunWatch, now: float
) -> list[Event]:
    """The send's outcome, unless the notice moved past it meanwhile (an earlier try of
    the same outcome was written though its append raised)."""
    return [event] if _notice_pending(watch, announcement_id, path) else []


def _unless_ended(
    announcement_id: str, events: list[Event], watch: RunWatch, now: float
) -> list[Event]:
    """``events`` (the send's outcome, its resend), unless the run's completion
    ``announcement_id`` ended meanwhile."""
    queued = watch.completion == "queued" and watch.completion_id == announcement_id
    return events if queued else []
