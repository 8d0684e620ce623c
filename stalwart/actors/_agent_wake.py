"""What a wake needs from the log beyond the conversation, and its pure choices.

:class:`WakeLedger` folds, next to the Agent's view, the session's activations, which
user messages are in the conversation, the tool calls that started and those that have
a result, the pause requests with their answers, the announcements queued and not sent
yet, and whether the worker gave up on an activation the user was never answered for.
From it:

- :meth:`WakeLedger.unanswered` the tool calls of the last assistant message that have
  no result yet (a paused step to resume, or a step a crash cut short);
- :func:`pause_for` whether a call must stop the session first (a tool that needs
  confirmation, or a custom tool the host implements, called with arguments it can
  take) and with which request;
- :func:`wake_result` how a turn's end settles its wake.
"""

from __future__ import annotations

import msgspec

from stalwart._text import escaped
from stalwart.context.pipeline import safe_label
from stalwart.events import (
    ActivationAbandoned,
    ActivationLeased,
    ActivationReady,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    MessageAppended,
    RecordedEvent,
    SessionRequiresAction,
    ToolCall,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    UserCustomToolResult,
    UserInterrupt,
    UserToolConfirmation,
)
from stalwart.ids import new_id
from stalwart.state import (
    ACTIVATIONS,
    DRAFTS,
    ActivationsState,
    Draft,
    DraftsState,
    SeenMessage,
    WakeResult,
    apply_drafts,
    decide_pause,
    pause_kind,
    remember_message,
)
from stalwart.tools import Tool, ToolOutcome, parse_arguments

__all__ = [
    "DENIED_TEXT",
    "DRAFTS_NOTED",
    "INTERRUPTED_TEXT",
    "NO_HUMAN_TEXT",
    "REPEATED_OUTCOME",
    "UNRECONCILED_TEXT",
    "WAKE_PREFIX",
    "LedgerState",
    "Resolution",
    "WakeLedger",
    "cut_short",
    "drafts_note",
    "needs_human",
    "pause_for",
    "wake_result",
]

#: What the model reads for a call the user refused.
DENIED_TEXT = "The user denied this tool call; it was not run."
#: What the model reads for a call of a step an operator interrupted before it ran.
INTERRUPTED_TEXT = "The session was interrupted before this tool call ran; it was not run."
#: What the model reads for a call that needs a person (an approval, or a custom tool's
#: output from the host) where nobody can be asked: a sub-agent run.
NO_HUMAN_TEXT = (
    "This tool needs a person's approval or the host's answer, which cannot be asked for "
    "here; it was not run."
)
#: What the model reads for a call a crash cut short that its tool cannot confirm.
UNRECONCILED_TEXT = (
    "This tool call was cut off before its outcome was recorded (a restart, a timeout or "
    "an interrupt) and may or may not have taken effect; it was not run again. Check its "
    "effect before repeating it."
)
#: The outcome a wake is acked with when every message it carries was given to the
#: session before (a redelivery): it ran no turn, so the user gets no second reply.
REPEATED_OUTCOME = "already_answered"
#: How a delayed wake's text enters the conversation.
WAKE_PREFIX = "[scheduled wake] "
#: The most open drafts a request's system prompt lists (the newest; draft_list has all).
DRAFTS_NOTED = 20

#: Turn-ending reasons the wake retries: the machinery broke, not the model. A model
#: failure is not among them: the provider layer already retried it (with fallbacks) and
#: the user has been told; a crash of the Agent mid-wake is retried by the worker.
RETRYABLE_REASONS = frozenset({"internal", "tools_broke"})


class Resolution(msgspec.Struct, frozen=True):
    """A pause's answer: ``allow``, ``deny`` or ``output`` (a custom tool's result)."""

    kind: str
    output: str = ""


class Unsent(msgspec.Struct, frozen=True):
    """An announcement with no outcome in the log: when it was queued (how old the news
    is) and when its latest send began (its queueing, or an ``announcement:resent``)."""

    queued: AnnouncementQueued
    queued_at: float
    sent_at: float


class LedgerState(msgspec.Struct, frozen=True, kw_only=True):
    """A :class:`WakeLedger` at rest: the same fields, frozen (the Agent's snapshot)."""

    activations: ActivationsState
    drafts: DraftsState
    message_ids: frozenset[str] = frozenset()
    recent: tuple[SeenMessage, ...] = ()
    last_calls: tuple[ToolCall, ...] = ()
    call_ids: frozenset[str] = frozenset()
    interrupted: frozenset[str] = frozenset()
    results: frozenset[str] = frozenset()
    started: frozenset[str] = frozenset()
    requests: dict[str, SessionRequiresAction] = msgspec.field(default_factory=dict)
    resolutions: dict[str, Resolution] = msgspec.field(default_factory=dict)
    unsent: dict[str, Unsent] = msgspec.field(default_factory=dict)
    announced: bool = False
    abandoned: float | None = None
    repeats: frozenset[str] = frozenset()

    @classmethod
    def initial(cls, stream: str) -> LedgerState:
        return cls(activations=ACTIVATIONS.initial(stream), drafts=DRAFTS.initial(stream))


class WakeLedger:
    """The wake's bookkeeping, folded record by record beside the Agent's view."""

    __slots__ = (
        "abandoned",
        "activations",
        "announced",
        "call_ids",
        "drafts",
        "interrupted",
        "last_calls",
        "message_ids",
        "recent",
        "repeats",
        "requests",
        "resolutions",
        "results",
        "started",
        "unsent",
    )

    def __init__(self, stream: str, state: LedgerState | None = None) -> None:
        """An empty ledger, or one that goes on from ``state`` (see :meth:`state`)."""
        if state is None:
            state = LedgerState.initial(stream)
        self.activations: ActivationsState = state.activations
        self.drafts: DraftsState = state.drafts
        self.message_ids: set[str] = set(state.message_ids)
        #: the newest user messages given to the session (``remember_message``)
        self.recent: tuple[SeenMessage, ...] = state.recent
        self.last_calls: tuple[ToolCall, ...] = state.last_calls
        #: every call id of the session's assistant messages
        self.call_ids: set[str] = set(state.call_ids)
        #: the last calls an interrupt closed unanswered
        self.interrupted: set[str] = set(state.interrupted)
        self.results: set[str] = set(state.results)
        self.started: set[str] = set(state.started)
        #: request id -> the request
        self.requests: dict[str, SessionRequiresAction] = dict(state.requests)
        self.resolutions: dict[str, Resolution] = dict(state.resolutions)  # call id -> answer
        #: announcement id -> the announcement and its times, until its send ends
        self.unsent: dict[str, Unsent] = dict(state.unsent)
        self.announced = state.announced  # an announcement was queued since the latest lease
        #: when an activation was given up on with nothing announced since its lease
        #: (None once a notice or the turn's close for it is in the log)
        self.abandoned: float | None = state.abandoned
        #: the unsettled message activations that carry a message the session was given
        #: before (a redelivery the newest ``MESSAGES_KEPT`` ids no longer caught)
        self.repeats: set[str] = set(state.repeats)

    def state(self) -> LedgerState:
        """The ledger as a frozen value (what the Agent's snapshot keeps)."""
        return LedgerState(
            activations=self.activations,
            drafts=self.drafts,
            message_ids=frozenset(self.message_ids),
            recent=self.recent,
            last_calls=self.last_calls,
            call_ids=frozenset(self.call_ids),
            interrupted=frozenset(self.interrupted),
            results=frozenset(self.results),
            started=frozenset(self.started),
            requests=dict(self.requests),
            resolutions=dict(self.resolutions),
            unsent=dict(self.unsent),
            announced=self.announced,
            abandoned=self.abandoned,
            repeats=frozenset(self.repeats),
        )

    def add(self, record: RecordedEvent) -> None:
        self.activations = ACTIVATIONS.apply(self.activations, record)
        self.recent = remember_message(self.recent, record.event)
        self.drafts = apply_drafts(self.drafts, record)
        event = record.event
        self._note_repeat(event)
        match event:
            case MessageAppended():
                self.message_ids.add(event.message_id)
                if event.role == "assistant":  # a new step: what was open is settled
                    self.last_calls = event.tool_calls
                    self.call_ids.update(call.id for call in event.tool_calls)
                    self.results.clear()
                    self.resolutions.clear()
                    self.interrupted.clear()
                elif event.role == "tool" and event.tool_call_id is not None:
                    self.results.add(event.tool_call_id)
                    self.started.discard(event.tool_call_id)
            case ToolStarted():
                self.started.add(event.call_id)
            case ToolFailed(error_class="unreconciled"):
                # surfaced, but its result is not in the conversation until the step's
                # results are: a step resumed again (its turn ended first) must surface it
                # again, never run it
                pass
            case ToolCompleted() | ToolFailed():
                self.started.discard(event.call_id)
            case SessionRequiresAction():
                self.requests[event.request_id] = event
            case UserToolConfirmation():
                self._resolve(event.request_id, Resolution("allow" if event.allow else "deny"))
            case UserCustomToolResult():
                self._resolve(event.request_id, Resolution("output", event.output))
            case UserInterrupt():  # the open calls are closed: none runs or asks again
                self.requests.clear()
                self.resolutions.clear()
                self.interrupted = {call.id for call in self.unanswered()}
            case AnnouncementQueued():
                self.unsent[event.announcement_id] = Unsent(event, record.ts, record.ts)
                self.announced, self.abandoned = True, None
            case AnnouncementDelivered() | AnnouncementSendFailed():
                self.unsent.pop(event.announcement_id, None)
            case AnnouncementResent() if event.announcement_id in self.unsent:
                unsent = self.unsent[event.announcement_id]
                self.unsent[event.announcement_id] = msgspec.structs.replace(
                    unsent, sent_at=record.ts
                )
            case ActivationLeased():
                self.announced = False
            case ActivationAbandoned() if not self.announced and self.abandoned is None:
                self.abandoned = record.ts
            case TurnCompleted(reason="abandoned"):
                self.abandoned = None
            case _:
                pass

    def _note_repeat(self, event: Event) -> None:
        """Keep :attr:`repeats` (the activations are folded already)."""
        if self.repeats:  # settled (acked, cancelled ...): no longer of interest
            self.repeats.intersection_update(a.activation_id for a in self.activations.queue)
        if (
            isinstance(event, ActivationReady)
            and event.kind == "message"
            and event.message_id
            and self._given(event.message_id, event.activation_id)
        ):
            self.repeats.add(event.activation_id)

    def _given(self, message_id: str, activation_id: str) -> bool:
        """Whether the session was given ``message_id`` before ``activation_id`` carried
        it: it is in the conversation, or another activation still queued carries it."""
        return message_id in self.message_ids or any(
            a.message_id == message_id and a.activation_id != activation_id
            for a in self.activations.queue
        )

    def repeated(self, activation_id: str) -> bool:
        """Whether the activation carries a message given to the session before (its
        answer is the earlier one's): its wake records it not again and answers it not
        again."""
        return activation_id in self.repeats

    def _resolve(self, request_id: str, resolution: Resolution) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and request.call_id is not None:
            self.resolutions[request.call_id] = resolution

    def unanswered(self) -> tuple[ToolCall, ...]:
        """The last assistant message's tool calls that have no result in the log."""
        return tuple(call for call in self.last_calls if call.id not in self.results)

    def distinct_ids(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        """``calls`` with a fresh id for each whose id is empty or was used before in the
        session (a provider that numbers calls per response, or sends none): a result, an
        answer or a pause then always belongs to one call."""
        seen = set(self.call_ids)
        fresh = []
        for call in calls:
            named = call
            if not call.id or call.id in seen:
                named = msgspec.structs.replace(call, id=f"call_{new_id()[:24]}")
            seen.add(named.id)
            fresh.append(named)
        return tuple(fresh)

    def cut_short(self, call: ToolCall) -> bool:
        """Whether the call started and a crash stopped it before its outcome was recorded."""
        return call.id in self.started


def cut_short(call: ToolCall) -> ToolOutcome:
    """The outcome of a call whose turn ended while it ran (the execution timeout): it
    may or may not have taken effect, and it is never run again (``unreconciled``)."""
    return ToolOutcome(
        call_id=call.id,
        tool=call.name,
        status="error",
        text=UNRECONCILED_TEXT,
        error_class="unreconciled",
    )


def needs_human(tool: Tool | None) -> bool:
    """Whether a call of ``tool`` needs a person: its approval, or the host's output."""
    return tool is not None and (
        pause_kind(custom=tool.custom, needs_confirmation=tool.needs_confirmation) is not None
    )


def pause_for(
    tool: Tool | None, call: ToolCall, ledger: WakeLedger, turn_id: str
) -> SessionRequiresAction | None:
    """The request that must stop the session before ``call`` runs, or None (the pure
    :func:`~stalwart.state.decide_pause`, with the tool's registration as its kind).
    A call whose arguments its tool cannot take asks nobody: it ends ``invalid_arguments``
    and the model reads why, so a person is asked only about a call that can run."""
    if tool is None or isinstance(parse_arguments(tool, call.arguments), str):
        return None
    request = decide_pause(
        call,
        pause_kind(custom=tool.custom, needs_confirmation=tool.needs_confirmation),
        answered=call.id in ledger.resolutions or call.id in ledger.interrupted,
        turn_id=turn_id,
    )
    return None if request is None else msgspec.structs.replace(request, request_id=new_id())


def drafts_note(
    drafts: list[Draft], *, limit: int | None = None, as_written: bool = False
) -> str | None:
    """The note on drafts still open (None when there are none): each one, or given a
    ``limit``, the ``limit`` written last and how many more there are (the system
    prompt's note: a long session may leave many open). A path is the model's: on the
    system prompt's trusted lines it is reduced to a safe label, said to be one when it
    differs; ``as_written`` (``draft_list``'s answer, a tool result) shows it as it is,
    which is what draft_read and draft_commit take."""
    if not drafts:
        return None
    shown = drafts
    if limit is not None and len(drafts) > limit:
        newest = sorted(drafts, key=lambda d: d.updated_at, reverse=True)[:limit]
        shown = sorted(newest, key=lambda d: d.path)
    lines = [
        f"- {_draft_label(d.path, as_written)} (revision {d.revision}, {d.size} bytes, "
        f"sha256 {d.content_hash[:12]})"
        for d in shown
    ]
    if len(shown) < len(drafts):
        lines.append(f"- and {len(drafts) - len(shown)} older ones (draft_list shows them all)")
    return (
        "Drafts staged in this session's workspace and not committed yet (continue them "
        "with draft_read; nothing reaches the shared resource until draft_commit; "
        "draft_discard drops one no longer needed):\n" + "\n".join(lines)
    )


def _draft_label(path: str, as_written: bool) -> str:
    if as_written:  # draft_write refuses control characters (an older log's, escaped)
        return escaped(path)
    label = safe_label(path)
    if label == path:
        return label
    return f"{label} (a label: draft_list shows its path as written)"


def wake_result(outcome: str, reason: str | None) -> WakeResult:
    """A turn's end as its wake's result: a failure a retry may fix requeues the wake."""
    if outcome == "failed" and reason in RETRYABLE_REASONS:
        return WakeResult(status="failed", error_class=reason, retryable=True)
    return WakeResult(status="ok", outcome=outcome)
