"""What the Agent is told and asked, its settings, and the static texts the user may read.

The static texts are fixed sentences: a user-facing failure never carries an exception,
a provider's body or a secret, and no model is called to write it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from stalwart.providers import ProviderResponse
from stalwart.state import SessionState
from stalwart.tools import ToolOutcome

__all__ = [
    "ABANDONED_TEXT",
    "APPROVAL_TEXT",
    "DEGRADED_TEXT",
    "EMPTY_ANSWER_TEXT",
    "FAILED_TEXT",
    "MAX_STEPS_TEXT",
    "OVERFLOW_TEXT",
    "TIMEOUT_TEXT",
    "AgentLoopSettings",
    "AgentReport",
    "AgentStatus",
    "Deadline",
    "IsIdle",
    "ModelDone",
    "ModelError",
    "ResendDue",
    "SendDone",
    "SendsPending",
    "ToolsDone",
    "UserMessage",
]

#: The execution timeout fired: the turn was stopped.
TIMEOUT_TEXT = "Sorry, working on your message took far too long, so I stopped. Please try again."
#: Every model of the chain failed.
FAILED_TEXT = (
    "Sorry, the model did not answer: every configured model failed or timed out. "
    "Please try again in a moment."
)
#: The turn broke off and was not finished: the process or the Agent crashed (in memory,
#: at once on restart; in a durable session, once the worker gave up retrying it), or the
#: machinery broke rather than the model (a tool run, the context engine refusing or
#: failing to record, a bug), after the wake's retries.
ABANDONED_TEXT = (
    "Sorry, something went wrong while I was working on your message and I could not "
    "finish it. Please send it again."
)
#: The conversation no longer fits the model's context window.
OVERFLOW_TEXT = (
    "Sorry, this conversation is too long for the model to read. Please start a new conversation."
)
#: The turn used its ``max_steps`` model calls without reaching an answer.
MAX_STEPS_TEXT = (
    "Sorry, I reached the limit of steps I may take for one message without finishing. "
    "Please narrow the request and try again."
)
#: The agent's provider is degraded: no model call was made. Nothing answers the message
#: later by itself (the turn ends ``deferred``), so the text promises nothing.
DEGRADED_TEXT = (
    "The model provider is having trouble right now, so I cannot answer this message. "
    "Please send it again in a few minutes."
)
#: A tool that needs confirmation paused the session.
APPROVAL_TEXT = (
    "This step needs an approval before it can continue. The request is waiting for an "
    "operator's answer."
)

#: The model ended its turn with neither text (blank lines are none) nor tool calls.
EMPTY_ANSWER_TEXT = "Sorry, the model finished without writing an answer. Please try again."

Positive = Annotated[int, msgspec.Meta(ge=1)]

#: Why a model call produced no response: ``all_models_failed`` (a ProviderError after
#: the whole chain), ``context_overflow``, ``context_refused`` (the context engine
#: refused the session's write: fail-closed), or ``internal`` (anything else: a bug).
ModelError = Literal["all_models_failed", "context_overflow", "context_refused", "internal"]


class AgentLoopSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The agent loop's limits.

    ``max_steps``: model calls per turn; ``tool_limit``: tool calls run at once;
    ``execution_timeout_ms``: the whole-turn backstop (seed 000, ``supervision.
    execution_timeout_ms``); ``send_timeout_ms``: the deadline the Agent puts on one
    channel send; ``system_prompt``: prepended to every request when set.
    """

    max_steps: Positive = 10
    tool_limit: Positive = 4
    execution_timeout_ms: Positive = 600_000
    send_timeout_ms: Positive = 30_000
    system_prompt: str | None = None
    context_window: Positive = 128_000


# -- told -----------------------------------------------------------------------------------


class UserMessage(msgspec.Struct, frozen=True):
    """A user's message: starts a turn, or waits (FIFO) until the running one ends.

    ``message_id`` becomes the ``message:appended`` id (a new one when None)."""

    text: str
    message_id: str | None = None


class ModelDone(msgspec.Struct, frozen=True, kw_only=True):
    """A model call of ``turn_id``'s ``step`` ended: a response, or why there is none.

    ``error_class`` is the error's stable kind (``ProviderError.kind``), for the log."""

    turn_id: str
    step: int
    response: ProviderResponse | None = None
    error: ModelError | None = None
    error_class: str | None = None


class ToolsDone(msgspec.Struct, frozen=True, kw_only=True):
    """The tool calls run for ``turn_id``'s ``step`` ended (outcomes in the calls' order);
    ``error`` is set when running them broke (not a tool's failure: those are outcomes)."""

    turn_id: str
    step: int
    outcomes: tuple[ToolOutcome, ...] = ()
    error: str | None = None


class SendDone(msgspec.Struct, frozen=True, kw_only=True):
    """A channel send of ``announcement_id`` ended; ``error_class`` when it failed."""

    turn_id: str
    announcement_id: str
    ok: bool
    error_class: str | None = None
    path: Literal["announce", "direct"] = "announce"
    #: the receiver's Retry-After (ms) with the failure, if it sent one
    retry_after_ms: int | None = None


class Deadline(msgspec.Struct, frozen=True):
    """The execution-timeout timer of ``turn_id`` fired at ``at``."""

    turn_id: str
    at: float


class ResendDue(msgspec.Struct, frozen=True):
    """An announcement another sender may still have been sending is old enough now that
    its send cannot be in flight any more: send again what is still unsent."""


# -- asked ----------------------------------------------------------------------------------


class AgentStatus(msgspec.Struct, frozen=True):
    """Ask for the :class:`AgentReport` (what others appended to the session is folded
    in first)."""


class SendsPending(msgspec.Struct, frozen=True):
    """Ask how many of the Agent's sends are in flight (their outcome not recorded yet):
    a closing runtime gives them a moment to end before it stops the Agent."""


class IsIdle(msgspec.Struct, frozen=True):
    """Ask whether the Agent may be stopped now (passivation): no wake, no turn, no user
    message waiting and no send in flight. Answered in mailbox order, so a wake handed
    to it before the question makes it busy."""


class AgentReport(msgspec.Struct, frozen=True, kw_only=True):
    """The session as the Agent folded it, plus what only the live actor knows: the user
    messages waiting for a turn, the running turn's step and what it waits for."""

    session: SessionState
    queued: int = 0
    step: int = 0
    waiting_for: Literal["model", "tools"] | None = None

    @property
    def idle(self) -> bool:
        """No turn running and none waiting."""
        return self.session.current_turn is None and self.queued == 0
