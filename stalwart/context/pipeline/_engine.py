"""The pipeline engine: the ten layers in order, each behind its own breaker."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock
from stalwart.context._dag import ContextScopeError
from stalwart.context._repair import repair
from stalwart.context._tokens import TokenEstimator
from stalwart.context._types import ContextMessage, Summarizer
from stalwart.events import (
    ContextAssembled,
    ContextBound,
    ContextCompacted,
    ContextDagDegraded,
    ContextLayerEnabled,
    ContextLayerHalfOpened,
    Event,
    RecordedEvent,
)
from stalwart.state import (
    LayerBreaker,
    PipelineState,
    apply_pipeline_event,
    decide_layer_failure,
    layer_trial_due,
)

from ._clean import clean_thinking, guard_surrogates, scrub_signatures, strip_reasoning_tags
from ._compaction import compact, keep_summary
from ._config import LAYERS, PipelineConfig
from ._fence import added_since, breakpoints, cache_break, late_results, over_threshold
from ._fit import LEFT_OUT_ID, Cut, fit_newest_turn
from ._objective import reinforce_objective
from ._reinject import rehydrate
from ._run import FileReader, Outcome, Run
from ._shape import evict_dead_content, mask_observations, window_history
from ._transcript import chars, digest, latest_turn, to_provider

__all__ = ["PipelineEngine", "PipelineResult", "is_replay"]

T = TypeVar("T")
Messages = tuple[ContextMessage, ...]
Layer = Callable[[tuple[ContextMessage, ...], Run], Outcome]

_LAYERS: tuple[tuple[str, Layer], ...] = tuple(
    zip(
        LAYERS,
        (
            clean_thinking,
            scrub_signatures,
            guard_surrogates,
            strip_reasoning_tags,
            window_history,
            evict_dead_content,
            mask_observations,
            compact,
            rehydrate,
            reinforce_objective,
        ),
        strict=True,
    )
)

#: What runs instead of a layer that raised or is disabled, where skipping it outright
#: would undo earlier work: the compaction in force stays applied.
_FALLBACKS: dict[str, Layer] = {"compaction": keep_summary}

log = get_logger("stalwart.context.pipeline")


class PipelineResult(msgspec.Struct, frozen=True, kw_only=True):
    """One assembly. ``messages`` are provider-valid, in order, with their ids and
    thinking blocks (``provider_messages(Message)`` gives the provider shape);
    ``events`` are to be appended to ``context:<session id>``, in order.
    ``messages[:fence]`` is the cache fence's prefix, sent unchanged on the next call
    unless it breaks; ``breakpoints`` are the indices a request marks ``cache_control``
    (Anthropic); ``cache_break`` says why this call shaped the messages behind the
    previous fence again (None when it held, or with no fence). ``now`` is the clock
    reading the layers decided at: the layer breaker's events happened then.
    ``clipped``: how many of the newest turn's tool results ``messages`` carry cut to
    fit the budget; ``steps_left_out``: how many of its oldest steps (an assistant
    message and the results of its calls) they leave out to fit (see ``_fit``)."""

    messages: tuple[ContextMessage, ...]
    events: tuple[Event, ...]
    layers_fired: tuple[str, ...]
    layers_failed: tuple[str, ...]
    messages_in: int
    messages_out: int
    chars_in: int
    chars_out: int
    tokens_in: int
    tokens_out: int
    budget: int
    repairs: int = 0
    fence: int = 0
    breakpoints: tuple[int, ...] = ()
    cache_break: str | None = None
    now: float = 0.0
    clipped: int = 0
    steps_left_out: int = 0

    def provider_messages(self, factory: Callable[..., T]) -> tuple[T, ...]:
        """The messages as ``factory(role=, content=, tool_calls=, tool_call_id=,
        images=)`` builds them, e.g. ``result.provider_messages(stalwart.providers.Message)``."""
        return to_provider(self.messages, factory)

    @property
    def compacted(self) -> bool:
        return any(isinstance(event, ContextCompacted) for event in self.events)


def is_replay(state: PipelineState, provider: str, head_digest: str, count: int) -> bool:
    """Whether this run is a cache-break replay (the signature scrubber acts): there was
    a previous assembly, and either the provider changed or this input (``count`` ids,
    the first ``state.last_input_count`` of which hash to ``head_digest``) does not
    extend the previous one (it is shorter, or that prefix hashes differently): history
    was rewritten, so the provider re-reads it uncached."""
    if state.assemblies == 0:
        return False
    if provider != state.last_provider or count < state.last_input_count:
        return True
    return head_digest != state.last_input_digest


class PipelineEngine:
    """The ten-layer context engine for one session (see the package docs).

    ``assemble`` runs the layers over the whole stored transcript each time; what must
    outlive a run (breakers, the compaction in force, the previous input) is in
    ``state``, which is exactly the fold of the events ``assemble`` returns: append them
    and :meth:`from_events` rebuilds the same engine after a restart.
    """

    def __init__(
        self,
        config: PipelineConfig | None = None,
        *,
        summarizer: Summarizer,
        clock: Clock,
        reader: FileReader | None = None,
        estimator: TokenEstimator | None = None,
        session: str = "",
        state: PipelineState | None = None,
    ) -> None:
        self.config = config or PipelineConfig()
        self._summarizer = summarizer
        self._clock = clock
        self._reader = reader
        self._estimator = estimator
        self._estimators: dict[str, TokenEstimator] = {}
        # the input's raw token counts from the previous run (by message id), so a long
        # transcript is not re-estimated message by message every turn
        self._raw: tuple[str, dict[str, tuple[ContextMessage, int]]] = ("", {})
        self.session = session
        self._state = state or PipelineState()
        # the messages behind the cache fence, as the previous call sent them (memory
        # only: an engine rebuilt from the log breaks its fence once)
        self._held: Messages | None = None
        # the ids of the tool results the previous call sent cut to fit the budget, and
        # how many of the newest turn's oldest steps it left out
        self._cut: frozenset[str] = frozenset()
        self._steps = 0

    @classmethod
    def from_events(
        cls,
        events: Iterable[RecordedEvent | Event],
        config: PipelineConfig | None = None,
        *,
        summarizer: Summarizer,
        clock: Clock,
        reader: FileReader | None = None,
        estimator: TokenEstimator | None = None,
        session: str = "",
    ) -> PipelineEngine:
        """An engine whose state is the fold of a session's ``context:`` events."""
        state = PipelineState()
        for item in events:
            state = apply_pipeline_event(
                state, item.event if isinstance(item, RecordedEvent) else item
            )
        return cls(
            config,
            summarizer=summarizer,
            clock=clock,
            reader=reader,
            estimator=estimator,
            session=session,
            state=state,
        )

    @property
    def state(self) -> PipelineState:
        return self._state

    def estimator(self, provider: str) -> TokenEstimator:
        """The estimator used for ``provider`` (calibrate it with reported usage)."""
        if self._estimator is not None:
            return self._estimator
        found = self._estimators.get(provider)
        if found is None:
            found = self._estimators[provider] = TokenEstimator(provider)
        return found

    def _check_scope(self, tenant: str | None) -> None:
        """Refuse an assembly for another tenant than the one the session is bound to:
        its messages would be shaped with, and answered from, the other's compaction."""
        if not self._state.bound or self._state.tenant == tenant:
            return
        log.warning("context_write_refused", reason="fail_closed_rollover", tenant=tenant)
        error = ContextScopeError("the session belongs to another tenant")
        error.events = (
            ContextDagDegraded(
                reason="fail_closed_rollover", tenant=tenant, session=self.session or None
            ),
        )
        raise error

    def assemble(
        self,
        messages: Sequence[ContextMessage],
        budget_tokens: int,
        *,
        provider: str,
        caching: bool = True,
        estimator: TokenEstimator | None = None,
        overhead: int = 0,
        tenant: str | None = None,
    ) -> PipelineResult:
        """The transcript to send ``provider`` for a window of ``budget_tokens``;
        ``caching``: the provider caches prompt prefixes (the cache fence holds).
        ``estimator``: the one to count with this time instead of the engine's own (the
        runtime shares one per model, calibrated with the usage providers report).
        ``overhead``: the uncalibrated estimate of what the request carries besides these
        messages and ``budget_tokens`` already leaves out at factor 1 (a system text, tool
        declarations): the provider counts it at the calibrated factor too, so above 1
        the layers fit the messages into less. The budget recorded, and the one a
        changed budget breaks the cache fence on, stays ``budget_tokens``: a factor that
        moves does not break the fence by itself. ``tenant``: whose session this is; the
        first assembly binds the session to it (``context:bound``), and a later one for
        another tenant raises ContextScopeError (its ``events`` hold the
        ``context:dag_degraded`` ``fail_closed_rollover`` to record) and runs nothing."""
        self._check_scope(tenant)
        original = tuple(messages)
        ids = [message.message_id for message in original]
        head_digest, input_digest = digest(ids, prefix=self._state.last_input_count)
        estimator = estimator or self.estimator(provider)
        room = max(1, budget_tokens - estimator.overhead_extra(overhead))
        run = Run(
            config=self.config,
            original=original,
            provider=provider,
            budget=room,
            now=self._clock.now(),
            turn=latest_turn(original),
            replay=is_replay(self._state, provider, head_digest, len(ids)),
            state=self._state,
            estimator=estimator,
            summarizer=self._summarizer,
            reader=self._reader,
        )
        shaped, events, fired, failed = self._layers(original, run)
        if not self._state.bound:
            events.insert(0, ContextBound(session=self.session, tenant=tenant))
        current, repairs, broke, cut = self._hold(
            original, shaped, events, run, budget_tokens, caching
        )
        clipped = self._clipped(cut)
        if clipped:
            fired.append("clip")
        if cut.steps:
            fired.append("omit_steps")
        held = self._state.fence if broke is None else 0  # what the previous call sent
        fence = fence_input = fence_turn = 0
        if caching and self.config.cache_fence_turns > 0:
            fence, fence_input = len(current), len(original)
            fence_turn = run.turn if broke is not None else self._state.fence_turn
        chars_in, chars_out = chars(original), chars(current)
        tokens_in = self._input_tokens(original, provider, estimator)
        tokens_out = estimator.messages(current)
        events.append(
            ContextAssembled(
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                budget=budget_tokens,
                layers_fired=tuple(fired),
                engine="pipeline",
                provider=provider,
                messages_in=len(original),
                messages_out=len(current),
                chars_in=chars_in,
                chars_out=chars_out,
                layers_failed=tuple(failed),
                input_count=len(ids),
                input_digest=input_digest,
                summaries_made=sum(isinstance(e, ContextCompacted) for e in events),
                repairs=repairs,
                fence=fence,
                fence_input=fence_input,
                fence_turn=fence_turn,
                cache_break=broke,
                tail_clipped=clipped > 0 or cut.steps > 0,
                steps_left_out=cut.steps,
            )
        )
        for event in events:
            self._state = apply_pipeline_event(self._state, event)
        self._held = current[:fence]
        if tokens_out > room:
            log.warning(
                "context over budget after pipeline",
                session=self.session,
                tokens_out=tokens_out,
                budget=room,
            )
        log.info(
            "context pipeline complete",
            session=self.session,
            provider=provider,
            messages_in=len(original),
            messages_out=len(current),
            chars_in=chars_in,
            chars_out=chars_out,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            budget=budget_tokens,
            layers_fired=fired,
            layers_failed=failed,
            repairs=repairs,
            fence=fence,
            cache_break=broke,
        )
        return PipelineResult(
            messages=current,
            events=tuple(events),
            layers_fired=tuple(fired),
            layers_failed=tuple(failed),
            messages_in=len(original),
            messages_out=len(current),
            chars_in=chars_in,
            chars_out=chars_out,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            budget=budget_tokens,
            repairs=repairs,
            fence=fence,
            breakpoints=breakpoints(current, held) if caching else (),
            cache_break=broke,
            now=run.now,
            clipped=clipped,
            steps_left_out=cut.steps,
        )

    def _hold(
        self,
        original: Messages,
        shaped: Messages,
        events: list[Event],
        run: Run,
        budget_tokens: int,
        caching: bool,
    ) -> tuple[Messages, int, str | None, Cut]:
        """What is sent (made provider-valid by the DAG engine's ``repair``), how many
        repairs it took, why the cache fence broke (see ``_fence``), and what this call
        cut of the newest turn to fit (see ``_fit``): the messages behind the previous
        fence as sent then, and the layers' output after it; or, when the fence breaks
        (a held transcript over the budget does), the layers' output whole."""
        repaired, repairs = repair(shaped)
        step = self.config.cache_fence_turns
        if not caching or step <= 0:
            fresh, cut = fit_newest_turn(tuple(repaired), run.budget, run.estimator)
            return fresh, repairs, None, cut
        # behind a fence, a cut newest turn is fitted under the compaction threshold:
        # the next steps fit behind the fence, read from the cache, until it is cut again
        headroom = int(run.budget * self.config.compaction_threshold)
        fresh, cut = fit_newest_turn(tuple(repaired), run.budget, run.estimator, target=headroom)
        held = self._held or ()
        added = added_since(shaped, original, self._state.fence_input)
        broke = cache_break(
            self._state,
            held=self._held is not None,
            replay=run.replay,
            budget=budget_tokens,
            late=late_results(held, added),
            compacted=any(isinstance(event, ContextCompacted) for event in events),
            turn=run.turn,
            step=step,
        )
        if broke is not None:
            return fresh, repairs, broke, cut
        repaired, held_repairs = repair(held + added)
        tokens = run.estimator.messages
        limit = run.budget * self.config.compaction_threshold
        fitted = bool(cut.ids) or cut.steps > 0
        held_tokens, fresh_tokens = tokens(repaired), tokens(fresh)
        if over_threshold(held_tokens, fresh_tokens, limit=limit, budget=run.budget, fitted=fitted):
            return fresh, repairs, "threshold", cut
        held_ids = {message.message_id for message in held}
        steps = self._steps if LEFT_OUT_ID in held_ids else 0
        return tuple(repaired), held_repairs, None, Cut(ids=self._cut & held_ids, steps=steps)

    def _clipped(self, cut: Cut) -> int:
        """How many tool results the request carries cut to fit (``cut``: those this
        call cut, or, when the cache fence held, those the previous call cut that it
        holds, with no characters counted, and the steps it left out). Logs what this
        call cut, and the steps the request leaves out."""
        if cut.chars:
            log.warning(
                "context newest turn cut to fit",
                session=self.session,
                results_cut=len(cut.ids),
                chars_cut=cut.chars,
            )
        if cut.steps:
            log.warning(
                "context newest turn steps left out",
                session=self.session,
                steps_left_out=cut.steps,
            )
        self._cut, self._steps = cut.ids, cut.steps
        return len(cut.ids)

    def _input_tokens(
        self, original: tuple[ContextMessage, ...], provider: str, estimator: TokenEstimator
    ) -> int:
        """``estimator.messages(original)``, reusing last run's count of each message
        that is unchanged (same id, equal message, same provider)."""
        cached_provider, cached = self._raw
        if cached_provider != provider:
            cached = {}
        fresh: dict[str, tuple[ContextMessage, int]] = {}
        total = 0
        for message in original:
            hit = cached.get(message.message_id)
            if hit is not None and (hit[0] is message or hit[0] == message):
                raw = hit[1]
            else:
                raw = estimator.raw(message)
            fresh[message.message_id] = (message, raw)
            total += raw
        self._raw = (provider, fresh)
        return math.ceil(total * estimator.factor)

    def _layers(
        self, current: tuple[ContextMessage, ...], run: Run
    ) -> tuple[tuple[ContextMessage, ...], list[Event], list[str], list[str]]:
        events: list[Event] = []
        fired: list[str] = []
        failed: list[str] = []
        for name, layer in _LAYERS:
            breaker = self._state.breaker(name)
            trial = breaker.status != "closed"
            if trial:
                if not layer_trial_due(breaker, run.now):
                    current = self._fallback(name, current, run, events)
                    continue
                events.append(ContextLayerHalfOpened(layer=name))
                log.info("context layer half-open", session=self.session, layer=name)
            try:
                outcome = layer(current, run)
            except Exception as exc:  # any layer bug must not fail the turn
                failed.append(name)
                events.extend(self._failure(name, breaker, exc, run.now))
                current = self._fallback(name, current, run, events)
                continue
            if trial:
                events.append(ContextLayerEnabled(layer=name))
                log.info("context layer re-enabled", session=self.session, layer=name)
            if outcome.messages != current:
                fired.append(name)
                self._log_fired(name, current, outcome)
            current = outcome.messages
            events.extend(outcome.events)
        return current, events, fired, failed

    def _fallback(
        self, name: str, current: tuple[ContextMessage, ...], run: Run, events: list[Event]
    ) -> tuple[ContextMessage, ...]:
        """What stands in for a layer that failed or is disabled (the compaction in force
        stays applied when the summarizer is down, and an emergency truncation keeps the
        request within the budget); unchanged for the other layers. Its events go to
        ``events``."""
        fallback = _FALLBACKS.get(name)
        if fallback is None:
            return current
        try:
            outcome = fallback(current, run)
        except Exception as exc:  # the stand-in is pure; if it breaks, carry on without it
            log.warning(
                "context layer fallback failed",
                session=self.session,
                layer=name,
                error=type(exc).__name__,
            )
            return current
        events.extend(outcome.events)
        return outcome.messages

    def _log_fired(self, name: str, current: tuple[ContextMessage, ...], outcome: Outcome) -> None:
        log.debug(
            "context layer fired",
            session=self.session,
            layer=name,
            messages_before=len(current),
            messages_after=len(outcome.messages),
        )
        for event in outcome.events:
            if isinstance(event, ContextCompacted):
                log.info(
                    "LLM compaction triggered",
                    session=self.session,
                    summary_id=event.summary_id,
                    turn=event.turn,
                    pruned_messages=len(event.added),
                    tokens=event.tokens,
                    budget=event.budget,
                    threshold=event.threshold,
                )

    def _failure(self, name: str, breaker: LayerBreaker, exc: Exception, now: float) -> list[Event]:
        error = type(exc).__name__
        failures = breaker.failures + 1
        log.warning(
            "context layer failed",
            session=self.session,
            layer=name,
            error=error,
            failures=failures,
            half_open_trial=breaker.status != "closed",
        )
        config = self.config
        decided = decide_layer_failure(
            name,
            breaker,
            now,
            error=error,
            limit=config.layer_failure_limit,
            cooldown_s=config.layer_retry_after_s,
        )
        if decided:
            log.warning(
                "Context layer disabled by circuit breaker",
                session=self.session,
                layer=name,
                failures=failures,
                error=error,
                errorKind="internal",
                retry_at=now + config.layer_retry_after_s,
                hint=f"the {name} layer raised {failures} times in a row; it is skipped until "
                "its half-open retry, the other layers keep running",
            )
        return decided
