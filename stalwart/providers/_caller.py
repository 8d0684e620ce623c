"""One model call that cannot hang: deadlines, retries, the fallback chain, the breaker.

For each model of the chain (the primary, then ``fallback_models``; a vision request uses
``vision_fallback_models``) the caller makes attempts. The primary's first attempt has the
stall budget and the makespan ceiling; every retry and fallback attempt has the shorter
whole-call limit. A retryable failure retries the same model with exponential backoff and
full jitter (at least the server's Retry-After), up to ``max_retries``; a 429 retries the
same model once only when its Retry-After is short, otherwise the chain moves on. A
Retry-After longer than ``rate_limit_same_model_max_retry_after_ms`` moves the chain on
whatever the status (nothing bounds a backoff sleep, so the caller never sits in one). Every
step is an event: session events in the caller's stream, outcomes and breaker changes in
``provider:<name>``.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Mapping
from contextlib import aclosing
from contextvars import ContextVar
from typing import Literal

import anyio

from stalwart._logs import get_logger
from stalwart.backoff import retry_delay
from stalwart.clock import Clock, Timer
from stalwart.config import AgentSettings
from stalwart.errors import (
    BreakerOpenError,
    CallSealedError,
    ConcurrencyError,
    PromptTimeoutError,
    ProviderError,
)
from stalwart.events import (
    Event,
    ModelFallbackExhausted,
    PromptActivity,
    PromptCompleted,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    ProviderCallFailed,
    ProviderCallSucceeded,
)
from stalwart.ids import new_id
from stalwart.state import (
    decide_fallback,
    decide_prompt_timeout,
    model_chain,
    next_deadline,
    window_started,
    window_touched,
)

from ._breaker import Breaker
from ._client import Accumulator, ProviderClient
from ._seal import CallSeal
from ._sink import EventSink
from ._types import (
    Done,
    ProviderRequest,
    ProviderResponse,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
)

log = get_logger(__name__)

#: how many times a breaker decision is taken again when another writer appended to the
#: provider stream between the fold and the append
_DECIDE_TRIES = 5
#: the seal of the call this task runs (each call is a task of its own; the tasks it
#: starts inherit it)
_SEAL: ContextVar[CallSeal | None] = ContextVar("stalwart_call_seal", default=None)

#: Sees each attempt's ``prompt:started``, then that attempt's stream events as they come.
OnEvent = Callable[[StreamEvent | PromptStarted], None]
_ACTIVITY: dict[type, Literal["text", "thinking", "tool_call"]] = {
    TextDelta: "text",
    ThinkingDelta: "thinking",
    ToolCallDelta: "tool_call",
}


def _pair(entry: str) -> tuple[str, str]:
    """``provider:model`` as (provider, model)."""
    provider, _, model = entry.partition(":")
    return provider, model


class _Live:
    """The running attempt's deadline window, and the cancel scope that enforces it."""

    def __init__(
        self, started: PromptStarted, ts: float, scope: anyio.CancelScope, timer: Timer | None
    ) -> None:
        self.started = started
        self.window = window_started(started, ts)
        self.last_recorded = float("-inf")  # the first sign of life is always recorded
        self.deltas = 0  # text, thinking and tool-call deltas so far: roughly tokens
        self.scope = scope
        self._timer = timer
        self._disarm: Callable[[], object] | None = None
        self._armed = 0  # which arming may still cancel the scope
        #: the final event came before the limit: the reply is whole, whatever follows
        self.complete = False

    def arm(self, now: float) -> None:
        """Move the scope's deadline to the window's next one: on the caller's Clock
        through its timer, else on the event loop's clock."""
        when, _, _ = next_deadline(self.window)
        if self._timer is None:
            self.scope.deadline = anyio.current_time() + (when - now)
            return
        self.disarm()
        armed = self._armed = self._armed + 1

        def expire() -> None:
            # a timer that fired as activity moved the window on must not cut the call
            if armed == self._armed:
                self.scope.cancel()

        self._disarm = self._timer(max(when - now, 0.0), expire)

    def disarm(self) -> None:
        self._armed += 1  # a firing already on its way to the loop is stale now
        if self._disarm is not None:
            self._disarm()
            self._disarm = None

    def finished(self, now: float) -> bool:
        """The reply's final event was read at ``now``: True (and the deadline disarmed)
        when that was before the window's limit, False (and the call cut) when after."""
        if next_deadline(self.window)[0] <= now:
            self.scope.cancel()
            return False
        self.disarm()
        self.scope.deadline = math.inf
        self.complete = True
        return True


class _Backoff:
    """The wait before a retry: ``seconds`` on the caller's Clock (through its timer),
    else on the event loop's clock, counted from when it is made."""

    def __init__(self, seconds: float, timer: Timer | None) -> None:
        self._over = anyio.Event()
        self._until = anyio.current_time() + seconds
        self._disarm = None if timer is None else timer(seconds, self._over.set)

    async def wait(self) -> None:
        if self._disarm is None:
            await anyio.sleep_until(self._until)
        else:
            await self._over.wait()

    def disarm(self) -> None:
        if self._disarm is not None:
            self._disarm()


class ModelCaller:
    """Calls an agent's model through its chain; safe to share by the agent's calls."""

    def __init__(
        self,
        agent: AgentSettings,
        clients: Mapping[str, ProviderClient],
        breakers: Mapping[str, Breaker],
        sink: EventSink,
        clock: Clock,
        *,
        agent_name: str = "default",
        rng: random.Random | None = None,
        skip: Callable[[str], bool] | None = None,
        timer: Timer | None = None,
    ) -> None:
        self.agent = agent
        #: keeps every deadline and backoff on ``clock`` (see :data:`stalwart.clock.Timer`;
        #: the runtime's is a scheduler timer on its portal, the loop the calls run on);
        #: without one they run on the event loop's clock, which is the real one
        self._timer = timer
        #: a provider the chain passes over before any call (degraded: seed 000 spends no
        #: tokens on a down provider), recorded as a fallback with reason
        #: ``provider_degraded`` and no call id, as a breaker's refusal is
        self.skip = skip
        self._clients = clients
        self._breakers = breakers
        self._sink = sink
        self._clock = clock
        self._agent_name = agent_name
        self._rng = rng or random.Random()

    def chain(self, request: ProviderRequest) -> list[tuple[str, str]]:
        """(provider, model) pairs in the order they are tried."""
        return [_pair(entry) for entry in self._names(request)]

    def providers(self) -> set[str]:
        """The providers of the agent's (text) chain."""
        return {provider for provider, _ in self.chain(ProviderRequest(messages=()))}

    def _names(self, request: ProviderRequest) -> tuple[str, ...]:
        agent = self.agent
        return model_chain(
            agent.provider,
            agent.model,
            agent.fallback_models,
            agent.vision_fallback_models,
            vision=request.needs_vision,
        )

    async def call(
        self,
        stream: str,
        request: ProviderRequest,
        on_event: OnEvent | None = None,
        *,
        seal: CallSeal | None = None,
    ) -> ProviderResponse:
        """The reply, or the last error after every model of the chain failed.

        ``seal``: the turn's hold on the call's records in ``stream``; once the turn seals
        it, the call's next record raises :class:`~stalwart.errors.CallSealedError` and
        the call ends there (see :mod:`stalwart.providers._seal`)."""
        token = _SEAL.set(seal)
        try:
            return await self._chain(stream, request, on_event)
        finally:
            _SEAL.reset(token)

    async def _chain(
        self, stream: str, request: ProviderRequest, on_event: OnEvent | None
    ) -> ProviderResponse:
        names = self._names(request)
        index = 0
        while True:
            provider, model = _pair(names[index])
            try:
                if self.skip is not None and self.skip(provider):
                    raise ProviderError(
                        f"provider {provider} is degraded",
                        kind="provider_degraded",
                        retryable=False,
                        provider=provider,
                        model=model,
                    )
                return await self._model(stream, provider, model, request, index == 0, on_event)
            except ProviderError as exc:
                # the pure rule: the next model, the chain spent, or (an overflow) neither
                decided = decide_fallback(
                    names,
                    index,
                    exc.kind,
                    agent=self._agent_name,
                    vision=request.needs_vision,
                    call_id=exc.call_id,
                )
                if decided is None:
                    raise
                await self._emit(stream, decided)
                if isinstance(decided, ModelFallbackExhausted):
                    raise
                index += 1

    async def _model(
        self,
        stream: str,
        provider: str,
        model: str,
        request: ProviderRequest,
        primary: bool,
        on_event: OnEvent | None,
    ) -> ProviderResponse:
        attempt = 0
        rate_limit_retried = False
        retry_of = ""  # the failed attempt this one retries (one call, several attempts)
        while True:
            attempt += 1
            kind: Literal["stall", "whole_call"] = (
                "stall" if primary and attempt == 1 else "whole_call"
            )
            try:
                return await self._attempt(
                    stream, provider, model, request, attempt, kind, on_event, retry_of
                )
            except BreakerOpenError:
                raise
            except ProviderError as exc:
                retry_of = exc.call_id or ""
                if not exc.retryable:
                    raise
                agent = self.agent
                jitter = self._rng.random()  # recorded: replay re-derives the delay from it
                delay = retry_delay(
                    attempt,
                    exc.status,
                    exc.retry_after,
                    rate_limit_retried,
                    jitter,
                    max_retries=agent.max_retries,
                    retry_base_ms=agent.retry_base_ms,
                    retry_cap_ms=agent.retry_cap_ms,
                    max_retry_after_ms=agent.rate_limit_same_model_max_retry_after_ms,
                    rate_limited=exc.kind == "rate_limited",
                )
                if delay is None:
                    raise
                # armed before it is recorded: the wait counts from the decision, and
                # whoever sees the record (a test moving a FakeClock) finds it armed
                backoff = _Backoff(delay, self._timer)
                try:
                    await self._emit(
                        stream,
                        PromptRetryScheduled(
                            call_id=exc.call_id or "",
                            attempt=attempt + 1,
                            delay_ms=round(delay * 1000),
                            reason=exc.kind,
                            agent=self._agent_name,
                            status=exc.status,
                            retry_after_s=exc.retry_after,
                            jitter=jitter,
                            rate_limited_before=rate_limit_retried,
                        ),
                    )
                    rate_limit_retried = rate_limit_retried or exc.kind == "rate_limited"
                    await backoff.wait()
                finally:
                    backoff.disarm()

    async def _attempt(
        self,
        stream: str,
        provider: str,
        model: str,
        request: ProviderRequest,
        attempt: int,
        kind: Literal["stall", "whole_call"],
        on_event: OnEvent | None,
        retry_of: str,
    ) -> ProviderResponse:
        """One attempt; ``retry_of``: the call id of the failed attempt it retries (its
        outcome stands for the call's from then on, as the provider stream records)."""
        seal = _SEAL.get()
        if seal is not None and not seal.may_begin(self._clock.now()):
            # its turn has ended, or its time is up: no request the turn no longer wants
            raise CallSealedError("the turn that made this model call has ended")
        breaker = self._breakers[provider]
        async with breaker.lock:
            await self._decide(breaker, self._clock.now())
            probe = breaker.admit()
        agent = self.agent
        timeout_ms = agent.prompt_timeout_ms if kind == "stall" else agent.retry_prompt_timeout_ms
        started = PromptStarted(
            call_id=new_id(),
            provider=provider,
            model=model,
            attempt=attempt,
            deadline_kind=kind,
            timeout_ms=timeout_ms,
            makespan_ms=timeout_ms * agent.stall_ceiling_multiplier if kind == "stall" else 0,
        )
        now = self._clock.now()
        # the deadline is armed before the attempt is recorded: whoever sees
        # ``prompt:started`` (a test moving a FakeClock) finds it armed
        live = _Live(started, now, anyio.CancelScope(), self._timer)
        live.arm(now)
        try:
            await self._emit(stream, started, now)
            if on_event is not None:
                on_event(started)
            response = await self._run(stream, live, request, on_event)
        except ProviderError as exc:
            exc.call_id = started.call_id
            await self._settle(stream, breaker, probe, started, now, exc, retry_of=retry_of)
            raise
        else:
            await self._settle(
                stream, breaker, probe, started, now, None, response, retry_of=retry_of
            )
            return response
        finally:
            live.disarm()
            # here only, once the attempt is over (a cancelled one included): the slot is
            # not freed while this attempt can still free it again under the next probe
            breaker.release(probe)

    async def _run(
        self, stream: str, live: _Live, request: ProviderRequest, on_event: OnEvent | None
    ) -> ProviderResponse:
        started = live.started
        client = self._clients[started.provider]
        accumulator = Accumulator(started.provider, started.model)
        response: ProviderResponse | None = None
        with live.scope:  # cancelled already if its deadline passed while it was recorded
            if self.agent.stream:
                # aclosing: an abort closes the response (and its socket) at once, not
                # whenever the abandoned generator happens to be finalized
                async with aclosing(client.stream(started.model, request)) as events:
                    async for event in events:
                        if isinstance(event, Done) and not live.finished(self._clock.now()):
                            continue  # it came after the limit: cut, as the decision says
                        accumulator.add(event)
                        if on_event is not None:
                            on_event(event)
                        await self._activity(stream, live, event)
            else:
                response = await client.complete(started.model, request)
        live.disarm()
        if live.complete:
            # whole before the limit, even when the limit passed as the client read the
            # few bytes after the final event (to give the connection back to the pool)
            return accumulator.response()
        if response is not None:
            return response
        # the scope's deadline passed: the pure decision says which limit, and when
        when, _, _ = next_deadline(live.window)
        at = max(self._clock.now(), when)
        timeout = decide_prompt_timeout(live.window, at)
        assert timeout is not None
        # a turn that has sealed the call recorded its end (and this limit, if it passed
        # first); the attempt still fails, so the provider's outcome counts (``_settle``)
        with contextlib.suppress(CallSealedError):
            await self._emit(stream, timeout, at)
        raise PromptTimeoutError(
            f"{started.provider}/{started.model}: aborted by the {timeout.limit} limit",
            limit=timeout.limit,
            provider=started.provider,
            model=started.model,
        )

    async def _activity(self, stream: str, live: _Live, event: StreamEvent) -> None:
        """Record activity at most once per interval; only recorded activity resets the budget."""
        kind = _ACTIVITY.get(type(event))
        if kind is None:
            return
        live.deltas += 1
        now = self._clock.now()
        if next_deadline(live.window)[0] <= now:
            # it came after the limit (the timer's cut may still be on its way): the
            # call is cut, not given a new budget that would make that cut stale
            live.scope.cancel()
            return
        if now - live.last_recorded < self.agent.activity_interval_ms / 1000:
            return
        live.last_recorded = now
        live.window = window_touched(live.window, now)
        live.arm(now)
        activity = PromptActivity(call_id=live.window.call_id, kind=kind, tokens=live.deltas)
        await self._emit(stream, activity, now)

    async def _settle(
        self,
        stream: str,
        breaker: Breaker,
        probe: bool,
        started: PromptStarted,
        started_at: float,
        error: ProviderError | None,
        response: ProviderResponse | None = None,
        *,
        retry_of: str = "",
    ) -> None:
        now = self._clock.now()
        provider, model = started.provider, started.model
        session_event: Event
        outcome: Event
        if error is None:
            assert response is not None
            session_event = PromptCompleted(
                call_id=started.call_id,
                input_tokens=response.input_tokens,
                output_tokens=response.output_tokens,
                finish_reason=response.finish_reason,
            )
            outcome = ProviderCallSucceeded(
                provider=provider,
                model=model,
                agent=self._agent_name,
                latency_ms=round((now - started_at) * 1000),
                retry_of=retry_of,
                probe=probe,
                started_at=started_at,  # one begun before an outage does not end it
            )
        else:
            session_event = PromptFailed(
                call_id=started.call_id,
                error_class=error.kind,
                status=error.status,
                retryable=error.retryable,
            )
            outcome = ProviderCallFailed(
                provider=provider,
                model=model,
                agent=self._agent_name,
                error_class=error.kind,
                status=error.status,
                call_id=started.call_id,
                retry_of=retry_of,
                probe=probe,
            )
            log.info("provider.call_failed", provider=provider, model=model, kind=error.kind)
        # two streams, appended together: the store's group commit makes them one fsync.
        # Either append's error is raised as itself, the session's first (the turn ended:
        # CallSealedError; its lease moved on: FencedError), never in an ExceptionGroup
        errors: list[Exception] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._provider_outcome, breaker, outcome, now, errors)
            try:
                await self._emit(stream, session_event, now)
            except Exception as exc:  # the provider's part still counts
                errors.insert(0, exc)
        if errors:
            raise errors[0]

    async def _provider_outcome(
        self, breaker: Breaker, outcome: Event, now: float, errors: list[Exception]
    ) -> None:
        # what the provider did is a fact of the provider's, whatever became of the turn:
        # recorded (and folded into the breaker) even when the call is cancelled or sealed
        with anyio.CancelScope(shield=True):
            try:
                async with breaker.lock:
                    await self._sink.emit(f"provider:{breaker.provider}", [outcome], now)
                    # the decisions only: the slot is freed when the attempt is over
                    await self._decide(breaker, now)
            except Exception as exc:
                errors.append(exc)

    async def _decide(self, breaker: Breaker, now: float) -> None:
        """Fold what the provider stream holds beyond the breaker's fold (this process's
        outcomes, and every other process's records), decide at ``now``, and record the
        decision expecting the version decided on. Another writer's record in between:
        fold it and decide again (it may have decided the same). The breaker is advisory:
        a stream that keeps moving for ``_DECIDE_TRIES`` tries is left to its writers."""
        stream = f"provider:{breaker.provider}"
        for _ in range(_DECIDE_TRIES):
            breaker.fold(await self._sink.read(stream, breaker.state.version + 1))
            events = breaker.due(now)
            if not events:
                return
            try:
                recorded = await self._sink.emit_expecting(
                    stream, events, now, breaker.state.version
                )
            except ConcurrencyError as exc:
                breaker.fold(await self._sink.read(stream, breaker.state.version + 1))
                breaker.passed_over(exc.actual)  # what is left up to it cannot be read
                continue
            breaker.fold(recorded)
            return

    async def _emit(self, stream: str, event: Event, ts: float | None = None) -> None:
        """Record one of the call's events in the caller's stream (while its turn lets it)."""
        at = self._clock.now() if ts is None else ts
        seal = _SEAL.get()
        if seal is None:
            await self._sink.emit(stream, [event], at)
            return
        seal.enter()
        try:
            await self._sink.emit(stream, [event], at)
        finally:
            seal.leave()
