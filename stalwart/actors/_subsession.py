"""A model-driven sub-agent run: an Agent on the run's own session stream.

:func:`subsession_work` makes the ``work`` a :class:`~stalwart.actors.SubAgentActor`
runs when the host gives none: it starts an Agent (``start_agent()``, on the run's
stream ``session:<run id>``), tells it the task as its user message, and follows the
stream until the turn completes. Each growth of the turn's ``prompt:activity`` tokens is
reported as progress (the total over the turn's model calls, the step being how many
calls were made), and the run's result is the turn's final answer. A turn that ends any
other way fails the run (:class:`SubsessionFailed`: its class, never a text, is what the
run records). The run ends once the Agent has also recorded the outcome of what the turn
announced (its answer or notice, on the run's private channel): the Agent is stopped
when the work ends or is cancelled, and stopped earlier it would leave that announcement
queued in the log for ever, which an Agent started on the stream later would send again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio.to_thread
import pykka

from stalwart._aio import wait_on_own_thread
from stalwart._logs import get_logger
from stalwart.clock import SystemClock
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementSendFailed,
    MessageAppended,
    PromptActivity,
    TurnCompleted,
    TurnStarted,
)
from stalwart.store import EventStore

from ._agent_messages import UserMessage
from ._subagent import RunReport, Work

__all__ = ["SETTLE_S", "WAIT_SLICE_S", "SubsessionFailed", "subsession_work"]

log = get_logger(__name__)

#: How long one wait on the log lasts before the follower checks it was cancelled.
WAIT_SLICE_S = 0.5
#: How long, in real time, a run whose turn ended waits for its Agent to record the
#: outcome of what the turn announced (a send to the run's private MemoryChannel ends at
#: once; the send's own timeout runs on the Clock, which a fake one may never move).
SETTLE_S = 5.0
_REAL_TIME = SystemClock()


class SubsessionFailed(RuntimeError):
    """The sub-session's turn ended without an answer (``outcome`` says how)."""

    def __init__(self, outcome: str) -> None:
        super().__init__(f"the sub-session's turn ended {outcome!r}, not answered")
        self.outcome = outcome


class _Follower:
    """What the stream says so far about the one turn of the sub-session."""

    def __init__(self) -> None:
        self.version = 0
        self.turn: str | None = None
        self.answer = ""
        self.tokens: dict[str, int] = {}
        self.ended: str | None = None
        #: announcements queued with no outcome recorded yet
        self.unsent: set[str] = set()

    def add(self, event: object) -> None:
        match event:
            case TurnStarted(turn_id=turn_id) if self.turn is None:
                self.turn = turn_id
            case PromptActivity(call_id=call_id, tokens=tokens):
                self.tokens[call_id] = max(tokens, self.tokens.get(call_id, 0))
            case MessageAppended(role="assistant", turn_id=turn_id) if turn_id == self.turn:
                self.answer = event.content
            case TurnCompleted(turn_id=turn_id, outcome=outcome) if turn_id == self.turn:
                self.ended = outcome
            case AnnouncementQueued(announcement_id=announcement_id):
                self.unsent.add(announcement_id)
            case AnnouncementDelivered() | AnnouncementSendFailed():
                self.unsent.discard(event.announcement_id)
            case _:
                pass


def _follow(store: EventStore, stream: str, report: RunReport, stop: threading.Event) -> str:
    """Block until the turn completes (a worker thread): its answer, or raise."""
    follower = _Follower()
    reported = 0
    settle_by: float | None = None  # the turn ended: its announcements' outcomes, until
    while not stop.is_set():
        head = store.head()
        for record in store.read_stream(stream, follower.version + 1):
            follower.version = record.version
            follower.add(record.event)
        total = sum(follower.tokens.values())
        if total > reported:
            reported = total
            report.progress(total, len(follower.tokens))
        if follower.ended is not None:
            now = _REAL_TIME.monotonic()
            settle_by = now + SETTLE_S if settle_by is None else settle_by
            if not follower.unsent or now >= settle_by:
                if follower.unsent:
                    log.warning("subsession.announcement_unsettled", stream=stream)
                if follower.ended == "answered":
                    return follower.answer
                raise SubsessionFailed(follower.ended)
        store.wait_for(head + 1, WAIT_SLICE_S)
    return ""


def subsession_work(
    store: EventStore, run_id: str, task: str, start_agent: Callable[[], pykka.ActorRef[Any]]
) -> Work:
    """The ``work`` of a model-driven run (see the module's docstring)."""
    stream = f"session:{run_id}"

    async def work(report: RunReport) -> str:
        ref = await anyio.to_thread.run_sync(start_agent)
        stop = threading.Event()
        try:
            ref.tell(UserMessage(task))
            follow = partial(_follow, store, stream, report, stop)
            return await wait_on_own_thread(follow)  # for the run's whole life
        finally:
            stop.set()
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)

    return work
