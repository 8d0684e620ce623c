"""A runtime's sub-agent runs: each run's actor started under its watchdog (with the
announcer as its parent), its handle, its crash and restart; and each lineage's work,
agent and splitter, which the supervisor's respawns and splits look up."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import msgspec
import pykka

from stalwart.actors import (
    Crashed,
    RunEnded,
    RunReport,
    Spawn,
    SubAgentActor,
    Track,
    Work,
    subsession_work,
)
from stalwart.channels import MemoryChannel
from stalwart.errors import SpawnRefusedError
from stalwart.state import SUBSESSION_CHANNEL_PREFIX, spawn_timeout

from ._handles import DEFAULT_CHANNEL, RunHandle, RunSpec
from ._sessions import SessionLayer
from ._wiring import Wiring, stop_actors

__all__ = ["RunLayer", "Splitter", "stop_runs"]

#: ``rt.spawn(..., splitter=)``: ``(task, context) -> subtasks`` (see :meth:`Runtime.spawn`)
Splitter = Callable[[str, str], Sequence[str]]


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
        self._works: dict[tuple[str, str], tuple[Work | None, str]] = {}
        self._splitters: dict[tuple[str, str], Splitter] = {}
        self._tracks: dict[str, Track] = {}  # what a restarted announcer is told again

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
        parent session's (its thread goes with its conversation; ConfigError for an
        unknown agent)."""
        parent = self._sessions.get(parent_session)
        agent = agent or (parent.agent if parent is not None else "default")
        self._w.config.agent(agent)  # ConfigError for an unknown agent
        channel = channel or (parent.channel if parent is not None else DEFAULT_CHANNEL)
        thread = None
        if conversation is None:
            conversation = parent.conversation if parent is not None else parent_session
            thread = parent.thread if parent is not None else None
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
        self._check(spawn)
        lineage = (spawn.parent, spawn.task)
        self._works[lineage] = (work, agent)
        if splitter is not None:
            self._splitters[lineage] = splitter
        else:
            self._splitters.pop(lineage, None)
        return self._start(spawn, work, agent, announce=announce)

    def _check(self, spawn: Spawn) -> None:
        """SpawnRefusedError (nothing appended) for a task that is not text that can be
        stored, no valid timeout, a step budget that is not a positive number (its
        watchdog limit would be 0 ms or less: the run would be force-failed the moment it
        starts) or an unknown channel."""
        for field in ("task", "reason", "conversation", "thread"):  # in subagent:spawned
            value = getattr(spawn, field)
            if value is not None and (not isinstance(value, str) or not _storable(value)):
                raise SpawnRefusedError(
                    f"spawn refused: the {field} must be text that is valid UTF-8", field=field
                )
        if spawn.max_steps is not None and (
            isinstance(spawn.max_steps, bool)
            or not isinstance(spawn.max_steps, int)
            or spawn.max_steps < 1
        ):
            raise SpawnRefusedError(
                f"spawn refused: max_steps must be a positive integer, got {spawn.max_steps!r}",
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
        if work is None:
            start = partial(self._start_subsession, spawn.run_id, agent)
            work = subsession_work(self._w.store, spawn.run_id, spawn.task, start)
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
        run.ref = self._start_actor(spawn, work)
        return RunHandle(spawn.run_id, spawn.parent, self._w.store, run.ended, lambda: run.ref)

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
        """The announcer's callback: resolve the run's handle and stop its actor."""
        with self._w.lock:
            run = self._runs.pop(ended.run_id, None)
            self._tracks.pop(ended.run_id, None)
            if run is not None and ended.outcome == "succeeded":
                self._forget(run.spawn.parent, run.spawn.task)
        if run is None:
            return
        if not run.ended.done():
            run.ended.set_result(ended)
        if run.ref is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                run.ref.stop(block=False)

    def respawn(self, spawn: Spawn) -> object:
        """The supervisor's recovery spawner: the next attempt, with the continuation
        context in its task, runs the same ``work`` (or is model-driven again), and is
        announced as the first attempt chose (``Spawn.announce`` as recorded)."""
        with self._w.lock:
            if not self._w.running():
                return None
            known = self._lineage(spawn.parent, spawn.task)
            work, agent = known or (None, self._agent_of(spawn.parent))
            self._works[(spawn.parent, spawn.task)] = (work, agent)
            announce = True if spawn.announce is None else spawn.announce
            return self._start(spawn, work, agent, announce=announce)

    def holds_work(self, parent: str, task: str) -> bool:
        """Whether this process holds the host code of the lineage a run of ``parent``
        with ``task`` belongs to (the supervisor's ``works``)."""
        with self._w.lock:
            known = self._lineage(parent, task)
            return known is not None and known[0] is not None

    def _forget(self, parent: str, task: str) -> None:
        """A lineage that succeeded is done: its ``work`` and splitter (the host's code,
        and what they hold) are let go, unless another run of it still runs. A lineage
        that failed is kept, as the supervisor's recovery may respawn it."""

        def ours(key: tuple[str, str]) -> bool:
            return key[0] == parent and _of_lineage(task, key[1])

        if any(ours((r.spawn.parent, r.spawn.task)) for r in self._runs.values()):
            return
        for key in [key for key in self._works if ours(key)]:
            del self._works[key]
        for key in [key for key in self._splitters if ours(key)]:
            del self._splitters[key]

    def _lineage(self, parent: str, task: str) -> tuple[Work | None, str] | None:
        """The work and agent of the lineage a run of ``parent`` with ``task`` belongs to
        (the latest registered), or None when this process never spawned it."""
        found = None
        for (known_parent, known_task), known in self._works.items():
            if known_parent == parent and _of_lineage(task, known_task):
                found = known
        return found

    def splitter_of(self, parent: str, task: str) -> Splitter | None:
        """The supervisor's lookup: the splitter of the lineage a run of ``parent`` with
        ``task`` (maybe a later attempt's, the continuation context after it) belongs to.
        It calls the host's splitter with the lineage's task and registers the subtasks as
        model-driven lineages of the lineage's agent."""
        with self._w.lock:
            for (known_parent, known_task), splitter in self._splitters.items():
                if known_parent == parent and _of_lineage(task, known_task):
                    return partial(self._split, parent, known_task, splitter)
        return None

    def _split(
        self, parent: str, lineage_task: str, splitter: Splitter, task: str, context: str
    ) -> Sequence[str]:
        subtasks = splitter(lineage_task, context)
        with self._w.lock:
            _, agent = self._works.get((parent, lineage_task), (None, self._agent_of(parent)))
            for subtask in [subtasks] if isinstance(subtasks, str) else subtasks:
                self._works[(parent, str(subtask).strip())] = (None, agent)
        return subtasks

    def _agent_of(self, parent_session: str) -> str:
        """The agent a model-driven run of ``parent_session`` uses when nothing says which
        (a run another process started): the parent's, else ``default``, else the first."""
        parent = self._sessions.get(parent_session)
        if parent is not None:
            return parent.agent
        agents = self._w.config.agents
        return "default" if "default" in agents or not agents else sorted(agents)[0]

    # -- handles, crashes ----------------------------------------------------------------------

    def handle(self, run_id: str) -> RunHandle | None:
        """See :meth:`Runtime.run` (under the runtime's lock)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        return RunHandle(run_id, run.spawn.parent, self._w.store, run.ended, lambda: run.ref)

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
        does not run the work again (the recovery protocol decides that)."""
        with self._w.lock:
            run = self._runs.get(run_id)
            if not self._w.running() or run is None:
                return
            run.ref = self._start_actor(run.spawn, _no_work)


def _of_lineage(task: str, lineage_task: str) -> bool:
    """``task`` is the lineage's, or a later attempt's (the continuation context after it)."""
    return task == lineage_task or task.startswith(lineage_task + "\n\n")


def stop_runs(runs: Sequence[RunSpec]) -> None:
    """Stop the runs' actors; a handle still waiting learns the run will not end here."""
    for run in runs:
        run.ended.cancel()
    stop_actors([run.ref for run in runs])


async def _no_work(report: RunReport) -> str:
    """A restarted run's work: never run (the actor resumes the run, not the work)."""
    raise RuntimeError("a restarted run does not run its work again")


def _storable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
