"""The Agent: the only writer of one session's stream, running the agent loop.

A turn is model call -> tool calls (run concurrently, at most ``tool_limit`` at once) ->
tool results -> the next model call, until the model answers without tool calls or the
turn has made ``max_steps`` model calls. Every step is appended before it is acted on,
and the actor never blocks on the network: model calls, tool runs and channel sends are
submitted to the :class:`~stalwart.actors.IoPortal` and their outcomes come back as
messages (:class:`ModelDone`, :class:`ToolsDone`, :class:`SendDone`), which the actor folds
like anything else. A result of a turn that is no longer running is dropped, so a turn
ends in exactly one user-facing message: the answer, or one static text.

What ends a turn, besides an answer:

- the **execution timeout** (``execution_timeout_ms`` after ``turn:started``, a scheduler
  timer keyed by the turn): ``execution:aborted`` (``pipeline_timeout``), the in-flight
  call is cancelled (which closes its HTTP request), tool calls still running are closed
  as cut short (``tool:failed`` ``unreconciled``, never run again), :data:`TIMEOUT_TEXT`,
  outcome ``aborted``;
- every model failing: :data:`FAILED_TEXT` (:data:`OVERFLOW_TEXT` for a context
  overflow), outcome ``failed``;
- the machinery breaking, not the model (``tools_broke``, ``internal``,
  ``context_refused``): :data:`ABANDONED_TEXT`, outcome ``failed``; in a wake, the first
  two are retried first and the user hears only of the last attempt;
- ``max_steps`` model calls with tool calls still coming: :data:`MAX_STEPS_TEXT`;
- a degraded provider (``is_degraded(provider)`` before a model call): no call is made,
  :data:`DEGRADED_TEXT` at once, outcome ``deferred``; the user message stays in the log.

User messages that arrive while a turn runs wait in memory (FIFO) and are appended when
their turn starts. On start the actor folds its stream; a turn that a crash left running
is closed with ``turn:completed`` outcome ``interrupted`` and :data:`ABANDONED_TEXT`
(resuming it is a later step; a durable session's worker retries the wake instead, and
when it gives up the Agent closes the turn as ``failed`` / ``abandoned`` with the same
text). An announcement whose send a crash cut short is sent again on start, when it was
queued within :data:`RESEND_WITHIN_S`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, Literal

import pykka

from stalwart._logs import get_logger
from stalwart.channels import Channel, MessageKind, OutboundMessage
from stalwart.clock import Clock
from stalwart.context import ModelProfile
from stalwart.errors import ConcurrencyError, FencedError, StoreClosedError, StoreError
from stalwart.events import (
    ActivationRequeued,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    MessageAppended,
    PromptTimeout,
    RecordedEvent,
    SessionCreated,
    SessionRequiresAction,
    ToolCall,
    TurnCompleted,
    TurnStarted,
)
from stalwart.ids import new_id
from stalwart.providers import CallSeal, ModelCaller, ProviderRequest, ProviderResponse
from stalwart.state import (
    RESEND_WITHIN_S,
    SUBSESSION_CHANNEL_PREFIX,
    Activation,
    ActivationPolicy,
    WakeResult,
    decide_message,
    decide_prompt_timeout,
    decide_settlement,
)
from stalwart.store import NO_STREAM, EventStore, Fence, NewEvent, load_state
from stalwart.tools import (
    DEFAULT_MAX_RESULT_BYTES,
    ToolOutcome,
    ToolRegistry,
    blocked_outcome,
    bounded_text,
    decide_tool_call,
    outcome_event,
    started_event,
)

from ._agent_context import ContextGate, call_through_context, context_budget
from ._agent_fold import (
    AGENT_VIEW,
    AgentViewFolder,
    decide_execution_timeout,
    execution_deadline,
    request_messages,
)
from ._agent_io import LiveTurn, model_done, run_calls, sent, tools_done
from ._agent_messages import (
    ABANDONED_TEXT,
    APPROVAL_TEXT,
    DEGRADED_TEXT,
    EMPTY_ANSWER_TEXT,
    FAILED_TEXT,
    MAX_STEPS_TEXT,
    OVERFLOW_TEXT,
    TIMEOUT_TEXT,
    AgentLoopSettings,
    AgentReport,
    AgentStatus,
    Deadline,
    IsIdle,
    ModelDone,
    ResendDue,
    SendDone,
    SendsPending,
    ToolsDone,
    UserMessage,
)
from ._agent_wake import (
    DENIED_TEXT,
    DRAFTS_NOTED,
    INTERRUPTED_TEXT,
    NO_HUMAN_TEXT,
    REPEATED_OUTCOME,
    UNRECONCILED_TEXT,
    WAKE_PREFIX,
    WakeLedger,
    cut_short,
    drafts_note,
    needs_human,
    pause_for,
    wake_result,
)
from ._context import Assemble
from ._deadletter import Enqueue, dead_letter
from ._portal import IoPortal
from ._restarts import crashed
from ._scheduler import Scheduler
from ._send import RESEND_GRACE_S, clock_timer, noting, send_by_clock
from ._supervised import Supervised
from ._worker import Abandoned, LeaseLost, Wake, WakeEnded

__all__ = ["AgentActor", "left_unsaid", "yours_to_say"]

log = get_logger(__name__)

#: How often an append expecting the folded version (a resend's record, a message) is
#: tried while other appends keep winning the stream.
RACE_TRIES = 3


def left_unsaid(store: EventStore, stream: str, now: float) -> bool:
    """Whether a session's log, with no live lease (a wake running elsewhere speaks for
    itself), holds news within :data:`RESEND_WITHIN_S` that nobody may be telling: an
    announcement whose send never ended (a close or a crash cut it short; or its sender
    is still at it, which the Agent tells apart by its age), or an activation the worker
    gave up on that nobody told the user about. Its Agent, once started, says it. Only
    sessions a runtime created (``session:created`` first) count, and only announcements
    the Agent would send (:func:`yours_to_say`): a sub-agent run's own announcements are
    its internals."""
    first = next(iter(store.read_stream(stream, 1, 1)), None)
    if first is None or not isinstance(first.event, SessionCreated):
        return False
    ledger = load_state(store, stream, AGENT_VIEW).ledger  # from the Agent's snapshot
    lease = ledger.activations.lease
    if lease is not None and lease.expires_at > now:
        return False
    if ledger.abandoned is not None and now - ledger.abandoned <= RESEND_WITHIN_S:
        return True
    channel = first.event.channel
    return any(
        now - unsent.queued_at <= RESEND_WITHIN_S and yours_to_say(unsent.queued, channel)
        for unsent in ledger.unsent.values()
    )


def yours_to_say(queued: AnnouncementQueued, *channels: str | None) -> bool:
    """Whether an Agent whose channel goes by ``channels`` (its key in the runtime, the
    channel's own name, the one its session recorded) may send ``queued`` again: every
    announcement but another sub-agent run's answer to that run's private channel
    (``subagent:<run id>``), found in a run's stream opened as a session. A name that
    differs otherwise (a log that recorded the channel's own name, a channel renamed or
    gone from the config) is still the session's news for its user. Never a completion
    batch's record whose text another run's record holds (``text_run``): it carries no
    text, and the supervisor sends the batch again from that run."""
    if queued.text_run is not None:
        return False
    return queued.channel in channels or not queued.channel.startswith(SUBSESSION_CHANNEL_PREFIX)


#: What an announcement is (``announcement:queued``): the answer, or a static text.
Kind = Literal["completion", "failure_notice", "static_reply"]
Outcome = Literal["answered", "failed", "aborted", "deferred"]
#: The channel's kind of each announcement kind.
_MESSAGE_KIND: dict[Kind, MessageKind] = {
    "completion": "reply",
    "failure_notice": "failure_notice",
    "static_reply": "static_reply",
}


class AgentActor(Supervised):
    """Runs the agent loop of one session; the only writer of ``session:<session_id>``.

    Start with ``AgentActor.start(session_id, store, clock, scheduler, portal, caller,
    tools, channel, conversation=..., thread=..., settings=..., is_degraded=...)``.
    Tell it :class:`UserMessage`; ask it :class:`AgentStatus` (always with a timeout)
    for an :class:`AgentReport`. ``is_degraded(provider)`` must be cheap and
    thread-safe (a :class:`HealthView`'s ``is_degraded`` is). A send that fails is
    recorded and, given ``dead_letters`` (a DeadLetterActor), queued there for retries.
    ``on_crash(exception class name)`` is called once if the actor dies of an exception.
    """

    def __init__(
        self,
        session_id: str,
        store: EventStore,
        clock: Clock,
        scheduler: Scheduler,
        portal: IoPortal,
        caller: ModelCaller,
        tools: ToolRegistry,
        channel: Channel,
        *,
        conversation: str | None = None,
        thread: str | None = None,
        settings: AgentLoopSettings | None = None,
        is_degraded: Callable[[str], bool] | None = None,
        dead_letters: pykka.ActorRef[Any] | None = None,
        agent_name: str = "default",
        on_crash: Callable[[str], object] | None = None,
        policy: ActivationPolicy | None = None,
        worker: Callable[[object], object] | None = None,
        jitter_ms: Callable[[], int] | None = None,
        hold: Callable[[str, Fence | None], object] | None = None,
        context: ContextGate | None = None,
        profile: ModelProfile | None = None,
        channel_name: str | None = None,
    ) -> None:
        super().__init__()
        self._stream = f"session:{session_id}"
        self._store = store
        self._clock = clock
        self._scheduler = scheduler
        self._portal = portal
        self._caller = caller
        self._tools = tools
        self._channel = channel
        #: what the log records as the channel: the key the runtime finds it by
        self._channel_name = channel_name if channel_name is not None else channel.name
        self._conversation = conversation if conversation is not None else session_id
        self._thread = thread
        self._settings = settings or AgentLoopSettings()
        self._is_degraded = is_degraded
        self._dead_letters = dead_letters
        self._agent_name = agent_name
        self._on_crash = on_crash
        #: announcement id -> (text, kind), until its send ends
        self._unsent: dict[str, tuple[str, MessageKind]] = {}
        self._folder = AgentViewFolder(AGENT_VIEW.initial(self._stream))
        self._turn: LiveTurn | None = None
        self._queue: deque[UserMessage] = deque()
        # durable mode (a policy given): turns run as leased wakes, appends are fenced
        self._policy = policy
        self._worker = worker
        self._jitter_ms = jitter_ms
        self._hold = hold
        # the context engine (a ContextStore behind a gate): every model call goes through it
        self._context = context
        self._profile = profile or ModelProfile()
        self._wake: Wake | None = None
        self._fence: Fence | None = None
        self._store_closed = False
        #: when unsent announcements another sender may still be sending are looked at
        #: again (None: no such check is pending)
        self._resend_at: float | None = None
        self._own_notices: set[str] = set()  # appended by this Agent, not sent yet

    @property
    def _ledger(self) -> WakeLedger:
        """The wake's bookkeeping, folded with the view."""
        return self._folder.ledger

    # -- lifecycle ---------------------------------------------------------------------------

    def started(self) -> None:
        # one snapshot holds the view, the ledger, the stored messages and the open calls:
        # a start folds only what came after it
        self._folder = AGENT_VIEW.folder(load_state(self._store, self._stream, AGENT_VIEW))
        if self._folder.version == 0:
            created = SessionCreated(agent=self._agent_name, channel=self._channel_name)
            with contextlib.suppress(ConcurrencyError):  # a first message created it
                new = NewEvent(event=created, ts=self._clock.now())
                self._store.append(self._stream, [new], expected_version=NO_STREAM)
            self._refresh()
        running = self._folder.session().current_turn
        if running is not None and self._policy is None:  # durable: the next wake closes it
            log.warning("agent.turn_interrupted", stream=self._stream, turn_id=running)
            closed = TurnCompleted(turn_id=running, outcome="interrupted", reason="restart")
            self._append([closed, self._notice(ABANDONED_TEXT)])  # nothing will retry it
        self._speak_up()

    def on_stop(self) -> None:
        if self._turn is not None:
            self._turn.stop()  # the turn stays running in the log: a restart closes it
        if self._resend_at is not None:
            self._scheduler.cancel(("agent:resend", self.actor_urn))

    def on_failure(self, *exc_info: object) -> None:
        self.on_stop()
        crashed(self._on_crash, exc_info)

    # -- messages ----------------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        try:
            return self._receive(message)
        except FencedError as exc:
            log.warning("agent.fenced", stream=self._stream, held=exc.held, current=exc.current)
            self._drop_wake(notify=True)
            return self._report() if isinstance(message, UserMessage | AgentStatus) else None

    def _receive(self, message: Any) -> Any:
        match message:
            case UserMessage() if not message.text.strip():
                # nothing to answer (a provider refuses such a turn): told, not asked, so
                # no one to raise to; the host's paths refuse it before it is told
                log.warning("agent.empty_message_dropped", stream=self._stream)
            case UserMessage() if self._policy is not None:
                self._record_message(message)
            case UserMessage():
                self._queue.append(message)  # taken at once when no turn runs
            case Wake():
                self._on_wake(message)
            case Abandoned():
                self._speak_up()
            case ResendDue():
                self._resend_at = None
                self._refresh()  # what the other sender recorded meanwhile
                if self._turn is not None or self._wake is not None:  # said after it
                    self._resend_later(self._clock.now() + RESEND_GRACE_S)
                else:
                    self._speak_up()
            case LeaseLost():
                if self._wake is not None and self._lease_lost(message.epoch):
                    # an interrupt (no epoch) is news to the worker: it still counts the
                    # wake as running, and would hold the session's next message back
                    # until its renewal is fenced; a takeover it noticed itself
                    self._drop_wake(notify=message.epoch is None)
            case ModelDone():
                self._on_model_done(message)
            case ToolsDone():
                self._on_tools_done(message)
            case SendDone():
                self._on_sent(message)
            case Deadline():
                self._on_deadline(message)
            case AgentStatus():  # what others appended (a message, a wake) counts too
                try:
                    if not self._store_closed:
                        self._refresh()
                except StoreClosedError:  # the runtime is closing: the last fold answers
                    self._store_closed = True  # (a closed handle never opens again)
                except StoreError as exc:  # the last fold, then
                    log.warning("agent.status_stale", stream=self._stream, error=type(exc).__name__)
            case SendsPending():
                return len(self._unsent)
            case IsIdle():
                busy = self._wake or self._turn or self._queue or self._unsent
                return not busy and self._resend_at is None
            case _:
                raise TypeError(f"AgentActor does not understand {message!r}")
        while self._turn is None and self._queue:  # FIFO; a loop, so no recursion
            self._start_turn(self._queue.popleft())
        if isinstance(message, UserMessage | AgentStatus):
            return self._report()
        return None

    def _lease_lost(self, epoch: int | None) -> bool:
        """Whether the running wake's lease is the one a :class:`LeaseLost` names: the
        lease of ``epoch``, or (None: an interrupt's notice, sent once the interrupt is
        in the log) one the log's epoch has moved past. An interrupt's notice that comes
        after the next wake was leased (a message sent as the session was interrupted)
        is not that wake's: dropping it would leave its lease to expire, a failure."""
        wake = self._wake
        assert wake is not None
        if epoch is not None:
            return epoch == wake.epoch
        try:
            self._refresh()
        except StoreError:  # the log cannot say: the wake cannot append either
            return True
        return self._ledger.activations.epoch > wake.epoch

    def _report(self) -> AgentReport:
        turn = self._turn
        return AgentReport(
            session=self._folder.session(),
            queued=len(self._queue) + self._ledger.activations.backlog,
            step=turn.step if turn is not None else 0,
            waiting_for=turn.waiting_for() if turn is not None else None,
        )

    def _on_model_done(self, message: ModelDone) -> None:
        turn = self._current(message.turn_id, message.step, "model")
        if turn is None or self._overdue(turn):
            return
        turn.future = None
        if message.error == "context_overflow":
            self._finish(turn, "failed", "context_overflow", OVERFLOW_TEXT, "failure_notice")
            return
        if message.error == "context_refused":  # fail-closed: never merged, never retried
            self._finish(turn, "failed", "context_refused", ABANDONED_TEXT, "failure_notice")
            return
        if message.error is not None or message.response is None:
            # only a chain that failed is the model's doing; the rest broke on our side
            reason = message.error or "internal"
            text = FAILED_TEXT if reason == "all_models_failed" else ABANDONED_TEXT
            self._finish(turn, "failed", reason, text, "failure_notice")
            return
        response = message.response
        calls = self._ledger.distinct_ids(response.tool_calls)
        assistant = MessageAppended(
            message_id=new_id(),
            role="assistant",
            content=response.text,
            tool_calls=calls,
            turn_id=turn.turn_id,
        )
        if not calls:
            # blank lines are no answer: a user would see an empty message (or none)
            text = response.text if response.text.strip() else EMPTY_ANSWER_TEXT
            self._finish(turn, "answered", None, text, "completion", before=[assistant])
            return
        self._start_tools(turn, calls, before=[assistant])

    def _on_tools_done(self, message: ToolsDone) -> None:
        turn = self._current(message.turn_id, message.step, "tools")
        if turn is None:
            return
        ran = len(turn.calls) - len(turn.blocked)
        whole = message.error is None and len(message.outcomes) == ran
        if self._overdue(turn, message.outcomes if whole else None):
            return
        turn.future = None
        if not whole:
            self._finish(turn, "failed", "tools_broke", ABANDONED_TEXT, "failure_notice")
            return
        self._append(self._results(turn, message.outcomes))
        if turn.step >= self._settings.max_steps:
            self._finish(turn, "failed", "max_steps", MAX_STEPS_TEXT, "failure_notice")
            return
        self._call_model(turn)

    def _results(self, turn: LiveTurn, outcomes: Sequence[ToolOutcome] | None) -> list[Event]:
        """The step's results, in the calls' order, which close it: each run call's
        outcome event (``outcomes``, in order; None when the turn ends while they run:
        each is :func:`cut_short`), each settled call's (a denial, a host's output ...)
        and every call's ``message:appended`` (a blocked call's decision is in the log
        already). One append: a call's outcome is recorded once, with its result."""
        ran = iter(outcomes) if outcomes is not None else None
        events: list[Event] = []
        for index, call in enumerate(turn.calls):
            outcome = turn.blocked.get(index)
            if outcome is None:
                outcome = next(ran) if ran is not None else cut_short(call)
                events.append(outcome_event(outcome))
            elif outcome.status != "blocked":  # settled when the step began: not run
                events.append(outcome_event(outcome))
            events.append(
                MessageAppended(
                    message_id=new_id(),
                    role="tool",
                    content=outcome.text,
                    tool_call_id=call.id,
                    name=call.name,
                    turn_id=turn.turn_id,
                )
            )
        turn.calls, turn.blocked = (), {}
        return events

    def _on_sent(self, message: SendDone) -> None:
        event: Event
        error_class = message.error_class or "unknown"
        if message.ok:
            delivered = message.announcement_id
            event = AnnouncementDelivered(announcement_id=delivered, path=message.path)
        else:
            log.warning("agent.send_failed", stream=self._stream, error_class=error_class)
            event = AnnouncementSendFailed(
                announcement_id=message.announcement_id,
                error_class=error_class,
                retry_after_ms=message.retry_after_ms,
            )
        unsent = self._unsent.pop(message.announcement_id, None)
        if not message.ok and unsent is not None:  # the queue's entry first, then the failure
            enqueue = Enqueue(
                announcement_id=message.announcement_id,
                channel=self._channel_name,
                conversation=self._conversation,
                text=unsent[0],
                reason=error_class,
                thread=self._thread,
                kind=unsent[1],
                retry_after_ms=message.retry_after_ms,  # its first retry waits for it
            )
            dead_letter(self._dead_letters, enqueue)
        # the send's outcome is the announcement's, whichever wake runs now (and whoever
        # holds the lease): never fenced out, so a failed answer always reaches the queue
        self._append([event], fenced=False)

    def _on_deadline(self, message: Deadline) -> None:
        turn = self._turn
        if turn is None or turn.turn_id != message.turn_id:
            return  # the turn ended before its timer's message came
        if not self._overdue(turn):  # cannot happen with one clock; never abort early
            log.warning("agent.deadline_early", stream=self._stream, at=message.at)
            self._arm(turn)

    # -- the loop: append first, then act ----------------------------------------------------

    def _start_turn(self, message: UserMessage) -> None:
        turn_id = new_id()
        user = MessageAppended(
            message_id=message.message_id or new_id(),
            role="user",
            content=message.text,
            turn_id=turn_id,
        )
        recorded = self._append([TurnStarted(turn_id=turn_id), user])
        turn = LiveTurn(turn_id, recorded[0].ts)
        self._turn = turn
        self._arm(turn)
        self._call_model(turn)

    def _arm(self, turn: LiveTurn) -> None:
        deadline = execution_deadline(turn.started_at, self._settings.execution_timeout_ms)
        fire = partial(self._fire, turn.turn_id)
        turn.timer = self._scheduler.schedule(deadline, fire, key=("agent:execution", turn.turn_id))

    def _call_model(self, turn: LiveTurn) -> None:
        provider = self._caller.agent.provider
        is_degraded = self._is_degraded
        if is_degraded is not None and all(map(is_degraded, self._caller.providers())):
            # no model of the chain is on a healthy provider: no call, a static reply
            log.warning("agent.provider_degraded", stream=self._stream, provider=provider)
            self._finish(turn, "deferred", "provider_degraded", DEGRADED_TEXT, "static_reply")
            return
        turn.step += 1
        system = self._settings.system_prompt
        drafts = self._ledger.drafts.open() if self._wake is not None else []
        note = drafts_note(drafts, limit=DRAFTS_NOTED)
        if note is not None:  # an interrupted wake's drafts: continue them, not start over
            system = f"{system}\n\n{note}" if system else note
        tools, max_tokens = self._tools.specs(), self._caller.agent.max_tokens
        future: Future[ProviderResponse]
        limit = self._settings.execution_timeout_ms
        seal = turn.seal = CallSeal(not_after=execution_deadline(turn.started_at, limit))
        if self._context is not None:
            base = ProviderRequest(messages=(), tools=tools, max_tokens=max_tokens)
            window = self._settings.context_window
            assemble = Assemble(
                session_id=self._stream.removeprefix("session:"),
                messages=tuple(self._folder.context.messages),
                budget=context_budget(window, base, system, self._profile),
                tenant=self._folder.session().tenant,
                profile=self._profile,
                epoch=None if self._fence is None else self._fence.epoch,
            )
            future = self._portal.submit(
                call_through_context,
                self._caller,
                self._stream,
                base,
                self._context,
                assemble,
                system,
                seal,
            )
        else:
            request = ProviderRequest(
                messages=request_messages(self._folder.messages, system),
                tools=tools,
                max_tokens=max_tokens,
            )
            call = partial(self._caller.call, seal=seal)
            future = self._portal.submit(call, self._stream, request)
        turn.future = future
        turn_id, step = turn.turn_id, turn.step
        future.add_done_callback(lambda done: self._tell(model_done(turn_id, step, done)))

    def _start_tools(
        self, turn: LiveTurn, calls: tuple[ToolCall, ...], *, before: Sequence[Event] = ()
    ) -> None:
        """Run a step's calls; in a wake, first stop the session for the first call that
        would run (not settled, not blocked by the retry breaker, arguments its tool can
        take: a human is never asked about a call that then does not run) and needs a
        human (approval, or a custom tool's output) with no answer yet."""
        breaker = self._folder.tools
        if self._wake is not None:
            for call in calls:
                if self._settled_outcome(call) is not None or decide_tool_call(
                    breaker, call.name, call.arguments, call_id=call.id
                ):
                    continue
                request = pause_for(self._tools.get(call.name), call, self._ledger, turn.turn_id)
                if request is not None:
                    self._pause(turn, request, before)
                    return
        events: list[Event] = list(before)
        blocked: dict[int, ToolOutcome] = {}
        to_run: list[ToolCall] = []
        reconcile: set[str] = set()
        ledger = self._ledger
        for index, call in enumerate(calls):
            if (
                ledger.cut_short(call)
                and call.id not in ledger.interrupted
                and self._can_reconcile(call)
            ):
                reconcile.add(call.id)  # its tool checks whether the effect happened
                to_run.append(call)
                continue
            settled = self._settled_outcome(call)
            if settled is not None:
                # recorded with the step's results, not now: a crash before them would
                # have the next wake record it a second time
                blocked[index] = settled
                continue
            decision = decide_tool_call(breaker, call.name, call.arguments, call_id=call.id)
            if decision is not None:
                events.append(decision)
                blocked[index] = blocked_outcome(call, decision)
            else:
                key = self._idempotency_key(call)
                events.append(started_event(call, turn_id=turn.turn_id, idempotency_key=key))
                to_run.append(call)
        self._append(events)
        turn.calls, turn.blocked = calls, blocked
        if not to_run:
            self._on_tools_done(ToolsDone(turn_id=turn.turn_id, step=turn.step))
            return
        limit = self._settings.tool_limit
        keys = {call.id: self._idempotency_key(call) for call in to_run}
        timer = partial(clock_timer, self._portal, self._scheduler, self._clock)
        future = self._portal.submit(
            run_calls,
            self._tools,
            tuple(to_run),
            limit,
            keys,
            frozenset(reconcile),
            self._clock,
            timer,
        )
        turn.future = future
        turn_id, step = turn.turn_id, turn.step
        future.add_done_callback(lambda done: self._tell(tools_done(turn_id, step, done)))

    def _overdue(self, turn: LiveTurn, outcomes: Sequence[ToolOutcome] | None = None) -> bool:
        """Abort the turn if the execution timeout says so (the pure decision, at now).

        A step whose calls run as it ends is closed with it: with the ``outcomes`` when
        they came, else each call cut short (it may still be running on its thread, so a
        later wake neither asks its tool's check nor runs it again)."""
        now = self._clock.now()
        limit = self._settings.execution_timeout_ms
        aborted = decide_execution_timeout(turn.turn_id, turn.started_at, now, limit)
        if aborted is None:
            return False
        log.warning("agent.execution_timeout", stream=self._stream, elapsed_ms=aborted.elapsed_ms)
        turn.seal_call()
        self._refresh()  # what the call recorded before it was sealed
        closed = self._results(turn, outcomes) if turn.calls else []
        self._finish(
            turn,
            "aborted",
            "pipeline_timeout",
            TIMEOUT_TEXT,
            "failure_notice",
            before=[*self._passed_prompt_limits(now), aborted, *closed],
            now=now,
        )
        return True

    def _passed_prompt_limits(self, now: float) -> list[PromptTimeout]:
        """The running turn's open model calls whose own limit has passed by ``now``
        (the pure decision): when the Clock passed it together with the turn's (one jump
        of a FakeClock, a process frozen past both), the call's cut was on its way to the
        loop as the turn ended; it is recorded here, before the turn's end."""
        passed = (decide_prompt_timeout(w, now) for w in self._folder.calls.state().open.values())
        return [timeout for timeout in passed if timeout is not None]

    def _idempotency_key(self, call: ToolCall) -> str:
        """Stable across crashes and retries of the call: the session and the call id."""
        return f"{self._stream}/{call.id}"

    def _can_reconcile(self, call: ToolCall) -> bool:
        tool = self._tools.get(call.name)
        return tool is not None and tool.reconcile is not None

    def _settled_outcome(self, call: ToolCall) -> ToolOutcome | None:
        """A call that must not run: refused by the user, answered by the host (a custom
        tool), cut short by a crash (never run blindly twice), closed by an interrupt, or
        one that needs a human where none can be asked (no wake: a sub-agent run); its
        outcome (recorded by :func:`outcome_event`)."""
        resolution = self._ledger.resolutions.get(call.id)
        if resolution is not None and resolution.kind == "output":
            # the host's answer is bounded as a tool's own result is (its record keeps it)
            tool = self._tools.get(call.name)
            limit = tool.max_result_bytes if tool is not None else DEFAULT_MAX_RESULT_BYTES
            output = bounded_text(resolution.output, limit)
            return ToolOutcome(call_id=call.id, tool=call.name, status="ok", text=output)
        if resolution is not None and resolution.kind == "deny":
            error, text = "denied", DENIED_TEXT
        elif self._ledger.cut_short(call):
            error, text = "unreconciled", UNRECONCILED_TEXT
        elif call.id in self._ledger.interrupted:
            error, text = "interrupted", INTERRUPTED_TEXT
        elif self._wake is None and needs_human(self._tools.get(call.name)):
            error, text = "needs_human", NO_HUMAN_TEXT
        else:
            return None
        return ToolOutcome(
            call_id=call.id, tool=call.name, status="error", text=text, error_class=error
        )

    def _finish(
        self,
        turn: LiveTurn,
        outcome: Outcome,
        reason: str | None,
        text: str,
        kind: Kind,
        *,
        before: Sequence[Event] = (),
        now: float | None = None,
    ) -> None:
        """End the turn: append its end and the announcement, stop what is in flight,
        and send the one user-facing message (``on_receive`` then takes the next one).

        In a wake, the settlement goes in the same append: a failure a retry may fix
        requeues the wake with no message to the user; the rest ack (or abandon) it."""
        turn.seal_call()  # nothing of a call in flight lands after the turn's end
        now = self._clock.now() if now is None else now  # the decisions' time and the ts
        completed = TurnCompleted(
            turn_id=turn.turn_id, outcome=outcome, reason=reason, steps=turn.step
        )
        settlement = self._settlement(outcome, reason, now)
        if isinstance(settlement, ActivationRequeued):
            self._append([*before, completed, settlement], now=now)
            turn.stop()
            self._turn = None
            self._end_wake()
            return
        announcement_id = new_id()
        queued = AnnouncementQueued(
            announcement_id=announcement_id, channel=self._channel_name, kind=kind, text=text
        )
        self._append([*before, completed, queued, *([settlement] if settlement else [])], now=now)
        turn.stop()
        self._turn = None
        self._end_wake()
        self._send(turn.turn_id, announcement_id, text, kind)

    def _settlement(self, outcome: str, reason: str | None, now: float) -> Event | None:
        wake, policy = self._wake, self._policy
        if wake is None or policy is None:
            return None
        jitter = self._jitter_ms() if self._jitter_ms is not None else 0
        return decide_settlement(
            self._ledger.activations,
            wake.activation_id,
            wake.epoch,
            wake_result(outcome, reason),
            now,
            policy,
            jitter_ms=jitter,
        )

    # -- wakes -----------------------------------------------------------------------------------

    def _record_message(self, message: UserMessage) -> None:
        """Durable mode: a user message becomes an ``activation:ready`` for the worker
        (one whose id the session was already given is not run again)."""
        message_id = message.message_id or new_id()
        for attempt in range(1, RACE_TRIES + 1):
            self._refresh()
            ready = decide_message(self._ledger.recent, new_id(), message_id, message.text)
            if isinstance(ready, str):
                return
            news = [NewEvent(event=ready, ts=self._clock.now())]
            # on the version folded, so a redelivery recorded meanwhile is seen; when the
            # stream keeps moving, the last try records it all the same (a lost message
            # is worse than a twice-recorded one)
            expected = self._folder.version if attempt < RACE_TRIES else None
            try:
                self._store.append(self._stream, news, expected_version=expected)
            except ConcurrencyError:
                continue
            self._refresh()
            if self._worker is not None:  # work was appended: the worker leases it now
                self._worker(None)
            return

    def _on_wake(self, wake: Wake) -> None:
        """Run one bounded wake: close a turn a dead holder left running, add the wake's
        user messages that are not in the conversation yet, then resume the step a pause
        or a crash left unanswered, or call the model."""
        if self._turn is not None:
            held = self._wake
            if held is None or wake.epoch <= held.epoch:  # one lease at a time
                log.error("agent.wake_while_running", stream=self._stream)
                return
            # a takeover (the worker that leased the running turn died, its lease ran
            # out, and a new worker leased the session): the old turn's appends are
            # fenced out now, so it stops, and the new wake runs
            log.warning("agent.wake_took_over", stream=self._stream, old=held.epoch, new=wake.epoch)
            self._drop_wake(notify=False)
        self._refresh()
        self._wake = wake
        self._set_fence(Fence(wake.epoch))
        events: list[Event] = []
        running = self._folder.session().current_turn
        if running is not None:
            events.append(TurnCompleted(turn_id=running, outcome="interrupted", reason="restart"))
        if all(self._repeated(activation) for activation in wake.activations):
            self._settle_repeated(wake, events)
            return
        turn_id = new_id()
        events.append(TurnStarted(turn_id=turn_id, trigger=wake.kind))
        for activation in wake.activations:
            if self._repeated(activation):
                continue  # the session has it: the wake answers what is new
            if activation.kind == "message" and activation.message_id:
                message_id, content = activation.message_id, activation.text
            elif activation.kind == "wake":
                message_id, content = activation.activation_id, WAKE_PREFIX + activation.text
            else:
                continue
            if message_id not in self._ledger.message_ids:
                events.append(
                    MessageAppended(
                        message_id=message_id, role="user", content=content, turn_id=turn_id
                    )
                )
        recorded = self._append(events)
        started = next(r for r in recorded if isinstance(r.event, TurnStarted))
        turn = LiveTurn(turn_id, started.ts)
        self._turn = turn
        self._arm(turn)
        unanswered = self._ledger.unanswered()
        if unanswered:
            self._start_tools(turn, unanswered)
        else:
            self._call_model(turn)

    def _repeated(self, activation: Activation) -> bool:
        """Whether ``activation`` carries a user message the session was given before
        (a redelivery): it is not recorded again, and it asks for no turn of its own."""
        return activation.kind == "message" and self._ledger.repeated(activation.activation_id)

    def _settle_repeated(self, wake: Wake, before: Sequence[Event]) -> None:
        """A wake whose every message was given to the session before: no turn, no
        reply; the wake is acked ``already_answered`` (with the close of a turn a dead
        holder left running, when there is one), so it is not run again."""
        now = self._clock.now()
        settlement = self._settlement(REPEATED_OUTCOME, None, now)
        log.info("agent.wake_repeated", stream=self._stream, activation_id=wake.activation_id)
        self._append([*before, *([settlement] if settlement else [])], now=now)
        self._end_wake()

    def _pause(
        self, turn: LiveTurn, request: SessionRequiresAction, before: Sequence[Event]
    ) -> None:
        """Stop the session for a human: the request (with the call's input, verbatim),
        the turn paused, the wake blocked on it, all in one append."""
        wake, policy = self._wake, self._policy
        assert wake is not None
        assert policy is not None
        completed = TurnCompleted(turn_id=turn.turn_id, outcome="paused", steps=turn.step)
        blocked = decide_settlement(
            self._ledger.activations,
            wake.activation_id,
            wake.epoch,
            WakeResult(status="blocked", request_id=request.request_id),
            self._clock.now(),
            policy,
        )
        notice: list[Event] = []
        announcement_id = new_id()
        if request.kind == "approval":  # the user hears why nothing happens; a host tool does not
            notice.append(
                AnnouncementQueued(
                    announcement_id=announcement_id,
                    channel=self._channel_name,
                    kind="static_reply",
                    text=APPROVAL_TEXT,
                )
            )
        self._append([*before, request, completed, blocked, *notice])
        log.info("agent.requires_action", stream=self._stream, kind=request.kind)
        turn.stop()
        self._turn = None
        self._end_wake()
        if notice:
            self._send(turn.turn_id, announcement_id, APPROVAL_TEXT, "static_reply")

    def _set_fence(self, fence: Fence | None) -> None:
        """Fence this Agent's appends, and the model caller's to the same stream."""
        self._fence = fence
        if self._hold is not None:
            self._hold(self._stream, fence)

    def _end_wake(self) -> None:
        wake = self._wake
        if wake is None:
            return
        self._wake = None
        self._set_fence(None)
        if self._worker is not None:
            self._worker(WakeEnded(wake.stream, wake.epoch))

    def _drop_wake(self, *, notify: bool) -> None:
        """The lease is gone: stop the turn, append nothing more under it."""
        turn = self._turn
        if turn is not None:
            turn.stop()
            self._turn = None
        wake = self._wake
        self._wake = None
        self._set_fence(None)
        self._refresh()
        if notify and wake is not None and self._worker is not None:
            self._worker(WakeEnded(wake.stream, wake.epoch))

    def _notice(self, text: str) -> AnnouncementQueued:
        """A failure notice to append; :meth:`_speak_up` sends it (it is this Agent's own,
        so no other sender can have it in flight)."""
        notice = AnnouncementQueued(
            announcement_id=new_id(), channel=self._channel_name, kind="failure_notice", text=text
        )
        self._own_notices.add(notice.announcement_id)
        return notice

    def _forget_notices(self, events: Sequence[Event]) -> None:
        """The notices among ``events``, whose append failed, are not this Agent's to send."""
        for event in events:
            if isinstance(event, AnnouncementQueued):
                self._own_notices.discard(event.announcement_id)

    def _speak_up(self) -> None:
        """Say what a crash or a given-up wake left unsaid: that a turn broke off, when the
        worker gave up on a wake with nothing announced since its lease (once, closing
        the turn it left running), and every announcement whose send never ended (the
        Agent died meanwhile). Only what happened within :data:`RESEND_WITHIN_S` is
        said: older news is stale (the turn is still closed)."""
        if self._turn is not None or self._wake is not None:
            return  # the running turn ends in its own message
        ledger = self._ledger
        now = self._clock.now()
        abandoned = ledger.abandoned
        if abandoned is not None and ledger.activations.lease is None:
            running = self._folder.session().current_turn
            events: list[Event] = []
            if running is not None:
                events.append(TurnCompleted(turn_id=running, outcome="failed", reason="abandoned"))
            if now - abandoned <= RESEND_WITHIN_S:  # news older than that is stale
                events.append(self._notice(ABANDONED_TEXT))
            if events:
                log.warning("agent.wake_abandoned", stream=self._stream, turn_id=running)
                news = [NewEvent(event=e, ts=now) for e in events]
                # on the version folded: a wake that started meanwhile speaks for itself
                try:
                    self._store.append(self._stream, news, expected_version=self._folder.version)
                except ConcurrencyError:  # something else was appended: look again soon
                    self._forget_notices(events)  # not in the log: never to be sent
                    self._resend_later(now + RESEND_GRACE_S)
                self._refresh()
        self._send_again(now)

    def _send_again(self, now: float) -> None:
        """Send again every announcement within :data:`RESEND_WITHIN_S` with no outcome
        whose latest send is older than a send can take (its timeout plus
        :data:`RESEND_GRACE_S`): until then it may be under way from another runtime on
        this log, and it is looked at again when it is not. Each resend is recorded first
        (``announcement:resent``, expecting the folded version): of two runtimes deciding
        at once, one appends and sends; the other folds that and waits again."""
        in_flight_s = self._settings.send_timeout_ms / 1000 + RESEND_GRACE_S
        for _ in range(RACE_TRIES):
            later: float | None = None
            due: list[tuple[str, AnnouncementQueued]] = []
            for announcement_id, unsent in list(self._ledger.unsent.items()):
                if announcement_id in self._unsent or now - unsent.queued_at > RESEND_WITHIN_S:
                    continue
                if not yours_to_say(unsent.queued, self._channel_name, self._channel.name):
                    continue  # another run's private answer: never to this channel
                if announcement_id in self._own_notices:  # just queued here: send it now
                    self._own_notices.discard(announcement_id)
                    self._send("", announcement_id, unsent.queued.text, unsent.queued.kind)
                    continue
                free_at = unsent.sent_at + in_flight_s
                if now < free_at:
                    later = free_at if later is None else min(later, free_at)
                    continue
                due.append((announcement_id, unsent.queued))
            if later is not None:
                self._resend_later(later)
            if not due:
                return
            resent = [
                NewEvent(event=AnnouncementResent(announcement_id=announcement_id), ts=now)
                for announcement_id, _ in due
            ]
            try:
                self._store.append(self._stream, resent, expected_version=self._folder.version)
            except ConcurrencyError:  # another sender (or anyone) appended: look again
                self._refresh()
                continue
            self._refresh()
            for announcement_id, queued in due:
                log.info("agent.send_again", stream=self._stream, announcement_id=announcement_id)
                self._send("", announcement_id, queued.text, queued.kind)
            return
        self._resend_later(now + RESEND_GRACE_S)  # the stream kept moving: later, then

    def _resend_later(self, at: float) -> None:
        """Look at the unsent announcements again at ``at`` (the Agent stays up until)."""
        if self._resend_at is None or at < self._resend_at:
            self._resend_at = at
            self._scheduler.schedule(
                at, lambda _: self._tell(ResendDue()), key=("agent:resend", self.actor_urn)
            )

    def _send(self, turn_id: str, announcement_id: str, text: str, kind: Kind) -> None:
        message = OutboundMessage(
            conversation=self._conversation,
            text=text,
            thread=self._thread,
            idempotency_key=announcement_id,
            kind=_MESSAGE_KIND[kind],
        )
        # the answer goes the announce path; a static text is a direct send (seed 000)
        path: Literal["announce", "direct"] = "announce" if kind == "completion" else "direct"
        timeout_s = self._settings.send_timeout_ms / 1000
        self._unsent[announcement_id] = (text, message.kind)
        noted = noting(self._channel)  # the receiver's Retry-After goes with a failure
        # bounded on the Clock, which the resend wait of another runtime is counted on too
        future = send_by_clock(
            self._portal, self._scheduler, self._clock, noted, message, timeout_s
        )
        future.add_done_callback(
            lambda done: self._tell(sent(turn_id, announcement_id, path, noted, done))
        )

    # -- the log and the mailbox -------------------------------------------------------------

    def _append(
        self, events: Sequence[Event], *, now: float | None = None, fenced: bool = True
    ) -> list[RecordedEvent]:
        """Append at now (fenced by the wake's lease, unless ``fenced`` is False: a fact
        that is not the wake's), then fold the stream up to its head (the model caller
        appends prompt events to it too, so what was recorded meanwhile is folded in
        order). FencedError when the lease was taken over."""
        if not events:
            return []
        now = self._clock.now() if now is None else now
        news = [NewEvent(event=e, ts=now) for e in events]
        fence = self._fence if fenced else None
        recorded = self._store.append(self._stream, news, fence=fence)
        self._refresh()
        return recorded

    def _refresh(self) -> None:
        for record in self._store.read_stream(self._stream, self._folder.version + 1):
            self._folder.add(record)

    def _current(self, turn_id: str, step: int, what: str) -> LiveTurn | None:
        turn = self._turn
        if turn is None or turn.turn_id != turn_id or turn.step != step:
            log.info("agent.late_result", stream=self._stream, turn_id=turn_id, what=what)
            return None
        return turn

    def _fire(self, turn_id: str, at: float) -> None:
        """Scheduler callback (its thread, or inside ``FakeClock.advance``)."""
        self._tell(Deadline(turn_id, at))

    def _tell(self, message: object | None) -> None:
        """Future callback (the portal's thread, or the one that cancelled): tell, no more."""
        if message is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.actor_ref.tell(message)
