"""The built-in verifiers and deadlines: which fold each decision reads, at which time,
with which knobs; what the deciding actor does, re-run from the log.

===========================  ================  ==========================================
decision                     fold (stream)     decide (knobs)
===========================  ================  ==========================================
subagent:watchdog_timeout    RUN (session:)    decide_watchdog (subagents.per_step_timeout_ms)
subagent:ghost_swept         RUN (session:)    decide_ghost (subagents.ghost_grace_ms)
subagent:suspicious          RUN (session:)    decide_suspicious (per_step, expected_fraction,
                                               heartbeat_interval_ms)
subagent:recovery_decided    RUN (session:)    decide_recovery (recovery_max_attempts)
execution:prompt_timeout     CALLS (session:)  decide_prompt_timeout (the window's own limits)
prompt:retry_scheduled       CALLS (session:)  retry_delay (agents.<agent>.max_retries,
                                               retry_base_ms, retry_cap_ms, rate_limit_same_
                                               model_max_retry_after_ms; the recorded status,
                                               Retry-After and jitter draw)
execution:aborted            CALLS (session:)  decide_execution_timeout
                                               (supervision.execution_timeout_ms)
provider:degraded/recovered  HEALTH (provider:) decide_health (health.*)
breaker:*                    BREAKER (provider:) decide_breaker (providers.<name>.breaker_*)
announcement:dead_letter_    DEADLETTER        decide_expiry (dead_letters.max_age_ms,
expired                      (deadletter)      max_retries)
supervisor:restarted/        RESTARTS          decide_restart (supervision.*)
gave_up                      (runtime)
announcement:resent          GIVE_UP_NOTICES   decide_notice_resends (dead_letters.
(runtime)                    (runtime)         announce_timeout_ms)
===========================  ================  ==========================================

A session's calls and turn (CALLS) end with a sub-agent run's end in its stream: the
run's actor stops, and its timers with it.

The activations' verifiers are in :mod:`._verify_activations`; the model chain's, a
failure notice's fallback and a session's pauses in :mod:`._verify_decisions`.

Every decision's ``now`` is its record's ``ts``: the actors append a decision at the
``now`` they decided at. Two tolerances, both stated where they apply: the Agent reads
its clock again to append ``execution:aborted``, so its ``elapsed_ms`` may be a little
lower than re-derived at its ``ts`` (never below the limit); a ``split`` recovery's
splitter is the host's, so whether a run had one is read from the decision itself
(``split``, or ``escalate`` with a ``splitter_*`` reason) and its subtasks are taken as
recorded.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.backoff import backoff_ceiling_ms, retry_delay
from stalwart.errors import ConfigError
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementResent,
    AnnouncementSendFailed,
    Event,
    ExecutionAborted,
    PromptActivity,
    PromptCompleted,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    PromptTimeout,
    RecordedEvent,
    RuntimeStarted,
    SubagentArtifact,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentGivenUp,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentSuspicious,
    SubagentWatchdogTimeout,
    SupervisorGaveUp,
    SupervisorRestarted,
    TurnCompleted,
    TurnStarted,
    UserInterrupt,
)

from ._aggregate import FolderAggregate
from ._breaker import BREAKER, BreakerState, decide_breaker
from ._deadletter import (
    DEADLETTER,
    DeadLetterState,
    decide_drain,
    decide_expiry,
    decide_retries,
    expiry_at,
    held_ahead,
    hold_ms,
    retry_at,
)
from ._execution import decide_execution_timeout, execution_deadline
from ._health import DEFAULT_HORIZON_MS, HealthAggregate, HealthState, decide_health
from ._prompt import decide_prompt_timeout, next_deadline
from ._resend import (
    GIVE_UP_NOTICES,
    RESEND_WITHIN_S,
    GiveUpNotices,
    GiveUpNoticesFolder,
    decide_notice_resends,
    notice_resend_due,
    notice_resend_wait_s,
)
from ._subagent import (
    RUN,
    RunState,
    decide_ghost,
    decide_recovery,
    decide_suspicious,
    decide_watchdog,
    ghost_deadline,
    watchdog_deadline,
    watchdog_limit,
)
from ._supervision import decide_restart
from ._verify_activations import ACTIVATION_RULES
from ._verify_context import CONTEXT_RULES
from ._verify_decisions import DECISION_RULES
from ._verify_folds import (
    CALLS,
    RESTARTS,
    CallsFolder,
    CallsState,
    RestartsState,
    restarts_key,
)
from ._verify_registry import Deadline, Knobs, Registry, Selective, Verifier, moment

#: Every decision tag of DESIGN's catalogue: one with no verifier is counted as unchecked.
DECISIONS = frozenset(
    {
        *("supervisor:restarted", "supervisor:gave_up", "session:requires_action"),
        *("tool:blocked", "execution:prompt_timeout", "prompt:retry_scheduled"),
        *("model:fallback_attempt", "model:fallback_exhausted", "execution:aborted"),
        *("subagent:watchdog_timeout", "subagent:ghost_swept", "subagent:suspicious"),
        *("subagent:recovery_decided", "provider:degraded", "provider:recovered"),
        *("breaker:opened", "breaker:half_opened", "breaker:closed"),
        *("announcement:fallback_direct", "announcement:dead_lettered"),
        *("announcement:dead_letter_delivered", "announcement:dead_letter_expired"),
        *("announcement:dead_letter_retried", "announcement:resent"),
        *("activation:leased", "activation:acked", "activation:requeued", "activation:blocked"),
        *("activation:abandoned", "activation:lease_lost", "lease:expired"),
        "activation:released",
        *("context:dag_degraded", "context:layer_disabled", "context:summarizer_reserved"),
        "context:summarizer_refused",
    }
)


def _ms(path: str) -> Any:
    return lambda knobs: knobs.get_int(path)


# -- sub-agent runs -----------------------------------------------------------------------


def _per_step(state: RunState, knobs: Knobs) -> int:
    """``per_step_timeout_ms`` for the run's watchdog: read only for a run spawned with a
    step budget (``max_steps``); any other is bound by its own limit alone, whatever the
    knob holds (0 stands for it, unread)."""
    if state.max_steps is None:
        return 0
    return knobs.get_int("subagents.per_step_timeout_ms")


def _watchdog(state: RunState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    per_step = _per_step(state, knobs)
    return decide_watchdog(state, record.ts, per_step_timeout_ms=per_step)


def _watchdog_why(state: RunState, record: RecordedEvent, knobs: Knobs) -> str:
    per_step = _per_step(state, knobs)
    deadline = watchdog_deadline(state, per_step_timeout_ms=per_step)
    if deadline is None:
        return f"the run is {state.status}, no watchdog is armed"
    limit_ms, knob = watchdog_limit(state, per_step_timeout_ms=per_step)
    early = round((deadline - record.ts) * 1000)
    when = f"{early} ms before it" if early > 0 else "at it"
    return f"the deadline is {moment(deadline)} (started + {limit_ms} ms, {knob}); it fired {when}"


def _ghost(state: RunState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    return decide_ghost(state, record.ts, ghost_grace_ms=knobs.get_int("subagents.ghost_grace_ms"))


def _ghost_why(state: RunState, record: RecordedEvent, knobs: Knobs) -> str:
    grace = knobs.get_int("subagents.ghost_grace_ms")
    deadline = ghost_deadline(state, ghost_grace_ms=grace)
    if deadline is None:
        return f"the run is {state.status}, not running"
    early = round((deadline - record.ts) * 1000)
    return f"a ghost from {moment(deadline)} (limit + ghost_grace_ms {grace}); {early} ms early"


def _suspicious(state: RunState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    return decide_suspicious(
        state,
        record.ts,
        per_step_timeout_ms=_per_step(state, knobs),
        expected_fraction=knobs.get_float("subagents.expected_fraction"),
        heartbeat_interval_ms=knobs.get_int("subagents.heartbeat_interval_ms"),
    )


def _recovery(state: RunState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, SubagentRecoveryDecided)
    split = found.action == "split" or found.reason.startswith("splitter_")
    # whether the process held the host's code is not in the log: read from the decision
    # (it counts only for a run the log says ran host code)
    held = found.reason != "work_unavailable"
    max_attempts = knobs.get_int("subagents.recovery_max_attempts")
    decided = decide_recovery(state, max_attempts=max_attempts, can_split=split, can_respawn=held)
    # the host's splitter: its subtasks, or its failure turning the split into escalate
    return [_as_split(event, found) for event in decided]


def _as_split(event: Event, found: SubagentRecoveryDecided) -> Event:
    if not isinstance(event, SubagentRecoveryDecided) or event.action != "split":
        return event
    if found.action == "escalate":
        return msgspec.structs.replace(event, action="escalate", reason=found.reason)
    return msgspec.structs.replace(event, subtasks=found.subtasks)


# A deadline's ``due`` reads its knobs only once something is pending: a knob recorded as
# no number then makes that deadline unwatched (said once), not every stream of its kind.


def _running(state: RunState) -> bool:
    return state.status == "running" and state.started_at is not None


def _watchdog_due(state: RunState, knobs: Knobs) -> float | None:
    if not _running(state):
        return None
    return watchdog_deadline(state, per_step_timeout_ms=_per_step(state, knobs))


def _ghost_due(state: RunState, knobs: Knobs) -> float | None:
    if not _running(state):
        return None
    return ghost_deadline(state, ghost_grace_ms=knobs.get_int("subagents.ghost_grace_ms"))


# The soonest each deadline can fall due whatever its settings (see ``Deadline.earliest``):
# a run's watchdog from its start (a step budget of any size), its ghost sweep once its own
# limit has passed (a grace of 0), a turn's timeout from its start, an entry's expiry from
# its queueing, a notice's resend from its latest send (or the process's start).


def _run_started(state: RunState) -> float | None:
    return state.started_at


def _ghost_earliest(state: RunState) -> float | None:
    if state.started_at is None:
        return None
    return state.started_at + state.timeout_ms / 1000


# -- a session's calls and turn -----------------------------------------------------------

#: what ends a sub-agent run: its actor stops, and the timers of its calls and turn with it
_RUN_ENDED: frozenset[type[Event]] = frozenset(
    {SubagentCompleted, SubagentWatchdogTimeout, SubagentGhostSwept, SubagentGivenUp}
)


class _RunCallsFolder:
    """The fold of :class:`CallsState`, in which the end of a sub-agent run (in its own
    stream) ends the calls and the turn still open: nothing owes their deadlines after it,
    as after a turn's end (no prompt event ends a call its actor's stop cancelled)."""

    __slots__ = ("_calls", "_ended")

    def __init__(self, state: CallsState) -> None:
        self._calls = CallsFolder(state)
        self._ended = False

    def add(self, record: RecordedEvent) -> None:
        if type(record.event) in _RUN_ENDED:
            self._ended = True
        elif not self._ended:
            self._calls.add(record)

    def state(self) -> CallsState:
        return _NO_CALLS if self._ended else self._calls.state()


_NO_CALLS = CallsState()
#: :class:`CallsState` over a session stream, a sub-agent run's ended with the run
_CALLS = FolderAggregate(
    "verify_run_calls", CallsState, _RunCallsFolder, moves=(CALLS.moves or frozenset()) | _RUN_ENDED
)


def _prompt_timeout(state: CallsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, PromptTimeout)
    window = state.open.get(found.call_id)
    if window is None:
        return []
    decided = decide_prompt_timeout(window, record.ts)
    return [] if decided is None else [decided]


def _prompt_why(state: CallsState, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, PromptTimeout)
    window = state.open.get(found.call_id)
    if window is None:
        return f"no call {found.call_id!r} is open"
    when, limit, limit_ms = next_deadline(window)
    early = round((when - record.ts) * 1000)
    return f"the {limit} limit ({limit_ms} ms) falls at {moment(when)}; {early} ms later"


def _prompt_due(state: CallsState, knobs: Knobs) -> float | None:
    return min((next_deadline(w)[0] for w in state.open.values()), default=None)


def _execution(state: CallsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, ExecutionAborted)
    if state.turn_id is None or state.turn_started_at is None:
        return []
    limit = knobs.get_int("supervision.execution_timeout_ms")
    decided = decide_execution_timeout(state.turn_id, state.turn_started_at, record.ts, limit)
    if decided is None:
        return []
    # the Agent decides at one clock read and appends at the next: its elapsed may be lower
    if decided.limit_ms <= found.elapsed_ms <= decided.elapsed_ms:
        decided = msgspec.structs.replace(decided, elapsed_ms=found.elapsed_ms)
    return [decided]


def _execution_why(state: CallsState, record: RecordedEvent, knobs: Knobs) -> str:
    if state.turn_started_at is None:
        return "no turn is running"
    limit = knobs.get_int("supervision.execution_timeout_ms")
    deadline = execution_deadline(state.turn_started_at, limit)
    early = round((deadline - record.ts) * 1000)
    return (
        f"turn {state.turn_id!r} reaches execution_timeout_ms ({limit}) at {moment(deadline)}; "
        + (f"{early} ms later" if early > 0 else "the turn id or numbers differ")
    )


def _execution_due(state: CallsState, knobs: Knobs) -> float | None:
    if state.turn_started_at is None:
        return None
    return execution_deadline(
        state.turn_started_at, knobs.get_int("supervision.execution_timeout_ms")
    )


def _turn_started(state: CallsState) -> float | None:
    return state.turn_started_at


def _failed_attempt(state: CallsState, event: PromptRetryScheduled) -> int:
    """The attempt that failed: that of the call the retry names (the caller retries the
    call it just saw fail); a retry naming no call of the turn is taken at its word."""
    return state.attempts.get(event.call_id, event.attempt - 1)


def _retry(state: CallsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, PromptRetryScheduled)
    failed = _failed_attempt(state, found)
    delay = _retry_delay(found, failed, knobs)
    if delay is None:
        return []
    return [msgspec.structs.replace(found, attempt=failed + 1, delay_ms=round(delay * 1000))]


def _retry_delay(event: PromptRetryScheduled, failed: int, knobs: Knobs) -> float | None:
    agent = ("agents", event.agent or "")
    return retry_delay(
        failed,
        event.status,
        event.retry_after_s,
        event.rate_limited_before,
        event.jitter or 0.0,
        max_retries=knobs.get_int((*agent, "max_retries")),
        retry_base_ms=knobs.get_int((*agent, "retry_base_ms")),
        retry_cap_ms=knobs.get_int((*agent, "retry_cap_ms")),
        max_retry_after_ms=knobs.get_int((*agent, "rate_limit_same_model_max_retry_after_ms")),
        rate_limited=event.reason == "rate_limited",
    )


def _retry_why(state: CallsState, record: RecordedEvent, knobs: Knobs) -> str:
    event = record.event
    assert isinstance(event, PromptRetryScheduled)
    agent = ("agents", event.agent or "")
    tried = _failed_attempt(state, event)
    if tried != event.attempt - 1:
        return f"it follows attempt {tried} of call {event.call_id!r}, not {event.attempt - 1}"
    if event.status == 429 or event.reason == "rate_limited":
        return (
            "a 429 is retried once per model, after its Retry-After "
            f"({event.retry_after_s} s; retried before: {event.rate_limited_before})"
        )
    if tried > knobs.get_int((*agent, "max_retries")):
        return f"attempt {tried} already used agents.{event.agent}.max_retries"
    base, cap = knobs.get_int((*agent, "retry_base_ms")), knobs.get_int((*agent, "retry_cap_ms"))
    ceiling = backoff_ceiling_ms(tried, base, cap)
    return (
        f"attempt {tried}: jitter {event.jitter} of min({cap}, {base} x 2^{tried - 1}) = "
        f"{ceiling} ms, not below Retry-After {event.retry_after_s} s; "
        f"it waited {event.delay_ms} ms"
    )


def _recorded_inputs(event: Event) -> bool:
    """A retry recorded with its decision's inputs (older records have none)."""
    return isinstance(event, PromptRetryScheduled) and event.agent is not None


# -- providers ----------------------------------------------------------------------------


def _health_fold(knobs: Knobs) -> HealthAggregate:
    """A fold as wide as any window the log's processes used (a later process may have
    widened it), so that each of their decisions can be re-derived."""
    widest = knobs.get_int("verify.health_horizon_ms") if knobs.has("verify") else 0
    try:
        window = knobs.get_int("health.window_ms")
    except ConfigError:
        window = 0  # recorded as no number: each decision that reads it says so
    return HealthAggregate(max(DEFAULT_HORIZON_MS, window, widest))


def _health(state: HealthState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    return decide_health(
        state,
        record.ts,
        window_ms=knobs.get_int("health.window_ms"),
        min_agents=knobs.get_int("health.min_agents"),
        consecutive=knobs.get_int("health.consecutive_failures"),
    )


def _breaker(state: BreakerState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    where = ("providers", state.provider)
    return decide_breaker(
        state,
        record.ts,
        threshold=knobs.get_int((*where, "breaker_failure_threshold")),
        reset_timeout_ms=knobs.get_int((*where, "breaker_reset_timeout_ms")),
    )


def _breaker_why(state: BreakerState, record: RecordedEvent, knobs: Knobs) -> str:
    where = f"providers.{state.provider}"
    if state.status == "open" and state.opened_at is not None:
        reset_ms = knobs.get_int(("providers", state.provider, "breaker_reset_timeout_ms"))
        due = state.opened_at + reset_ms / 1000
        return (
            f"the breaker opened at {moment(state.opened_at)}: it half-opens after "
            f"{where}.breaker_reset_timeout_ms ({reset_ms}), at {moment(due)}"
        )
    if state.status == "half_open":
        probe = state.probe_outcome or "no answer yet"
        return f"the breaker was half-open, its probe's outcome: {probe}"
    threshold = knobs.get_int(("providers", state.provider, "breaker_failure_threshold"))
    return (
        f"the breaker was closed after {state.consecutive_failures} failures in a row; it "
        f"opens at {where}.breaker_failure_threshold ({threshold})"
    )


# -- dead letters and restarts ------------------------------------------------------------


def _expiry(state: DeadLetterState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    return decide_expiry(
        state,
        record.ts,
        max_age_ms=knobs.get_int("dead_letters.max_age_ms"),
        max_retries=knobs.get_int("dead_letters.max_retries"),
    )


def _expiry_due(state: DeadLetterState, knobs: Knobs) -> float | None:
    if not state.entries:
        return None
    return expiry_at(
        state,
        max_age_ms=knobs.get_int("dead_letters.max_age_ms"),
        max_retries=knobs.get_int("dead_letters.max_retries"),
    )


def _first_queued(state: DeadLetterState) -> float | None:
    return min((entry.enqueued_at for entry in state.entries), default=None)


def _letter_retry(state: DeadLetterState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    """A ``backoff`` retry must be due and allowed; a ``drain`` retry may go at once,
    whatever its backoff, once its provider has recovered: the log must hold a
    ``provider:recovered`` of it before the drain (in ``provider:<name>``, which the
    verification tracks for this: ``knobs.recovered``)."""
    found = record.event
    assert isinstance(found, AnnouncementDeadLetterRetried)
    hold = hold_ms(knobs.get_int("dead_letters.announce_timeout_ms"))
    runtime = found.runtime
    if found.reason == "drain":
        recovered = knobs.recovered
        if recovered is not None and found.provider not in recovered:
            return []  # no recovery asked for it
        drained = decide_drain(
            state, found.provider or "", now=record.ts, hold_ms=hold, runtime=runtime
        )
        return list(drained)
    return list(
        decide_retries(
            state,
            record.ts,
            max_retries=knobs.get_int("dead_letters.max_retries"),
            base_ms=knobs.get_int("dead_letters.retry_base_ms"),
            cap_ms=knobs.get_int("dead_letters.retry_cap_ms"),
            hold_ms=hold,
            runtime=runtime,
        )
    )


def _letter_retry_why(state: DeadLetterState, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, AnnouncementDeadLetterRetried)
    entry = next((e for e in state.entries if e.entry_id == found.entry_id), None)
    if entry is None:
        return f"entry {found.entry_id!r} is not in the queue"
    if found.attempt != entry.attempts + 1:
        return f"the entry had {entry.attempts} attempts, this is not attempt {found.attempt}"
    recovered = knobs.recovered
    if found.reason == "drain" and recovered is not None and found.provider not in recovered:
        return f"a drain for provider {found.provider!r}, which never recovered before it"
    max_retries = knobs.get_int("dead_letters.max_retries")
    if found.reason == "backoff" and entry.attempts >= max_retries:
        return f"its {entry.attempts} attempts already spent dead_letters.max_retries"
    hold = hold_ms(knobs.get_int("dead_letters.announce_timeout_ms"))
    other = found.runtime is not None and entry.sending_runtime != found.runtime
    if other and entry.sending_since is not None and record.ts < entry.sending_since + hold / 1000:
        return (
            f"another runtime's send of it, under way since {moment(entry.sending_since)}, "
            f"may still have been running (no outcome, less than {hold} ms before)"
        )
    if found.reason == "drain":
        ahead = held_ahead(state, entry, record.ts, hold_ms=hold, runtime=found.runtime)
        if ahead is not None:
            return (
                f"entry {ahead.entry_id!r}, queued before it in its conversation, was being "
                f"sent by another runtime (since {moment(ahead.sending_since or 0)}, no "
                f"outcome, less than {hold} ms before): sent now, it could be read first"
            )
    base = knobs.get_int("dead_letters.retry_base_ms")
    cap = knobs.get_int("dead_letters.retry_cap_ms")
    due = retry_at(entry, base_ms=base, cap_ms=cap, hold_ms=hold, runtime=found.runtime)
    early = round((due - record.ts) * 1000)
    return f"retry {found.attempt} is due at {moment(due)}; it went {early} ms early"


def _restart(state: RestartsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, SupervisorRestarted | SupervisorGaveUp)
    session = found.session if isinstance(found, SupervisorGaveUp) else None
    return [
        decide_restart(
            found.actor,
            state.history.get(restarts_key(found.runtime, found.actor), ()),
            record.ts,
            reason=found.reason,
            max_restarts=knobs.get_int("supervision.max_restarts"),
            within_ms=knobs.get_int("supervision.within_ms"),
            backoff_base_ms=knobs.get_int("supervision.restart_backoff_base_ms"),
            backoff_cap_ms=knobs.get_int("supervision.restart_backoff_cap_ms"),
            session=session,
            runtime=found.runtime,
            crash_id=found.crash_id,
        )
    ]


# -- give-up notices a crash cut short (the ``runtime`` stream) ----------------------------


class NoticeWatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The ``runtime`` stream's give-up notices with no outcome, and when its latest
    process started (a resend is owed by a process alive to sweep)."""

    notices: GiveUpNotices = msgspec.field(default_factory=GiveUpNotices)
    started_at: float = 0.0


class _NoticeWatchFolder:
    __slots__ = ("_notices", "_started_at")

    def __init__(self, state: NoticeWatch) -> None:
        self._notices = GiveUpNoticesFolder(state.notices)
        self._started_at = state.started_at

    def add(self, record: RecordedEvent) -> None:
        if type(record.event) is RuntimeStarted:
            self._started_at = record.ts
        else:
            self._notices.add(record)

    def state(self) -> NoticeWatch:
        return NoticeWatch(notices=self._notices.state(), started_at=self._started_at)


_NOTICES = FolderAggregate(
    "verify_give_up_notices",
    NoticeWatch,
    _NoticeWatchFolder,
    moves=(GIVE_UP_NOTICES.moves or frozenset()) | {RuntimeStarted},
)


def _announce_ms(knobs: Knobs) -> int:
    return knobs.get_int("dead_letters.announce_timeout_ms")


def _sweep_ms(knobs: Knobs) -> int:
    """How often a supervisor sweeps (for either sweep that is due, the resend with it)."""
    ghost = knobs.get_int("subagents.ghost_sweep_interval_ms")
    return min(ghost, knobs.get_int("subagents.heartbeat_interval_ms"))


def _resent(state: NoticeWatch, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    return list(
        decide_notice_resends(state.notices, record.ts, announce_timeout_ms=_announce_ms(knobs))
    )


def _resent_why(state: NoticeWatch, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, AnnouncementResent)
    unsent = state.notices.unsent.get(found.announcement_id)
    if unsent is None:
        return f"no give-up notice {found.announcement_id!r} is waiting for its send's outcome"
    age_s = record.ts - unsent.queued_at
    if age_s > RESEND_WITHIN_S:
        return (
            f"it was queued at {moment(unsent.queued_at)}, {round(age_s)} s before: older "
            f"than {round(RESEND_WITHIN_S)} s, it is not sent again"
        )
    ms = _announce_ms(knobs)
    due = unsent.since + notice_resend_wait_s(ms)
    early = round((due - record.ts) * 1000)
    return (
        f"its last send began at {moment(unsent.since)} and may take "
        f"dead_letters.announce_timeout_ms ({ms}) + 5000 ms, until {moment(due)}; "
        f"it was sent again {early} ms before"
    )


def _resend_due(state: NoticeWatch, knobs: Knobs) -> float | None:
    if not state.notices.unsent:
        return None
    return notice_resend_due(
        state.notices,
        announce_timeout_ms=_announce_ms(knobs),
        sweep_ms=_sweep_ms(knobs),
        not_before=state.started_at,
    )


def _first_resend(state: NoticeWatch) -> float | None:
    since = min((unsent.since for unsent in state.notices.unsent.values()), default=None)
    return None if since is None else max(since, state.started_at)


def _pipeline_timeout(event: Event) -> bool:
    return isinstance(event, ExecutionAborted) and event.reason == "pipeline_timeout"


_RUNS = "session:"
#: the run fold, over the events that move it (a session's other events cost a lookup)
_RUN = Selective(
    RUN,
    (
        *(SubagentSpawned, SubagentProgress, SubagentArtifact, SubagentCompleted),
        *(SubagentWatchdogTimeout, SubagentGhostSwept, SubagentGivenUp, SubagentSuspicious),
        SubagentRecoveryDecided,
    ),
)
_RUN_ENDS: frozenset[type[Event]] = frozenset(
    {
        *(SubagentSpawned, SubagentCompleted, SubagentWatchdogTimeout),
        *(SubagentGhostSwept, SubagentGivenUp),
    }
)
_CALL_ENDS = (TurnCompleted, ExecutionAborted, UserInterrupt)
_CALL_MOVES: frozenset[type[Event]] = frozenset(
    {
        *(PromptStarted, PromptActivity, PromptCompleted, PromptFailed, PromptTimeout),
        *_CALL_ENDS,
        *_RUN_ENDED,
    }
)
_TURN_MOVES: frozenset[type[Event]] = frozenset({TurnStarted, *_CALL_ENDS, *_RUN_ENDED})
_LETTER_MOVES: frozenset[type[Event]] = frozenset(
    {
        *(AnnouncementDeadLettered, AnnouncementDeadLetterDelivered),
        *(AnnouncementDeadLetterExpired, AnnouncementSendFailed),
    }
)
BUILTIN: tuple[Verifier[Any] | Deadline[Any], ...] = (
    Verifier("subagent:watchdog_timeout", _RUN, _watchdog, _RUNS, why=_watchdog_why),
    Verifier("subagent:ghost_swept", _RUN, _ghost, _RUNS, why=_ghost_why),
    Verifier("subagent:suspicious", _RUN, _suspicious, _RUNS),
    Verifier("subagent:recovery_decided", _RUN, _recovery, _RUNS),
    Verifier("execution:prompt_timeout", _CALLS, _prompt_timeout, _RUNS, why=_prompt_why),
    Verifier(
        "prompt:retry_scheduled", _CALLS, _retry, _RUNS, why=_retry_why, when=_recorded_inputs
    ),
    Verifier(
        "execution:aborted", _CALLS, _execution, _RUNS, why=_execution_why, when=_pipeline_timeout
    ),
    Verifier("provider:degraded", _health_fold, _health, "provider:"),
    Verifier("provider:recovered", _health_fold, _health, "provider:"),
    Verifier("breaker:opened", BREAKER, _breaker, "provider:", why=_breaker_why),
    Verifier("breaker:half_opened", BREAKER, _breaker, "provider:", why=_breaker_why),
    Verifier("breaker:closed", BREAKER, _breaker, "provider:", why=_breaker_why),
    Verifier("announcement:dead_letter_expired", DEADLETTER, _expiry, "deadletter"),
    Verifier(
        "announcement:dead_letter_retried",
        DEADLETTER,
        _letter_retry,
        "deadletter",
        why=_letter_retry_why,
    ),
    Verifier("supervisor:restarted", RESTARTS, _restart, "runtime"),
    Verifier("supervisor:gave_up", RESTARTS, _restart, "runtime"),
    Verifier("announcement:resent", _NOTICES, _resent, "runtime", why=_resent_why),
    Deadline(
        "sub-agent watchdog",
        "subagent:watchdog_timeout",
        _RUN,
        _watchdog_due,
        _RUNS,
        survives_actor_restart=True,  # a restarted SubAgent re-arms a running run's watchdog
        moves=_RUN_ENDS,
        earliest=_run_started,
    ),
    Deadline(
        "ghost sweep",
        "subagent:ghost_swept",
        _RUN,
        _ghost_due,
        _RUNS,
        slack_ms=_ms("subagents.ghost_sweep_interval_ms"),
        survives_restart=True,
        moves=_RUN_ENDS,
        earliest=_ghost_earliest,
    ),
    Deadline(
        "prompt timeout", "execution:prompt_timeout", _CALLS, _prompt_due, _RUNS, moves=_CALL_MOVES
    ),
    Deadline(
        "execution timeout",
        "execution:aborted",
        _CALLS,
        _execution_due,
        _RUNS,
        moves=_TURN_MOVES,
        earliest=_turn_started,
    ),
    Deadline(
        "dead-letter expiry",
        "announcement:dead_letter_expired",
        DEADLETTER,
        _expiry_due,
        "deadletter",
        survives_restart=True,
        moves=_LETTER_MOVES,
        earliest=_first_queued,
    ),
    Deadline(
        "give-up notice resend",
        "announcement:resent",
        _NOTICES,
        _resend_due,
        "runtime",
        slack_ms=_sweep_ms,  # the supervisor's sweep resends it
        survives_restart=True,  # read from the log: the next process owes it
        moves=_NOTICES.moves or frozenset(),
        earliest=_first_resend,
    ),
)

#: The built-in registry: every decision above, and DESIGN's decision tags.
VERIFIERS = Registry(decisions=DECISIONS).with_(
    *BUILTIN, *ACTIVATION_RULES, *DECISION_RULES, *CONTEXT_RULES
)
