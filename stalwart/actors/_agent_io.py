"""The Agent's I/O on the portal, and the messages its finished futures turn into.

The coroutines run on the :class:`~stalwart.actors.IoPortal`'s loop; the ``*_done``
functions run in a future's done-callback (the portal's thread, or the thread that
cancelled it), so they only build a message: a cancelled future makes none (its turn
was stopped on purpose). No error text goes into a message, only stable classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal

from stalwart._logs import get_logger
from stalwart.channels import RetryAfterNoted
from stalwart.clock import Clock
from stalwart.context import ContextScopeError
from stalwart.errors import CallSealedError, ContextOverflowError, FencedError, ProviderError
from stalwart.events import ToolCall
from stalwart.providers import CallSeal, ProviderResponse
from stalwart.tools import Timer, ToolOutcome, ToolRegistry, run_tools

from ._agent_messages import ModelDone, ModelError, SendDone, ToolsDone
from ._scheduler import TimerHandle
from ._send import retry_after_of

__all__ = ["LiveTurn", "model_done", "run_calls", "sent", "tools_done"]

log = get_logger(__name__)

#: The longest an Agent ending a turn waits for an append of its model call under way
#: (one durable append; the loop must run to say it ended).
SEAL_WAIT_S = 2.0


class LiveTurn:
    """The running turn, as only the live actor knows it (what is in flight)."""

    __slots__ = ("blocked", "calls", "future", "seal", "started_at", "step", "timer", "turn_id")

    def __init__(self, turn_id: str, started_at: float) -> None:
        self.turn_id = turn_id
        self.started_at = started_at
        self.step = 0
        self.future: Future[Any] | None = None
        self.timer: TimerHandle | None = None
        self.calls: tuple[ToolCall, ...] = ()
        self.blocked: dict[int, ToolOutcome] = {}  # position in calls -> blocked outcome
        self.seal: CallSeal | None = None  # the model call in flight's hold on the log

    def waiting_for(self) -> Literal["model", "tools"] | None:
        if self.future is None:
            return None
        return "tools" if self.calls else "model"

    def seal_call(self) -> None:
        """Before the turn's end is appended: nothing more of its model call in flight
        reaches the log (an append of it under way lands first; waited for up to
        :data:`SEAL_WAIT_S`)."""
        seal, self.seal = self.seal, None
        if seal is not None and not seal.seal(SEAL_WAIT_S):
            log.warning("agent.call_seal_timed_out", turn_id=self.turn_id, waited_s=SEAL_WAIT_S)

    def stop(self) -> None:
        """Cancel the timer and whatever is in flight (the portal cancels the task); its
        model call, sealed first, records nothing more (a lost lease's fence is lifted
        next, and a stopped actor's turn is closed by the next one)."""
        self.seal_call()
        if self.timer is not None:
            self.timer.cancel()
        if self.future is not None:
            self.future.cancel()
            self.future = None


async def run_calls(
    registry: ToolRegistry,
    calls: tuple[ToolCall, ...],
    limit: int,
    keys: Mapping[str, str],
    reconcile: frozenset[str],
    clock: Clock,
    timer: Timer,
) -> tuple[ToolOutcome, ...]:
    """Run ``calls``, at most ``limit`` at once (outcomes in the calls' order), each with
    its idempotency key; the ``reconcile`` ones are checked by their tool first. Each
    call's time limit and duration are kept on the runtime's ``clock`` (``timer``)."""
    return await run_tools(
        registry, calls, limit=limit, keys=keys, reconcile=reconcile, clock=clock, timer=timer
    )


def model_done(turn_id: str, step: int, future: Future[ProviderResponse]) -> ModelDone | None:
    """The message a finished model call makes."""
    if future.cancelled():
        return None
    exc = future.exception()
    if isinstance(exc, CallSealedError):  # its turn has ended: nobody waits for it
        return None
    if exc is None:
        return ModelDone(turn_id=turn_id, step=step, response=future.result())
    error: ModelError
    if isinstance(exc, ContextOverflowError):
        error = "context_overflow"
        return ModelDone(turn_id=turn_id, step=step, error=error, error_class=exc.kind)
    if isinstance(exc, ContextScopeError):
        log.error("agent.context_refused", turn_id=turn_id)
        return ModelDone(turn_id=turn_id, step=step, error="context_refused", error_class="scope")
    if isinstance(exc, ProviderError):
        error = "all_models_failed"
        return ModelDone(turn_id=turn_id, step=step, error=error, error_class=exc.kind)
    if isinstance(exc, FencedError):  # the lease moved on: the Agent's next append says so
        log.warning("agent.model_call_fenced", turn_id=turn_id, stream=exc.stream)
    else:
        log.error("agent.model_call_broke", turn_id=turn_id, error_type=type(exc).__name__)
    return ModelDone(turn_id=turn_id, step=step, error="internal", error_class=type(exc).__name__)


def tools_done(
    turn_id: str, step: int, future: Future[tuple[ToolOutcome, ...]]
) -> ToolsDone | None:
    """The message a finished tool run makes (``error``: running them broke, a bug)."""
    if future.cancelled():
        return None
    exc = future.exception()
    if exc is None:
        return ToolsDone(turn_id=turn_id, step=step, outcomes=future.result())
    log.error("agent.tool_run_broke", turn_id=turn_id, error_type=type(exc).__name__)
    return ToolsDone(turn_id=turn_id, step=step, error=type(exc).__name__)


def sent(
    turn_id: str,
    announcement_id: str,
    path: Literal["announce", "direct"],
    noted: RetryAfterNoted | None,
    future: Future[str | None],
) -> SendDone | None:
    """The message a finished channel send makes (``future``: what
    :func:`~stalwart.actors._send.send_by_clock` gives, None when delivered, else the
    failure's word; ``noted``: the channel it sent through, with the receiver's
    Retry-After of a failure)."""
    if future.cancelled():
        return None
    exc = future.exception()
    error_class = future.result() if exc is None else type(exc).__name__
    return SendDone(
        turn_id=turn_id,
        announcement_id=announcement_id,
        ok=error_class is None,
        error_class=error_class,
        path=path,
        retry_after_ms=retry_after_of(noted, error_class),
    )
