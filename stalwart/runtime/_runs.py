"""A runtime's sub-agent runs: each run's actor started under its watchdog (with the
announcer as its parent), its handle, its crash and restart; and each lineage's work,
agent and splitter, which the supervisor's respawns and splits look up by run id.

A lineage is a run spawned here and the later attempts the recovery protocol respawns
of it (each :class:`Spawn` names the run it retries: ``retry_of``). It is never found by
its text: runs of one parent may share a task and each have a work of their own (one task
fanned out over several inputs), and the retry of one must run its own.

A lineage is let go (its work, and whatever the host's code holds) once none of its runs
can run again: one succeeded, or the recovery decision of its last failed run spawned
nothing more (``deliver``, ``escalate``), or spawned what it decided (a respawn's next
attempt, which carries the lineage on, or a split's subtasks, lineages of their own)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    Crashed,
    RunEnded,
    Spawn,
    SubAgentActor,
    Track,
    Work,
    failure_notice,
    subsession_work,
)
from stalwart.actors._announcer import Untrack
from stalwart.channels import MemoryChannel
from stalwart.errors import SpawnRefusedError, StoreError
from stalwart.state import RUN, SUBSESSION_CHANNEL_PREFIX, Recovery, spawn_timeout
from stalwart.store import load_state

from ._handles import DEFAULT_CHANNEL, RunHandle, RunSpec
from ._sessions import SessionLayer
from ._tools import spawn_call
from ._wiring import Wiring, stop_actors

__all__ = ["RunLayer", "Splitter", "stop_runs"]

log = get_logger(__name__)

#: The largest ``max_steps`` a spawn may give: the largest integer the log records (a
#: signed 64-bit one). A step budget that large is no limit: the run's own one binds.
MAX_STEPS = 2**63 - 1

#: ``rt.spawn(..., splitter=)``: ``(task, context) -> subtasks`` (see :meth:`Runtime.spawn`)
Splitter = Callable[[str, str], Sequence[str]]


class _Lineage:
    """A lineage spawned here: its first task (what a splitter is given), its ``work``
    (None: model-driven), agent and splitter, and the ids of its runs."""

    __slots__ = ("agent", "runs", "splitter", "task", "work")

    def __init__(self, task: str, work: Work | None, agent: str, splitter: Splitter | None):
        self.task = task
        self.work = work
        self.agent = agent
        self.splitter = splitter
        self.runs: list[str] = []


class RunLayer:
    """Starts the sub-agent runs (and a crashed run's actor again); remembers each
    lineage's work, agent and splitter. ``announcer`` is the parent of every run (a
    live reference: the announcer is restarted in place); ``tell_supervisor`` reports a
    crashed run."""

    def __init__(
        self,
        wiring: Wiring,
        sessions: SessionLayer,
        *,
        announcer: pykka.ActorRef[Any],
        tell_supervisor: Callable[[object], None],
    ) -> None:
        self._w = wiring
        self._sessions = sessions
        self._announcer = announcer
        self._tell_supervisor = tell_supervisor
        self._runs: dict[str, RunSpec] = {}
        #: each run spawned here (the ended ones of a lineage still running, or failed)
        self._lineages: dict[str, _Lineage] = {}
        #: the failed runs here whose recovery may still spawn a run of their lineage: its
        #: decision once read from the log (None: not read yet, or not decided yet)
        self._awaiting: dict[str, Recovery | None] = {}
        #: how many runs the recovery spawned after each run here (by ``retry_of``)
        self._successors: dict[str, int] = {}
        self._tracks: dict[str, Track] = {}  # what a restarted announcer is told again
        #: False once supervision gave up on the supervisor: no recovery is decided here
        self._supervised = True

    def take(self) -> list[RunSpec]:
        """Every run still running, forgotten (the runtime closes; under its lock)."""
        runs = list(self._runs.values())
        self._runs.clear()
        return runs

    def tracks(self) -> list[Track]:
        """The runs the announcer tracks (under the runtime's lock)."""
        return list(self._tracks.values())

    # -- spawning ------------------------------------------------------------------------------

    def defaults(
        self, parent_session: str, agent: str | None, channel: str | None, conversation: str | None
    ) -> tuple[str, str, str, str | None]:
        """A spawn's agent, channel, conversation and thread: the given ones, else the
        parent session's, as its handle or its log has them (its thread goes with its
        conversation; ConfigError for an unknown agent)."""
        parent = self._sessions.address(parent_session)
        recorded = parent or ("default", DEFAULT_CHANNEL, parent_session, None)
        agent = agent or recorded[0]
        self._w.config.agent(agent)  # ConfigError for an unknown agent
        channel = channel or recorded[1]
        thread = None
        if conversation is None:
            conversation, thread = recorded[2], recorded[3]
        return agent, channel, conversation, thread

    def spawn(
        self,
        spawn: Spawn,
        work: Work | None,
        agent: str,
        *,
        announce: bool,
        splitter: Splitter | None,
    ) -> RunHandle:
        """See :meth:`Runtime.spawn` (under the runtime's lock, while it runs)."""
        if not isinstance(announce, bool):  # recorded in subagent:spawned
            raise SpawnRefusedError(
                "spawn refused: announce must be True or False", field="announce"
            )
        self._check(spawn)
        if work is None and not spawn.task.strip():  # a model's run: nothing to answer
            raise SpawnRefusedError("spawn refused: the task is empty", field="task")
        spawn = self._named_for_call(spawn)
        self._join(spawn.run_id, _Lineage(spawn.task, work, agent, splitter))
        return self._start(spawn, work, agent, announce=announce)

    def _named_for_call(self, spawn: Spawn) -> Spawn:
        """The spawn of a ``spawn_subagent`` call (:func:`spawn_call`): named after the
        call, recording its idempotency key, so that the call's ``reconcile`` check finds
        its run after a crash. Unless a run of that name is here already: that spawn keeps
        its own id (under the lock)."""
        call = spawn_call()
        if call is None:
            return spawn
        key, run_id = call
        if run_id in self._runs or run_id in self._lineages:
            return spawn
        return msgspec.structs.replace(spawn, run_id=run_id, call_key=key)

    def _join(self, run_id: str, lineage: _Lineage) -> None:
        lineage.runs.append(run_id)
        self._lineages[run_id] = lineage

    def _check(self, spawn: Spawn) -> None:
        """SpawnRefusedError (nothing appended) for a task that is not text that can be
        stored (None included: the run's actor would crash at every start), no valid
        timeout, a step budget that is not a positive number (its watchdog limit would be
        0 ms or less: the run would be force-failed the moment it starts) or is over
        :data:`MAX_STEPS` (the log could not record its spawn) or an unknown channel."""
        for field in ("task", "reason", "conversation", "thread"):  # in subagent:spawned
            value = getattr(spawn, field)
            if value is None and field != "task":  # the others may be left out
                continue
            if not isinstance(value, str) or not _storable(value):
                raise SpawnRefusedError(
                    f"spawn refused: the {field} must be text that is valid UTF-8", field=field
                )
        if spawn.max_steps is not None and (
            isinstance(spawn.max_steps, bool)
            or not isinstance(spawn.max_steps, int)
            or not 1 <= spawn.max_steps <= MAX_STEPS
        ):
            raise SpawnRefusedError(
                f"spawn refused: max_steps must be an integer from 1 to {MAX_STEPS}, "
                f"got {spawn.max_steps!r}",
                field="max_steps",
            )
        settings = self._w.config.subagents
        spawn_timeout(
            spawn.task_class,
            spawn.custom_timeout_ms,
            spawn.reason,
            class_timeouts_ms=msgspec.structs.asdict(settings.class_timeouts_ms),
            custom_max_ms=settings.custom_max_ms,
            default_ms=settings.max_run_timeout_ms,
        )
        channels = self._w.channels
        if spawn.channel not in channels:
            raise SpawnRefusedError(
                f"spawn refused: no channel named {spawn.channel!r} "
                f"(available: {sorted(channels) or 'none'})",
                field="channel",
            )

    def _start(self, spawn: Spawn, work: Work | None, agent: str, *, announce: bool) -> RunHandle:
        spawn = msgspec.structs.replace(spawn, announce=announce, host_work=work is not None)
        run = RunSpec(spawn, work, agent)
        self._runs[spawn.run_id] = run
        track = Track(
            run_id=spawn.run_id,
            parent=spawn.parent,
            channel=spawn.channel,
            conversation=spawn.conversation,
            thread=spawn.thread,
            announce=announce,
        )
        self._tracks[spawn.run_id] = track
        with contextlib.suppress(pykka.ActorDeadError):  # a restarted announcer is told again
            self._announcer.tell(track)
        run.ref = self._start_actor(spawn, self._work_of(run))
        return self._handle(spawn.run_id, run)

    def _handle(self, run_id: str, run: RunSpec) -> RunHandle:
        return RunHandle(
            run_id,
            run.spawn.parent,
            self._w.store,
            run.ended,
            lambda: run.ref,
            supervised=lambda: self._supervised,
        )

    def _work_of(self, run: RunSpec) -> Work:
        """What the run's actor runs: the host's ``work``, or a model-driven sub-session."""
        if run.work is not None:
            return run.work
        start = partial(self._start_subsession, run.spawn.run_id, run.agent)
        return subsession_work(self._w.store, run.spawn.run_id, run.spawn.task, start)

    def _start_actor(self, spawn: Spawn, work: Work) -> pykka.ActorRef[Any]:
        return SubAgentActor.start(
            store=self._w.store,
            clock=self._w.clock,
            scheduler=self._w.scheduler,
            portal=self._w.portal,
            spawn=spawn,
            work=work,
            parent=self._announcer,
            settings=self._w.config.subagents,
            on_crash=partial(self._crashed, spawn.run_id),
        )

    def _start_subsession(self, run_id: str, agent: str) -> pykka.ActorRef[Any]:
        """The Agent of a model-driven run: on the run's stream, its answer kept off every
        user-facing channel (the run's result is what the parent gets)."""
        with self._w.lock:
            if not self._w.running():
                raise RuntimeError("the runtime is closed: use start() or a with block")
            sink = MemoryChannel(f"{SUBSESSION_CHANNEL_PREFIX}{run_id}")
            handle = self._sessions.start_agent(
                run_id, agent, sink.name, None, None, supervised=False, target=sink
            )
            return handle.ref

    # -- the announcer's and the supervisor's callbacks ----------------------------------------

    def ended(self, ended: RunEnded) -> None:
        """The announcer's and the supervisor's callback: resolve the run's handle, stop
        its actor, and let go of the lineages no recovery can spawn a run of any more."""
        with self._w.lock:
            run = self._runs.pop(ended.run_id, None)
            self._tracks.pop(ended.run_id, None)
            failed = run is not None and ended.outcome != "succeeded"
            if failed and self._supervised and ended.run_id in self._lineages:
                self._awaiting[ended.run_id] = None  # the supervisor decides its recovery
            if run is not None:
                self._forget(ended.run_id)
        if run is None:
            return
        # a run the supervisor ended (swept, given up) was never ended through the announcer
        with contextlib.suppress(pykka.ActorDeadError):
            self._announcer.tell(Untrack(ended.run_id))
        if not run.ended.done():
            run.ended.set_result(ended)
        if run.ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                run.ref.stop(block=False)
        self._let_go_recovered()

    def respawn(self, spawn: Spawn) -> object:
        """The supervisor's recovery spawner: the next attempt, with the continuation
        context in its task, runs the ``work`` of the run it retries (``retry_of``), or is
        model-driven again, and is announced as the first attempt chose
        (``Spawn.announce`` as recorded). A split's subtask is a model-driven lineage of
        its own, on the split lineage's agent; a retry of a run this process did not
        spawn is model-driven, on the parent's agent (the supervisor escalates a run of
        host code it does not hold: :meth:`holds_work`). A run already started (here, or
        by another process on the log: the supervisor starts a recorded next run again
        when it finds none in the log) is not started twice."""
        with self._w.lock:
            if not self._w.running():
                return None
        if self._w.store.stream_version(spawn.stream) > 0:  # read outside the lock
            return None
        with self._w.lock:
            if not self._w.running() or spawn.run_id in self._runs:
                return None
            prior = self._lineages.get(spawn.retry_of) if spawn.retry_of else None
            if prior is not None and not (spawn.split_from is not None and spawn.attempt == 1):
                lineage = prior
            else:
                agent = prior.agent if prior is not None else self._agent_of(spawn.parent)
                lineage = _Lineage(spawn.task, None, agent, None)
            self._join(spawn.run_id, lineage)
            announce = True if spawn.announce is None else spawn.announce
            started = self._start(spawn, lineage.work, lineage.agent, announce=announce)
            if prior is not None and spawn.retry_of is not None:
                # after the start: the new run is among the runs that keep the lineage
                self._successors[spawn.retry_of] = self._successors.get(spawn.retry_of, 0) + 1
                self._release(spawn.retry_of)
            return started

    def holds_work(self, run_id: str) -> bool:
        """Whether this process holds the host code of run ``run_id``'s lineage (the
        supervisor's ``works``): it spawned the run, with a ``work``."""
        with self._w.lock:
            lineage = self._lineages.get(run_id)
            return lineage is not None and lineage.work is not None

    def _forget(self, run_id: str) -> None:
        """Let go of run ``run_id``'s lineage (its ``work`` and splitter: the host's code,
        and what they hold) unless a run of it still runs, or failed and may still be
        respawned by the supervisor's recovery (under the lock)."""
        lineage = self._lineages.get(run_id)
        if lineage is None:
            return
        if any(other in self._runs or other in self._awaiting for other in lineage.runs):
            return
        for other in lineage.runs:
            self._lineages.pop(other, None)
            self._successors.pop(other, None)

    def _release(self, run_id: str) -> None:
        """Stop awaiting failed run ``run_id`` once its recovery decision is read and
        spawned every run it decided (under the lock)."""
        decided = self._awaiting.get(run_id)
        if decided is None:
            return
        if self._successors.get(run_id, 0) >= _spawned_by(decided):
            del self._awaiting[run_id]
            self._forget(run_id)

    def _let_go_recovered(self) -> None:
        """Read the recovery decisions of the failed runs still awaited (outside the
        lock: the supervisor decides on its own thread, so a decision not in the log yet
        is read again at the next run's end) and let go of the lineages they end."""
        with self._w.lock:
            unread = [run_id for run_id, decided in self._awaiting.items() if decided is None]
        found = {run_id: self._decision(run_id) for run_id in unread}
        with self._w.lock:
            for run_id, decided in found.items():
                if decided is not None and run_id in self._awaiting:
                    self._awaiting[run_id] = decided
                    self._release(run_id)

    def _decision(self, run_id: str) -> Recovery | None:
        """Run ``run_id``'s recovery decision in the log; None while there is none (a
        run whose spawn the log never recorded has none to come: ``escalate`` stands in)."""
        try:
            state = load_state(self._w.store, f"session:{run_id}", RUN, use_snapshots=False)
        except StoreError as exc:  # read again at the next run's end
            log.warning("runtime.recovery_unread", run=run_id, error=type(exc).__name__)
            return None
        if state.status == "new":
            return Recovery(action="escalate", reason="not_recorded")
        return state.recovery

    def splitter_of(self, run_id: str) -> Splitter | None:
        """The supervisor's lookup: the splitter of run ``run_id``'s lineage (maybe a later
        attempt's). It calls the host's splitter with the lineage's first task."""
        with self._w.lock:
            lineage = self._lineages.get(run_id)
            if lineage is None or lineage.splitter is None:
                return None
            return partial(_split, lineage.splitter, lineage.task)

    def _agent_of(self, parent_session: str) -> str:
        """The agent a model-driven run of ``parent_session`` uses when nothing says which
        (a run another process started): the parent's, else ``default``, else the first."""
        parent = self._sessions.address(parent_session)
        if parent is not None:
            return parent[0]
        agents = self._w.config.agents
        return "default" if "default" in agents or not agents else sorted(agents)[0]

    # -- handles, crashes ----------------------------------------------------------------------

    def handle(self, run_id: str) -> RunHandle | None:
        """See :meth:`Runtime.run` (under the runtime's lock)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        return self._handle(run_id, run)

    # -- without a supervisor ------------------------------------------------------------------

    def unsupervised(self) -> None:
        """Supervision gave up on the supervisor: no recovery is decided in this runtime
        (the next runtime's supervisor decides what the log left undecided), so no
        lineage is kept for one."""
        with self._w.lock:
            self._supervised = False
            awaited = list(self._awaiting)
            self._awaiting.clear()
            for run_id in awaited:
                self._forget(run_id)

    def lost(self, run_id: str) -> None:
        """Run ``run_id``'s actor crashed with no supervisor to restart it: its handle
        resolves as failed, with the run's static notice (the log still says it runs:
        the next runtime's supervisor sweeps it)."""
        with self._w.lock:
            run = self._runs.get(run_id)
        if run is None:
            return
        log.error("runtime.run_lost", run=run_id)
        notice = failure_notice(run.spawn.task, "failed", self._runtime_ms(run_id))
        self.ended(RunEnded(run_id=run_id, outcome="failed", notice=notice))

    def _runtime_ms(self, run_id: str) -> int:
        """How long run ``run_id`` has run, as its stream says (0 when it cannot say)."""
        try:
            state = load_state(self._w.store, f"session:{run_id}", RUN, use_snapshots=False)
        except StoreError:
            return 0
        started = state.started_at
        return 0 if started is None else max(0, round((self._w.clock.now() - started) * 1000))

    def _crashed(self, run_id: str, reason: str) -> None:
        run = self._runs.get(run_id)
        if run is None:
            return
        crashed = Crashed(
            actor=f"session:{run_id}",
            reason=reason,
            restart=partial(self._restart, run_id),
            session=run.spawn.parent,
            channel=run.spawn.channel,
            conversation=run.spawn.conversation,
            thread=run.spawn.thread,
            run=run.spawn.stream,
        )
        self._tell_supervisor(crashed)

    def _restart(self, run_id: str) -> None:
        """Start the run's actor again: it re-arms the watchdog of a run still running and
        does not run the work again (the recovery protocol decides that). It is given the
        run's work all the same: a run whose spawn never reached the log (its first start
        failed, the store away) never ran it, and the actor starts it then."""
        with self._w.lock:
            run = self._runs.get(run_id)
            if not self._w.running() or run is None:
                return
            run.ref = self._start_actor(run.spawn, self._work_of(run))


def _spawned_by(decided: Recovery) -> int:
    """How many runs a recovery decision spawns: a respawn one, a split one per subtask."""
    if decided.action in ("respawn", "respawn_continue"):
        return 1
    return len(decided.subtasks) if decided.action == "split" else 0


def _split(splitter: Splitter, lineage_task: str, task: str, context: str) -> Sequence[str]:
    """The host's splitter, given the lineage's first task (not a later attempt's, which
    ends with the continuation context) and the context."""
    return splitter(lineage_task, context)


def stop_runs(runs: Sequence[RunSpec]) -> None:
    """Stop the runs' actors; a handle still waiting learns the run will not end here."""
    for run in runs:
        run.ended.cancel()
    stop_actors([run.ref for run in runs])


def _storable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
