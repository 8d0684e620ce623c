"""The lossless DAG engine: fit a session into a budget, losing nothing.

Each :meth:`DagEngine.assemble` call, before a provider call:

1. stores the session's new messages (verbatim, idempotent by id), and cuts the pinned
   system prompt (marked) when it would leave the newest turn less than it needs, up to
   half the budget;
2. keeps the fresh tail (the last ``fresh_tail_turns`` user turns) verbatim; when the
   tail alone does not fit, it shrinks to fewer whole turns, then clips the largest
   messages, and records ``context:dag_degraded`` (``tail_over_budget``);
3. while the assembled context is above ``context_threshold`` x the budget, summarizes
   the oldest unsummarized chunk before the tail into a leaf, and folds every
   ``condensed_min_fanout`` same-depth summaries into a deeper one. Each summarizer call
   is governed per tenant (breaker, rolling spend caps); when it may not run, an
   emergency truncation (marked, deterministic, no LLM) stands in and the degrade is
   recorded; when it fails, the failure is recorded and nothing is retried inline;
4. if it still does not fit, leaves out whole units (a summary, or a message with its
   tool results) of the history between the pinned system prompt and the tail: the
   oldest first, or, relevance-first, the least relevant to the recent user turns;
5. repairs the transcript for provider validity, and marks the cache fence.

Everything decided is returned as events for ``context:<session>`` (the ContextStore
actor appends them before it hands the messages on); :meth:`restore` rebuilds a session
from that stream and the session's messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.config import ContextEngineSettings
from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextDagDegraded,
    Event,
    RecordedEvent,
)
from stalwart.ids import new_id
from stalwart.state import CONTEXT_DAG, ContextDagState, fold

from ._dag import ContextScopeError, DagSession, valid_session_id
from ._ledger import MemoryLedger, SummarizerLedger
from ._recall import Recall
from ._render import DAG_SYSTEM_CLAUSE
from ._repair import repair
from ._select import clip_tail, cut_message, select_history
from ._summarize import Summaries, TurnLog
from ._tokens import TokenEstimator, estimate_message_tokens
from ._types import ContextMessage, Summarizer

__all__ = ["Assembly", "DagEngine", "ModelProfile"]

log = get_logger(__name__)


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine needs to know of the model it assembles for."""

    provider: Literal["openai", "anthropic"] = "anthropic"
    model: str = ""
    caching: bool = True
    small: bool = False


class Assembly(msgspec.Struct, frozen=True, kw_only=True):
    """One assembled context. ``messages[:fence]`` is the cache fence's prefix: the
    system prompt and the condensed summaries that fit with room to spare, which change
    only when a condensation above depth 0 rewrites them or the tail more than doubles
    (the leaves after them change every few turns, the conversation every turn).
    ``breakpoints`` are the message indices an Anthropic request marks with
    ``cache_control`` (at most 4: the system prompt, the fence, the last summary, the
    last message). ``events`` go to
    ``context:<session>`` in order; the last is always the ``context:assembled`` record.
    ``factor`` is the model's calibration factor ``tokens`` was counted at: a report of
    the provider's count is compared with ``tokens`` at that factor, whatever reports
    moved it meanwhile (:meth:`DagEngine.calibrate`)."""

    messages: tuple[ContextMessage, ...]
    tokens: int
    budget: int
    fence: int
    breakpoints: tuple[int, ...]
    summaries_made: tuple[str, ...] = ()
    degraded: tuple[str, ...] = ()
    evicted: int = 0
    repairs: int = 0
    clipped: int = 0
    relevance_first: bool = False
    layers_fired: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    factor: float = 1.0


class DagEngine(Summaries, Recall):
    """The DAG engine over any number of sessions, with per-tenant summarizer governance.

    Not thread-safe: one owner calls it at a time (the ContextStore actor's sessions,
    under its lock; the CLI; a benchmark). Each summarizer call runs inside
    ``outside()``, where that owner lets others in (the ContextStore releases its lock
    there), and is timed inside it. Each call is admitted and released by ``ledger``
    (in memory by default; the ContextStore's is the event store), also inside
    ``outside()``, so the ledger is thread-safe: calls still running
    count against their tenant's spend caps, and a half-open breaker allows one trial
    among them.
    """

    def __init__(
        self,
        settings: ContextEngineSettings | None = None,
        *,
        summarizer: Summarizer,
        clock: Clock,
        make_id: Callable[[], str] = new_id,
        outside: Callable[[], AbstractContextManager[object]] = nullcontext,
        ledger: SummarizerLedger | None = None,
    ) -> None:
        self.settings = settings or ContextEngineSettings()
        self.summarizer = summarizer
        self.clock = clock
        self.make_id = make_id
        self.outside = outside
        lease_ms = self.settings.summarizer_spend.reservation_lease_ms
        self.ledger = ledger or MemoryLedger(clock, lease_ms=lease_ms, make_id=make_id)
        self.sessions: dict[str, DagSession] = {}
        self.estimators: dict[tuple[str, str], TokenEstimator] = {}

    # -- sessions and state -----------------------------------------------------------

    def _session(self, session_id: str, tenant: str | None) -> DagSession:
        if not valid_session_id(session_id):
            raise ContextScopeError("the session id is malformed")
        session = self.sessions.get(session_id)
        if session is None:
            session = DagSession(session_id, tenant, estimate_message_tokens)
            self.sessions[session_id] = session
        return session

    def restore(
        self,
        session_id: str,
        records: Iterable[RecordedEvent],
        messages: Sequence[ContextMessage],
    ) -> DagSession:
        """Rebuild a session from its ``context:<session>`` records and its messages."""
        return self.restore_state(
            session_id, fold(CONTEXT_DAG, f"context:{session_id}", records), messages
        )

    def restore_state(
        self, session_id: str, state: ContextDagState, messages: Sequence[ContextMessage]
    ) -> DagSession:
        """Rebuild a session from its DAG fold (``load_state(..., CONTEXT_DAG)``, which
        starts from a snapshot) and its messages."""
        session = DagSession(session_id, None, estimate_message_tokens)
        if not valid_session_id(session_id):
            raise ContextScopeError("the session id is malformed")
        session.ingest(messages)
        session.restore(state)
        self.sessions[session_id] = session
        return session

    def estimator(self, profile: ModelProfile) -> TokenEstimator:
        key = (profile.provider, profile.model)
        found = self.estimators.get(key)
        if found is None:
            found = self.estimators[key] = TokenEstimator(profile.provider, profile.model)
        return found

    def calibrate(
        self,
        profile: ModelProfile,
        estimated: int,
        reported: int,
        *,
        overhead: int = 0,
        factor: float | None = None,
    ) -> float:
        """Feed the provider's reported input tokens for an assembly whose
        ``Assembly.tokens`` was ``estimated``, counted at ``factor`` (its
        ``Assembly.factor``; None: the factor now in force), sent with ``overhead`` more
        tokens (uncalibrated: a system text, tool declarations)."""
        estimator = self.estimator(profile)
        raw = self.raw_estimate(profile, estimated, overhead, factor=factor)
        return estimator.calibrate(raw, reported)

    def raw_estimate(
        self,
        profile: ModelProfile,
        estimated: int,
        overhead: int = 0,
        *,
        factor: float | None = None,
    ) -> int:
        """What :meth:`calibrate` feeds the estimator for ``Assembly.tokens`` of
        ``estimated`` (counted at ``factor``, its ``Assembly.factor``; None, or a factor
        not above 0: the factor now in force) and ``overhead``: the uncalibrated estimate
        of the whole request. Several calls of a model are in flight at once: a report
        divided by a factor that the others' reports moved since its assembly would look
        denser (or sparser) than it was, and each one would push the factor further."""
        counted_at = factor if factor is not None and factor > 0 else None
        return round(estimated / (counted_at or self.estimator(profile).factor)) + overhead

    # -- assembly ---------------------------------------------------------------------

    def assemble(
        self,
        session_id: str,
        messages: Sequence[ContextMessage],
        budget: int,
        *,
        tenant: str | None = None,
        profile: ModelProfile | None = None,
        overhead: int = 0,
    ) -> Assembly:
        """The context for the next provider call of ``session_id`` within ``budget``.

        ``overhead`` is the uncalibrated estimate of what the request carries besides
        these messages and ``budget`` already leaves out (the caller's system text and
        tool declarations, counted at factor 1 by ``request_budget`` without an
        estimator): the provider counts it at the calibrated factor too, so when that
        factor is above 1 the messages get what it adds less room.

        ContextScopeError (with a ``context:dag_degraded`` ``fail_closed_rollover`` event
        in ``error.events``) when the write's scope is ambiguous: a malformed session id,
        another tenant than the session's, or messages that rewrite its history."""
        profile = profile or ModelProfile()
        turn = TurnLog()
        try:
            session = self._session(session_id, tenant)
            if session.bound and session.tenant != tenant:
                raise ContextScopeError("the session belongs to another tenant")
            session.ingest(messages)
            if not session.bound:
                turn.events.append(ContextBound(session=session_id, tenant=tenant))
                session.bound, session.tenant = True, tenant
        except ContextScopeError as exc:
            refusal = ContextDagDegraded(
                reason="fail_closed_rollover",
                tenant=tenant,
                session=session_id if valid_session_id(session_id) else None,
            )
            log.warning("context_write_refused", reason="fail_closed_rollover", tenant=tenant)
            exc.events = (refusal,)
            raise
        estimator = self.estimator(profile)
        factor = estimator.factor
        # the overhead costs ``factor`` x its estimate too (never counted below it)
        raw_budget = max(1, math.floor((budget - estimator.overhead_extra(overhead)) / factor))
        return self._assemble(session, raw_budget, budget, factor, profile, turn)

    def relevance_first(self, profile: ModelProfile) -> bool:
        """Relevance-first assembly: never on a caching profile; otherwise the explicit
        ``relevance.first_by_default`` if set, else on for small models."""
        if profile.caching:
            return False
        forced = self.settings.relevance.first_by_default
        return profile.small if forced is None else forced

    def _assemble(
        self,
        session: DagSession,
        raw_budget: int,
        budget: int,
        factor: float,
        profile: ModelProfile,
        turn: TurnLog,
    ) -> Assembly:
        system = self._fitted_system(session, raw_budget, turn)
        system_tokens = estimate_message_tokens(system)
        room = raw_budget - system_tokens
        tail = self._tail(session, room, turn)
        self._summarize(session, raw_budget, system_tokens, tail, turn)
        tail_messages = session.messages[tail:]
        tail_tokens = session.range_tokens(tail, len(session.messages))
        clipped = 0
        if tail_tokens > room:
            tail_messages, clipped = clip_tail(tail_messages, room)
            tail_tokens = sum(estimate_message_tokens(message) for message in tail_messages)
            turn.layers["clip"] = None
        relevance = self.relevance_first(profile)
        available = room - tail_tokens
        for _ in range(16):
            kept, evicted, fenced = select_history(
                session,
                tail,
                available,
                relevance=relevance,
                recent_turns=self.settings.relevance.recent_user_turns,
            )
            history: list[ContextMessage] = []
            for unit in kept:
                if unit.summary_id is not None:
                    history.append(session.rendered(unit.summary_id)[0])
                else:
                    history.extend(session.messages[unit.start : unit.end])
            assembled, repairs = repair([system, *history, *tail_messages])
            raw_total = sum(self._count(session, message) for message in assembled)
            over = raw_total - raw_budget
            if over <= 0:
                break
            if kept:  # what repair added (a synthetic result, say) comes out of history
                available = sum(unit.tokens for unit in kept) - over
                continue
            tail_messages, more = clip_tail(tail_messages, tail_tokens - over)
            tail_tokens = sum(estimate_message_tokens(message) for message in tail_messages)
            clipped = max(clipped, more)
            turn.layers["clip"] = None
        summaries = [unit.summary_id for unit in kept if unit.summary_id is not None]
        fence = 1 + fenced
        for name, happened in (("evict", evicted), ("repair", repairs)):
            if happened:
                turn.layers[name] = None
        tokens = math.ceil(raw_total * factor)
        turn.events.append(
            ContextAssembled(
                tokens_in=math.ceil(session.cum[-1] * factor),
                tokens_out=tokens,
                budget=budget,
                layers_fired=tuple(turn.layers),
                engine="dag",
                provider=profile.provider,
                messages_in=len(session.messages),
                messages_out=len(assembled),
                summaries_made=len(turn.made),
                fence=fence,
                evicted=evicted,
                repairs=repairs,
                tail_clipped=session.tail_degraded,
            )
        )
        return Assembly(
            messages=tuple(assembled),
            tokens=tokens,
            budget=budget,
            fence=fence,
            breakpoints=tuple(sorted({0, fence - 1, len(summaries), len(assembled) - 1})),
            summaries_made=tuple(turn.made),
            degraded=tuple(turn.degraded),
            evicted=evicted,
            repairs=repairs,
            clipped=clipped,
            relevance_first=relevance,
            layers_fired=tuple(turn.layers),
            events=tuple(turn.events),
            factor=factor,
        )

    def _count(self, session: DagSession, message: ContextMessage) -> int:
        position = session.positions.get(message.message_id)
        if position is not None and session.messages[position] is message:
            return session.tokens[position]
        if message.message_id.startswith("summary:"):
            return session.rendered(message.message_id.removeprefix("summary:"))[1]
        return estimate_message_tokens(message)

    def _system(self, session: DagSession) -> ContextMessage:
        """The pinned system prompt (the session's leading system messages) with the
        dag-mode clause; one message, the same every turn."""
        cached = session.system
        if cached is not None and cached[0] == session.pinned:
            return cached[1]
        system = _with_clause(_pinned(session))
        session.system = (session.pinned, system)
        return system

    def _fitted_system(self, session: DagSession, raw_budget: int, turn: TurnLog) -> ContextMessage:
        """The system prompt, cut when it would leave the newest turn less than it needs
        (up to half the budget): the pinned text is cut to fit with a marker (ctx_expand
        of its first message returns it whole), and the dag-mode clause kept after it."""
        system = self._system(session)
        tokens = estimate_message_tokens(system)
        newest = session.range_tokens(session.tail_start(1), len(session.messages))
        limit = raw_budget - min(newest, raw_budget // 2)
        if tokens <= limit:
            session.system_clipped = False
            return system
        if not session.system_clipped:  # once an episode, like the tail's
            session.system_clipped = True
            log.warning(
                "context_system_over_budget",
                session=session.session_id,
                system_tokens=tokens,
                limit=limit,
                error_kind="resource",
            )
        turn.layers["system_clip"] = None
        pinned = _pinned(session)
        clause = tokens - estimate_message_tokens(pinned)
        return _with_clause(cut_message(pinned, limit - clause) or pinned)

    def _tail(self, session: DagSession, room: int, turn: TurnLog) -> int:
        """The fresh tail's start; shrunk to fewer whole turns (recorded) when it alone
        does not fit in ``room``."""
        count = len(session.messages)
        start = session.tail_start(self.settings.fresh_tail_turns)
        full = session.range_tokens(start, count)
        if full <= room:
            session.tail_degraded = False
            return start
        for later in session.later_tail_starts(start):
            start = later
            if session.range_tokens(start, count) <= room:
                break
        if not session.tail_degraded:
            session.tail_degraded = True
            event = ContextDagDegraded(
                reason="tail_over_budget",
                tenant=session.tenant,
                session=session.session_id,
                knob="context_engine.fresh_tail_turns",
                used=full,
                limit=max(0, room),
            )
            turn.events.append(event)
            turn.degraded.append("tail_over_budget")
            log.warning(
                "context_tail_over_budget",
                session=session.session_id,
                tail_tokens=full,
                room=room,
                error_kind="resource",
            )
        turn.layers["tail_degrade"] = None
        return start


def _pinned(session: DagSession) -> ContextMessage:
    """The session's leading system messages as one message (empty when there are none)."""
    parts = [message.content for message in session.messages[: session.pinned]]
    first = session.messages[0] if session.pinned else None
    return ContextMessage(
        message_id=first.message_id if first else "system:dag",
        seq=first.seq if first else 0,
        role="system",
        content="\n\n".join(part for part in parts if part),
        ts=first.ts if first else 0.0,
    )


def _with_clause(pinned: ContextMessage) -> ContextMessage:
    """``pinned`` with the dag-mode clause after it."""
    content = "\n\n".join(part for part in (pinned.content, DAG_SYSTEM_CLAUSE) if part)
    return msgspec.structs.replace(pinned, content=content)
