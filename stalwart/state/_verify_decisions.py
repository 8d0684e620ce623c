"""Verifiers of the model chain, a failure notice's fallback and a session's pauses.

===========================  =====================  =====================================
decision                     fold (stream)          decide (knobs; recorded inputs)
===========================  =====================  =====================================
model:fallback_attempt,      FAILED_CALLS           decide_fallback (agents.<agent>.
model:fallback_exhausted     (session:)             provider, model, fallback_models,
                                                    vision_fallback_models; the recorded
                                                    agent, vision and failed call_id)
announcement:fallback_direct NOTICES (session:)     notice_outcome (dead_letters.
                                                    announce_timeout_ms; the recorded
                                                    error_class and retry_after_ms of
                                                    the announce send)
session:requires_action      PAUSES (session:)      decide_pause (the tool's registration
                                                    as the request's kind records it)
===========================  =====================  =====================================

What each takes from the record rather than the fold, and why:

* a fallback's failure is read from the fold by its ``call_id`` (the call's model and
  error class); a model the breaker refused never started a call in the session (the
  refusal is the breaker's decision, in ``provider:<name>``), so there the failure's
  kind is taken as recorded. Which chain (the request needed vision or not) is recorded.
* a notice's announce send is the only send whose failure falls back: which send failed
  is what the tag records, and what its receiver asked with the failure (its
  Retry-After) is the receiver's, outside the log; that the notice was queued and not
  sent yet, the rule and the timeout knob are re-derived.
* whether a tool needs a human is its registration in host code, outside the log: the
  request's ``kind`` records it. The call (name and arguments verbatim), that it has no
  result and no answer yet, and the running turn are re-derived.

Records written before their inputs were (a fallback without ``agent``, a fallback_direct
without ``error_class``, a request without ``call_id``) are not checked.
"""

from __future__ import annotations

from typing import Any

import msgspec

from stalwart.events import (
    AnnouncementFallbackDirect,
    Event,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    RecordedEvent,
    SessionRequiresAction,
)

from ._fallback import FAILED_CALLS, FailedCallsState, decide_fallback, model_chain
from ._notice import NOTICES, Notice, notice_outcome
from ._pause import PAUSES, PauseState, decide_pause
from ._verify_registry import Knobs, Verifier

Fallback = ModelFallbackAttempt | ModelFallbackExhausted

# -- the model chain ----------------------------------------------------------------------


def _chain(event: Fallback, knobs: Knobs) -> tuple[str, ...]:
    """The chain the decision walked, reading only the lists it takes: the vision chain's
    for a request that needed vision, the plain one's unless the vision chain has its own
    (a list it does not take is not read, whatever the config records there)."""
    agent = ("agents", event.agent or "")
    vision = knobs.get_names((*agent, "vision_fallback_models")) if event.vision else ()
    plain = () if vision else knobs.get_names((*agent, "fallback_models"))
    return model_chain(
        knobs.get_text((*agent, "provider")),
        knobs.get_text((*agent, "model")),
        plain,
        vision,
        vision=event.vision,
    )


def _failed_at(event: Fallback, chain: tuple[str, ...], model: str | None) -> int:
    """The chain entry that failed: the attempt's previous one; for an exhausted chain its
    last, or (the failed call's model being another) where that model is."""
    if isinstance(event, ModelFallbackAttempt):
        return event.attempt - 1
    if model is None or (chain and chain[-1] == model) or model not in chain:
        return len(chain) - 1
    return chain.index(model)


def _fallback(state: FailedCallsState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, ModelFallbackAttempt | ModelFallbackExhausted)
    assert found.agent is not None
    chain = _chain(found, knobs)
    reason, model = found.reason, None
    if found.call_id is not None:  # the failure, as its call ended in this stream
        call = state.failed.get(found.call_id)
        if call is None:
            return []
        reason, model = call.error_class, call.model
    failed = _failed_at(found, chain, model)
    if model is not None and not (0 <= failed < len(chain) and chain[failed] == model):
        return []  # the failed call was of another model than the one the chain left
    decided = decide_fallback(
        chain, failed, reason, agent=found.agent, vision=found.vision, call_id=found.call_id
    )
    return [] if decided is None else [decided]


def _fallback_why(state: FailedCallsState, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, ModelFallbackAttempt | ModelFallbackExhausted)
    chain = " -> ".join(_chain(found, knobs))
    which = "vision chain" if found.vision else "chain"
    said = f"the {which} of agents.{found.agent} is {chain}"
    if found.call_id is None:
        return f"{said}; the breaker refused the model before any call"
    call = state.failed.get(found.call_id)
    if call is None:
        return f"{said}; no call {found.call_id!r} failed in this stream"
    return f"{said}; call {found.call_id!r} of {call.model} failed with {call.error_class}"


def _fallback_inputs(event: Event) -> bool:
    """A fallback recorded with its decision's inputs (older records have no agent)."""
    return isinstance(event, ModelFallbackAttempt | ModelFallbackExhausted) and (
        event.agent is not None
    )


# -- a failure notice's fallback to a direct send -----------------------------------------


def _direct(state: Notice, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, AnnouncementFallbackDirect)
    if state.announcement_id != found.announcement_id or state.stage != "queued":
        return []  # only a queued notice's announce send falls back
    timeout_ms = knobs.get_int("dead_letters.announce_timeout_ms")
    decided = notice_outcome(
        found.announcement_id, "announce", found.error_class, timeout_ms=timeout_ms
    )
    if isinstance(decided, AnnouncementFallbackDirect):  # the receiver's hint, as recorded
        decided = msgspec.structs.replace(decided, retry_after_ms=found.retry_after_ms)
    return [decided]


def _direct_why(state: Notice, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, AnnouncementFallbackDirect)
    if state.announcement_id != found.announcement_id:
        latest = state.announcement_id or "none"
        return f"the stream's failure notice is {latest!r}, not {found.announcement_id!r}"
    if state.stage != "queued":
        return f"the notice is {state.stage}: its announce send is behind it"
    timeout_ms = knobs.get_int("dead_letters.announce_timeout_ms")
    return f"the announce send is bounded by dead_letters.announce_timeout_ms ({timeout_ms})"


def _direct_inputs(event: Event) -> bool:
    """A fallback_direct recorded with the announce send's failure (older ones have none)."""
    return isinstance(event, AnnouncementFallbackDirect) and event.error_class is not None


# -- a session stopped for a human --------------------------------------------------------


def _pause(state: PauseState, record: RecordedEvent, knobs: Knobs) -> list[Event]:
    found = record.event
    assert isinstance(found, SessionRequiresAction)
    assert found.call_id is not None
    call = state.unanswered(found.call_id)
    if call is None:
        return []
    # the tool's registration (custom, needs_confirmation) is host code: the kind says it
    answered = found.call_id in state.answered
    decided = decide_pause(call, found.kind, answered=answered, turn_id=state.turn_id)
    return [] if decided is None else [decided]


def _pause_why(state: PauseState, record: RecordedEvent, knobs: Knobs) -> str:
    found = record.event
    assert isinstance(found, SessionRequiresAction)
    call = state.unanswered(found.call_id or "")
    if call is None:
        return f"the last assistant message has no unanswered call {found.call_id!r}"
    if found.call_id in state.answered:
        return f"call {found.call_id!r} was answered already"
    return (
        f"the model called {call.name} with {call.arguments} in turn {state.turn_id!r}; "
        f"the request names {found.tool} with {found.arguments} in turn {found.turn_id!r}"
    )


def _pause_inputs(event: Event) -> bool:
    """A request naming its call (older ones have no call_id: nothing to re-derive from)."""
    return isinstance(event, SessionRequiresAction) and event.call_id is not None


_SESSIONS = "session:"
DECISION_RULES: tuple[Verifier[Any], ...] = (
    Verifier(
        "model:fallback_attempt",
        FAILED_CALLS,
        _fallback,
        _SESSIONS,
        why=_fallback_why,
        when=_fallback_inputs,
    ),
    Verifier(
        "model:fallback_exhausted",
        FAILED_CALLS,
        _fallback,
        _SESSIONS,
        why=_fallback_why,
        when=_fallback_inputs,
    ),
    Verifier(
        "announcement:fallback_direct",
        NOTICES,
        _direct,
        _SESSIONS,
        why=_direct_why,
        when=_direct_inputs,
    ),
    Verifier(
        "session:requires_action",
        PAUSES,
        _pause,
        _SESSIONS,
        ignore=("request_id",),
        why=_pause_why,
        when=_pause_inputs,
    ),
)
