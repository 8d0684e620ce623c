"""Provider-call events inside a session (stream ``session:<id>``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from ._base import Event, Severity

TimeoutLimit = Literal["stall", "makespan", "retry_deadline"]


class PromptStarted(Event, frozen=True, tag="prompt:started"):
    call_id: str
    provider: str
    model: str
    attempt: int = 1
    deadline_kind: Literal["stall", "whole_call"] = "stall"
    timeout_ms: int = 0
    makespan_ms: int = 0
    turn_id: str | None = None


class PromptActivity(Event, frozen=True, tag="prompt:activity"):
    """Throttled evidence that a call is alive (text, thinking or a tool completion).

    ``tokens`` counts the deltas received so far in the call, a cheap token estimate that
    shows whether output is still growing.
    """

    call_id: str
    kind: Literal["text", "thinking", "tool_call", "tool_result"] = "text"
    tokens: int = 0
    severity: ClassVar[Severity] = "debug"


class PromptCompleted(Event, frozen=True, tag="prompt:completed"):
    call_id: str
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = "stop"


class PromptFailed(Event, frozen=True, tag="prompt:failed"):
    call_id: str
    error_class: str
    status: int | None = None
    retryable: bool = False
    severity: ClassVar[Severity] = "warning"


class PromptTimeout(Event, frozen=True, tag="execution:prompt_timeout"):
    """A call aborted by its deadline: which limit, the knob that bound it, the elapsed time."""

    call_id: str
    limit: TimeoutLimit
    knob: str
    limit_ms: int
    elapsed_ms: int
    severity: ClassVar[Severity] = "warning"


class PromptRetryScheduled(Event, frozen=True, tag="prompt:retry_scheduled"):
    """The same model is tried again (``attempt``) after ``delay_ms``. The decision's
    inputs ride along so replay can re-derive it: the ``agent`` whose knobs decided, the
    failure's HTTP ``status`` and ``Retry-After`` (seconds), the backoff's uniform draw
    (``jitter``, in [0, 1)), and whether a 429 was already retried on this model in this
    call. Records written before these were recorded have them None (not re-derived)."""

    call_id: str
    attempt: int
    delay_ms: int
    reason: str
    agent: str | None = None
    status: int | None = None
    retry_after_s: float | None = None
    jitter: float | None = None
    rate_limited_before: bool = False


class ModelFallbackAttempt(Event, frozen=True, tag="model:fallback_attempt"):
    """``from_model`` (``provider:model``, the chain's entry ``attempt - 1``) failed with
    ``reason`` (its last error's kind): the chain moves on to ``to_model``. The decision's
    inputs ride along so replay can re-derive it: the ``agent`` whose chain it is, whether
    the request needed ``vision`` (which chain), and the ``call_id`` of the failed call
    (None when the breaker refused the model before any call). Records written before
    these were recorded have ``agent`` None (not re-derived)."""

    from_model: str
    to_model: str
    attempt: int
    reason: str
    agent: str | None = None
    vision: bool = False
    call_id: str | None = None
    severity: ClassVar[Severity] = "warning"


class ModelFallbackExhausted(Event, frozen=True, tag="model:fallback_exhausted"):
    """Every model of the chain (``models``, in order) failed; the last with ``reason``.
    ``agent``, ``vision`` and ``call_id`` as on ``model:fallback_attempt``."""

    models: tuple[str, ...]
    reason: str
    agent: str | None = None
    vision: bool = False
    call_id: str | None = None
    severity: ClassVar[Severity] = "error"


class ExecutionAborted(Event, frozen=True, tag="execution:aborted"):
    reason: Literal["pipeline_timeout", "interrupted", "provider_degraded", "failed"]
    turn_id: str | None = None
    limit_ms: int = 0
    elapsed_ms: int = 0
    severity: ClassVar[Severity] = "error"
