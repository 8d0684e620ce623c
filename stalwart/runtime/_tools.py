"""The built-in ``spawn_subagent`` tool and a session's own tool registry.

A ``spawn_subagent`` call answers with its run's lineage's outcome: a run that failed and
that the supervisor's recovery respawned is followed to the attempts it started (each
run's ``next_run_id``), so the retry's answer is the call's. Its run is named after the
call: its id is derived from the call's idempotency key (:func:`call_run_id`), and its
``subagent:spawned`` records the key (``call_key``). After a crash cut the call short,
the tool's ``reconcile`` check reads that run's stream, and those of the attempts its
recovery started after it, never the rest of the log.

The answer is bounded like any tool's result (the runtime's registry's
``max_result_bytes``): a longer one is cut, and the marker names the run's stream, which
keeps it whole.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio.to_thread

from stalwart._aio import wait_on_own_thread
from stalwart.actors import failure_notice
from stalwart.errors import SpawnRefusedError, ToolError
from stalwart.events import SubagentSpawned, TaskClass
from stalwart.state import RUN, RunState
from stalwart.store import EventStore
from stalwart.tools import Tool, ToolRegistry, ToolSpec, current_call, cut_start

if TYPE_CHECKING:
    from ._handles import RunHandle
    from ._runtime import Runtime

__all__ = [
    "BUILTIN_TOOLS",
    "SPAWN_TOOL",
    "SessionTools",
    "SpawnTool",
    "bounded_answer",
    "call_run_id",
    "spawn_call",
    "spawn_tool_fn",
]

#: The built-in tool an agent with ``subagents = true`` offers its model.
SPAWN_TOOL = "spawn_subagent"

#: Every name a session's built-in tools may use (``spawn_subagent``, the draft tools with
#: a committer, the DAG context engine's ``ctx_*``): the runtime's registry refuses them.
BUILTIN_TOOLS = frozenset(
    {
        SPAWN_TOOL,
        *("draft_write", "draft_read", "draft_list", "draft_commit", "draft_discard"),
        *("ctx_search", "ctx_inspect", "ctx_expand"),
    }
)

#: What the model reads for a ``spawn_subagent`` call whose task is empty or blank: no
#: run is spawned (its first turn would have nothing to answer, which the providers
#: refuse, and its recovery would run it again, each attempt failing the same way).
EMPTY_TASK_TEXT = "spawn refused: the task is empty: give the sub-agent a self-contained task"

#: How long one wait for the log to move lasts while a reconcile check waits on a run
#: (real seconds: a wait the check's time limit cut short keeps its thread this long at most)
LOG_WAIT_S = 1.0

#: What follows the start of a sub-agent's answer cut to the tool's limit: how much of it
#: is shown, and where the whole answer is kept (the run's own stream).
CUT_TEMPLATE = (
    "\n[stalwart: the sub-agent's answer is longer than the tool's limit of {limit:,} "
    "bytes: only the first {kept:,} of its {total:,} characters are shown. The whole "
    "answer is kept in the sub-agent's own log, stream {stream}.]"
)

#: The recovery decisions that start the lineage's next attempt (``next_run_id``).
_RESPAWNS = ("respawn", "respawn_continue")

#: The call a spawn on this thread serves: its idempotency key and the run id named
#: after it (set by :meth:`SpawnTool._spawn` around ``rt.spawn``)
_SPAWN_CALL: ContextVar[tuple[str, str] | None] = ContextVar("stalwart_spawn_call", default=None)


def call_run_id(key: str) -> str:
    """The id of the run a ``spawn_subagent`` call with idempotency key ``key`` spawns:
    32 hex characters, as :func:`~stalwart.ids.new_id` gives, the same for every attempt
    of the call."""
    digest = hashlib.sha256(f"{SPAWN_TOOL}\0{key}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


def spawn_call() -> tuple[str, str] | None:
    """The ``spawn_subagent`` call a spawn on this thread serves (its idempotency key and
    the run id named after it), or None: the runtime's run layer names the run so."""
    return _SPAWN_CALL.get()


class SessionTools(ToolRegistry):
    """A session's tools: the runtime's registry (read live) plus its own built-ins."""

    def __init__(self, base: ToolRegistry, *own: Tool) -> None:
        super().__init__()
        self._base = base
        self._own = {tool.name: tool for tool in own}

    def get(self, name: str) -> Tool | None:
        return self._own.get(name) or self._base.get(name)

    def specs(self) -> tuple[ToolSpec, ...]:
        # a built-in shadows a host tool of its name (a registry given to the runtime
        # may hold one): a request never declares one name twice
        base = (spec for spec in self._base.specs() if spec.name not in self._own)
        return (*base, *(tool.spec for tool in self._own.values()))

    def names(self) -> tuple[str, ...]:
        return (*(name for name in self._base.names() if name not in self._own), *self._own)

    def __contains__(self, name: object) -> bool:
        return name in self._own or name in self._base

    def __iter__(self) -> Iterator[Tool]:
        base = (tool for tool in self._base if tool.name not in self._own)
        return iter((*base, *self._own.values()))

    def __len__(self) -> int:
        return len(self.names())


def spawn_tool_fn(rt: Runtime, session_id: str, agent: str) -> Callable[..., Awaitable[str]]:
    """The ``spawn_subagent`` tool of one session: spawn, wait, answer with the result
    (its ``reconcile`` check is :meth:`SpawnTool.reconcile`)."""
    return SpawnTool(rt, session_id, agent).spawn_subagent


class SpawnTool:
    """The ``spawn_subagent`` tool of one session (:meth:`spawn_subagent`) and its
    ``reconcile`` check (:meth:`reconcile`)."""

    def __init__(self, rt: Runtime, session_id: str, agent: str) -> None:
        self._rt = rt
        self._session = session_id
        self._agent = agent

    async def spawn_subagent(
        self,
        task: str,
        task_class: str | None = None,
        custom_timeout_ms: int | None = None,
        reason: str | None = None,
        max_steps: int | None = None,
    ) -> str:
        """Hand a self-contained task to a sub-agent and wait for its answer.

        Every spawn needs a time limit: a task_class (formatting: 2 min, code: 5 min,
        research: 10 min, deep: 15 min), or custom_timeout_ms with a reason saying why.
        Returns the sub-agent's answer, or a short notice if it did not complete.
        """
        if isinstance(task, str) and not task.strip():  # a run with nothing to answer
            raise ToolError(EMPTY_TASK_TEXT, error_class="spawn_refused")
        call = current_call()
        spawn = partial(
            self._spawn,
            call.idempotency_key if call is not None else None,
            task,
            task_class=cast(TaskClass | None, task_class),
            custom_timeout_ms=custom_timeout_ms,
            reason=reason,
            max_steps=max_steps,
        )
        try:
            handle = await anyio.to_thread.run_sync(spawn)
        except SpawnRefusedError as exc:
            raise ToolError(str(exc), error_class="spawn_refused") from exc
        ended = await wait_on_own_thread(handle.result)  # for the run's whole life
        if ended.outcome == "succeeded":
            return bounded_answer(ended.result, self._limit(), f"session:{ended.run_id}")
        # its recovery may run it again (announce=False: the answer is this call's)
        settles = partial(self._settles, handle)
        runs = _LineageRuns(self._rt.store, handle.run_id, self._limit(), settles)
        found = await _lineage_end(runs)
        return ended.notice if found is None else found

    def _limit(self) -> int:
        """The most an answer may hold (UTF-8 bytes): the runtime's registry's limit."""
        return self._rt.tools.max_result_bytes

    def _settles(self, handle: RunHandle, run_id: str) -> bool:
        """Whether this runtime may still move run ``run_id`` of the call's lineage on:
        its supervisor runs (it decides a failed run's recovery, sweeps a run whose actor
        is gone), or, once supervision gave up on the supervisor, the run's actor still
        runs here (its end is told as ever)."""
        return handle.supervised or self._rt.run(run_id) is not None

    def _spawn(self, key: str | None, task: str, **options: Any) -> RunHandle:
        """``rt.spawn`` for the call ``key`` (on a worker thread): its run named after the
        call, unless the log holds a run of that name already that the call's check did
        not take for its own (a run of that name would only watch the old one, and never
        end): that run gets an id of its own."""
        named = None
        if key is not None:
            run_id = call_run_id(key)
            if self._rt.store.stream_version(f"session:{run_id}") == 0:
                named = _SPAWN_CALL.set((key, run_id))
        try:
            return self._rt.spawn(
                self._session,
                task,
                agent=self._agent,
                announce=False,  # the answer goes back through the parent's model
                **options,
            )
        finally:
            if named is not None:
                _SPAWN_CALL.reset(named)

    async def reconcile(self, key: str, arguments: dict[str, Any]) -> str | None:
        """What a ``spawn_subagent`` call a crash cut short returns, from the log: None
        when it holds no run of the call (the call then spawns it), else what the call
        would have returned once the run's lineage ended: the result of the attempt that
        succeeded, or the static notice of the last one. A lineage still in play (the
        dead process's run, a ghost until the supervisor sweeps it; the attempt its
        recovery starts next) is waited for, within the tool's own time limit, while
        something here may still move it on (:meth:`_may_settle`)."""
        runs = _CallRuns(self._rt.store, self._session, key, self._limit(), self._may_settle)
        return await _lineage_end(runs)

    def _may_settle(self, run_id: str) -> bool:
        """Whether this runtime may still move run ``run_id`` of a call's lineage on, when
        a crash left it in play: its supervisor runs (it sweeps the run a dead process
        left, decides a failed run's recovery), or the run's actor runs here (a wake
        taken over in this process). Once supervision gave up on the supervisor, a
        dead process's run stays a ghost here: the call answers with its notice."""
        try:
            supervised = "supervisor" not in self._rt.given_up()
        except RuntimeError:  # the runtime is closing: its close ends the wait
            return True
        return supervised or self._rt.run(run_id) is not None


class _InPlay(enum.Enum):
    """A lineage with an attempt that may still run."""

    IN_PLAY = "in_play"


#: What a look at a call's runs finds: no run of it (None), the text the call answers,
#: or a lineage still in play
_Outcome = str | Literal[_InPlay.IN_PLAY] | None


async def _lineage_end(runs: _LineageRuns) -> str | None:
    """What the lineage ``runs`` follows ended with, waiting while it is in play: None
    when the log holds no run of it, else the result of the attempt that succeeded or the
    static notice of the last one (see :meth:`_LineageRuns.look`)."""
    while True:
        head, found = await anyio.to_thread.run_sync(runs.look)
        if found is not _InPlay.IN_PLAY:
            return found
        await wait_on_own_thread(runs.store.wait_for, head + 1, LOG_WAIT_S)


class _LineageRuns:
    """The runs of one lineage in the log: its first run and the attempts its recovery
    started after it (each run's ``next_run_id``), each folded as far as the log goes and
    read on from there at the next look. ``settles(run_id)``: whether something may still
    move a run the log leaves in play on (by default: yes, the supervisor); one nothing
    will move on ends the lineage with its notice (the last run with a task's)."""

    def __init__(
        self,
        store: EventStore,
        first: str,
        limit: int,
        settles: Callable[[str], bool] = lambda _run: True,
    ) -> None:
        self.store = store
        self._first = first
        self._limit = limit
        self._settles = settles
        self._runs: dict[str, RunState] = {}
        self._next: dict[str, str | None] = {}
        self._ours = False  # the first run's spawn is in the log (and is the one sought)

    def look(self) -> tuple[int, _Outcome]:
        """The log's head (read first: an append after it moves it on) and the lineage's
        outcome: None (no run of it), its result or notice, or ``IN_PLAY``."""
        head = self.store.head()
        return head, self._outcome()

    def _outcome(self) -> _Outcome:
        run_id, state = self._first, self._fold(self._first)
        if not self._ours:
            return None
        seen = {run_id}
        last = state  # the newest run of the lineage whose spawn is in the log
        while True:
            if state.status == "succeeded":
                return bounded_answer(state.result, self._limit, state.stream)
            if state.status in ("new", "running") or state.recovery is None:
                # a next attempt not started yet, one running, or a recovery to decide
                if self._settles(run_id):
                    return _InPlay.IN_PLAY
                return _notice(last)  # nothing here will move it on
            after = self._next.get(run_id)
            if state.recovery.action not in _RESPAWNS or after is None or after in seen:
                return _notice(state)  # delivered, escalated or split: the lineage ended
            run_id, state = after, self._fold(after)
            seen.add(run_id)
            if state.status != "new":
                last = state

    def _fold(self, run_id: str) -> RunState:
        state = self._runs.get(run_id) or RUN.initial(f"session:{run_id}")
        for record in self.store.read_stream(state.stream, state.version + 1):
            if record.version == 1:
                self._spawned(run_id, record.event)
            state = RUN.apply(state, record)
        self._runs[run_id] = state
        return state

    def _spawned(self, run_id: str, event: object) -> None:
        if not isinstance(event, SubagentSpawned):
            return  # no run's stream: a run's starts with its spawn
        self._next[run_id] = event.next_run_id
        if run_id == self._first:
            self._ours = self._is_sought(event)

    def _is_sought(self, event: SubagentSpawned) -> bool:
        """Whether the first run's spawn is the run sought (a live call's own run is)."""
        return True


class _CallRuns(_LineageRuns):
    """The runs of one ``spawn_subagent`` call a crash cut short: the run named after its
    key, if this parent spawned it for that key, and its lineage."""

    def __init__(
        self,
        store: EventStore,
        parent: str,
        key: str,
        limit: int,
        settles: Callable[[str], bool],
    ) -> None:
        super().__init__(store, call_run_id(key), limit, settles)
        self._parent = parent
        self._key = key

    def _is_sought(self, event: SubagentSpawned) -> bool:
        return event.parent == self._parent and event.call_key == self._key


def bounded_answer(answer: str, limit: int, stream: str) -> str:
    """A sub-agent's ``answer`` if its UTF-8 form is at most ``limit`` bytes, else its
    start within them (ended on a line break when one ends the second half) and a marker
    naming ``stream``, the run's stream, which keeps the whole answer."""
    kept = cut_start(answer, limit)
    if kept is None:
        return answer
    return kept + CUT_TEMPLATE.format(limit=limit, kept=len(kept), total=len(answer), stream=stream)


def _notice(state: RunState) -> str:
    """The static notice of a run that ended without success, as its actor and the
    supervisor word it."""
    ended = state.ended_at if state.ended_at is not None else state.started_at or 0.0
    runtime_ms = round((ended - (state.started_at or ended)) * 1000)
    return failure_notice(state.task, state.status, runtime_ms)
