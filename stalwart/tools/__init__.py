"""Tools an agent may call: a registry, validated and bounded execution, a retry breaker.

A host registers Python callables (sync or async) with a JSON schema derived from their
type hints, or given; :func:`run_tool` / :func:`run_tools` run what a model asked for,
each call under its own timeout, and say how every call ended as a :class:`ToolOutcome`.
The tool retry breaker (:func:`decide_tool_call` over :func:`fold_tool_breaker`) blocks
calls that keep failing. Nothing here appends events: the helpers build them for the
Agent, which records them.
"""

from stalwart.clock import Timer
from stalwart.events import ToolSpec

from ._breaker import (
    ACTIONS,
    NEVER_BLOCK,
    PATTERNS,
    Action,
    PendingCall,
    ToolBreakerState,
    action_for,
    apply_tool_breaker,
    blocked_text,
    canonical_arguments,
    classify_tool_error,
    decide_tool_call,
    fold_tool_breaker,
)
from ._context import CallContext, current_call
from ._outcome import (
    Status,
    ToolOutcome,
    blocked_outcome,
    bounded_text,
    cut_start,
    outcome_event,
    started_event,
)
from ._registry import (
    DEFAULT_MAX_RESULT_BYTES,
    DEFAULT_TIMEOUT_MS,
    NAME_PATTERN,
    Tool,
    ToolRegistry,
    build_tool,
)
from ._run import parse_arguments, result_text, run_tool, run_tools

__all__ = [
    "ACTIONS",
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_TIMEOUT_MS",
    "NAME_PATTERN",
    "NEVER_BLOCK",
    "PATTERNS",
    "Action",
    "CallContext",
    "PendingCall",
    "Status",
    "Timer",
    "Tool",
    "ToolBreakerState",
    "ToolOutcome",
    "ToolRegistry",
    "ToolSpec",
    "action_for",
    "apply_tool_breaker",
    "blocked_outcome",
    "blocked_text",
    "bounded_text",
    "build_tool",
    "canonical_arguments",
    "classify_tool_error",
    "current_call",
    "cut_start",
    "decide_tool_call",
    "fold_tool_breaker",
    "outcome_event",
    "parse_arguments",
    "result_text",
    "run_tool",
    "run_tools",
    "started_event",
]
