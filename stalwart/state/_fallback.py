"""The model chain: which model a call tries after one failed, and when the chain is spent.

The chain is the agent's ``provider:model`` then its ``fallback_models`` (a request that
needs vision uses ``vision_fallback_models`` when there are any). After the chain's entry
``failed`` gave up (its last error's kind ``reason``), the next entry is tried
(``model:fallback_attempt``), or, after the last, the call fails
(``model:fallback_exhausted``). A prompt longer than the window falls back to nothing: no
other model is asked, the context engine must shrink it.

:data:`FAILED_CALLS` folds a session's failed calls (their model and error class), so
replay can read the failure a fallback names by its ``call_id``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from stalwart.events import (
    Event,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    PromptFailed,
    PromptStarted,
    RecordedEvent,
    TurnCompleted,
    UserInterrupt,
)

from ._aggregate import FolderAggregate

#: the error kind of a prompt that does not fit the model's window: no fallback helps
CONTEXT_OVERFLOW = "context_overflow"
#: how many failed calls the fold keeps (a fallback follows its failure at once)
KEPT_FAILURES = 16


def model_chain(
    provider: str,
    model: str,
    fallback_models: Sequence[str],
    vision_fallback_models: Sequence[str] = (),
    *,
    vision: bool = False,
) -> tuple[str, ...]:
    """The ``provider:model`` entries a call tries, in order."""
    fallbacks = (vision_fallback_models if vision else ()) or fallback_models
    return (f"{provider}:{model}", *fallbacks)


def decide_fallback(
    chain: Sequence[str],
    failed: int,
    reason: str,
    *,
    agent: str,
    vision: bool,
    call_id: str | None,
) -> ModelFallbackAttempt | ModelFallbackExhausted | None:
    """What follows the failure of ``chain[failed]`` with ``reason``: the next model, the
    chain spent, or None (a context overflow, or an entry the chain does not have)."""
    if reason == CONTEXT_OVERFLOW or not 0 <= failed < len(chain):
        return None
    if failed + 1 < len(chain):
        return ModelFallbackAttempt(
            from_model=chain[failed],
            to_model=chain[failed + 1],
            attempt=failed + 1,
            reason=reason,
            agent=agent,
            vision=vision,
            call_id=call_id,
        )
    return ModelFallbackExhausted(
        models=tuple(chain), reason=reason, agent=agent, vision=vision, call_id=call_id
    )


class FailedCall(msgspec.Struct, frozen=True, gc=False):
    """A call that ended with ``prompt:failed``: its ``provider:model`` and error class."""

    model: str
    error_class: str


class FailedCallsState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A session's open calls (call id -> ``provider:model``) and its latest failures."""

    open: dict[str, str] = msgspec.field(default_factory=dict)
    failed: dict[str, FailedCall] = msgspec.field(default_factory=dict)


_MOVES: frozenset[type[Event]] = frozenset(
    {PromptStarted, PromptFailed, TurnCompleted, UserInterrupt}
)


class FailedCallsFolder:
    """The fold of :class:`FailedCallsState`; other events cost one lookup."""

    __slots__ = ("_failed", "_open", "_state")

    def __init__(self, state: FailedCallsState) -> None:
        self._open = dict(state.open)
        self._failed = dict(state.failed)
        self._state: FailedCallsState | None = state

    def add(self, record: RecordedEvent) -> None:
        event = record.event
        if type(event) not in _MOVES:
            return
        self._state = None
        match event:
            case PromptStarted():
                self._open[event.call_id] = f"{event.provider}:{event.model}"
            case PromptFailed():
                model = self._open.pop(event.call_id, None)
                if model is not None:
                    self._failed[event.call_id] = FailedCall(model, event.error_class)
                    if len(self._failed) > KEPT_FAILURES:
                        del self._failed[next(iter(self._failed))]
            case _:  # a turn's end cancels its calls: no prompt event ends them
                self._open.clear()

    def state(self) -> FailedCallsState:
        if self._state is None:
            self._state = FailedCallsState(open=dict(self._open), failed=dict(self._failed))
        return self._state


#: :class:`FailedCallsState` over a session stream
FAILED_CALLS = FolderAggregate("failed_calls", FailedCallsState, FailedCallsFolder, moves=_MOVES)
