"""The tool retry breaker: error classes, a fold over a session's tool events, a decision.

Three rules block a call before it runs (thresholds are ``>=``; 0 turns a rule off):

- ``same_call``: the same tool with the same arguments (compared canonically: key order
  does not matter, at any depth) failed 3 times in a row;
- ``error_pattern``: the tool failed 2 times with an error that says the tool itself is
  out of reach (``permission_denied``, ``unauthorized``, ``not_supported``);
- ``same_tool``: the tool failed 5 times with no success in between.

A success of a call resets its same-call count; a success of a tool resets its tool and
pattern counts. Errors that are the model's own mistake (``invalid_arguments``,
``unknown_tool``) never count: the model is told what was wrong and may correct it.
Everything here is pure: the state is a fold of recorded events, so replay re-derives
every ``tool:blocked`` from the log.
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Iterable
from typing import Literal, TypeVar

import msgspec

from stalwart.errors import ToolError
from stalwart.events import (
    Event,
    RecordedEvent,
    ToolBlocked,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
)

Action = Literal["retry", "alternative", "surface"]
V = TypeVar("V")

#: What each known error class suggests: try the same call again, try different
#: arguments or another tool, or hand the error to the model as it is.
ACTIONS: dict[str, Action] = {
    "timeout": "retry",
    "connection": "retry",
    "rate_limited": "retry",
    "unavailable": "retry",
    "permission_denied": "alternative",
    "unauthorized": "alternative",
    "not_found": "alternative",
    "not_supported": "alternative",
    "invalid_arguments": "surface",
    "unknown_tool": "surface",
    "invalid_value": "surface",
    "unencodable_result": "surface",
    "os_error": "surface",
    "tool_error": "surface",
    "exception": "surface",
    "exited": "surface",
    "cancelled": "surface",
}
#: Never counted toward a block: the model's own mistakes (surfaced with a clear
#: message), and calls the tool did not fail because they were not run: a user's denial,
#: a call a crash cut short, one an interrupt closed, one that needed a human nobody
#: could ask.
NEVER_BLOCK = frozenset(
    {"invalid_arguments", "unknown_tool", "denied", "unreconciled", "interrupted", "needs_human"}
)
#: Errors that say the tool itself is out of reach, whatever the arguments.
PATTERNS = frozenset({"permission_denied", "unauthorized", "not_supported"})

_ERRNO: dict[int, str] = {
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.ENOENT: "not_found",
    errno.ETIMEDOUT: "timeout",
    errno.ECONNREFUSED: "connection",
    errno.ECONNRESET: "connection",
    errno.EHOSTUNREACH: "connection",
    errno.ENETUNREACH: "connection",
}
#: Lower-cased words in an exception's class names (its MRO) and the class they mean,
#: for libraries stalwart does not import (``httpx.ConnectTimeout``, ``requests.ConnectionError``).
_NAMES: tuple[tuple[str, str], ...] = (
    ("timeout", "timeout"),
    ("ratelimit", "rate_limited"),
    ("connect", "connection"),
    ("permission", "permission_denied"),
    ("forbidden", "permission_denied"),
    ("accessdenied", "permission_denied"),
    ("unauthorized", "unauthorized"),
    ("authentication", "unauthorized"),
    ("notfound", "not_found"),
)


def action_for(error_class: str, retryable: bool = False) -> Action:
    """The action of an error class (an unknown one: ``retry`` if retryable, else ``surface``)."""
    return ACTIONS.get(error_class, "retry" if retryable else "surface")


def classify_tool_error(exc: BaseException) -> tuple[str, Action]:
    """The error class and action of an exception a tool raised."""
    if isinstance(exc, ToolError):
        named = _named_by_host(exc.error_class)
        return named, action_for(named, exc.retryable)
    error_class = _builtin_class(exc) or _named_class(exc)
    if error_class is None:
        if isinstance(exc, ValueError):
            error_class = "invalid_value"
        elif isinstance(exc, OSError):
            error_class = "os_error"
        else:
            error_class = "exception"
    return error_class, action_for(error_class)


def _named_by_host(error_class: object) -> str:
    """A ``ToolError``'s ``error_class`` as the text an event can hold: a host may pass
    what its own API gave (``HTTPStatus.NOT_FOUND``, ``404``), which a ``tool:failed``
    would record but never read back."""
    if isinstance(error_class, enum.Enum):
        error_class = error_class.value
    if error_class is None or error_class == "":
        return "tool_error"
    return error_class if type(error_class) is str else str(error_class)


def _builtin_class(exc: BaseException) -> str | None:
    match exc:
        case TimeoutError():
            return "timeout"
        case ConnectionError():
            return "connection"
        case PermissionError():
            return "permission_denied"
        case FileNotFoundError() | NotADirectoryError():
            return "not_found"
        case NotImplementedError():
            return "not_supported"
        case SystemExit():
            return "exited"
        case OSError() if exc.errno in _ERRNO:
            return _ERRNO[exc.errno]
        case _:
            return None


def _named_class(exc: BaseException) -> str | None:
    names = [klass.__name__.lower() for klass in type(exc).__mro__]
    for word, error_class in _NAMES:
        if any(word in name for name in names):
            return error_class
    return None


def canonical_arguments(text: str) -> str:
    """``text`` as JSON with keys sorted at every depth and no spaces.

    Empty text is ``{}`` (what a call with no arguments means); text that is not JSON (or
    is nested deeper than Python can follow) is returned verbatim, so two identical
    malformed calls still compare equal.
    """
    if not text.strip():
        return "{}"
    try:
        value = msgspec.json.decode(text)
        return msgspec.json.encode(value, order="sorted").decode()
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deeply
        return text


class PendingCall(msgspec.Struct, frozen=True):
    tool: str
    arguments: str


class ToolBreakerState(msgspec.Struct, frozen=True, kw_only=True):
    """Failure counts of one session's tools. Only non-zero counts are kept.

    ``same_call`` is tool -> canonical arguments -> consecutive failures; ``per_tool``
    tool -> failures since its last success; ``patterns`` tool -> error class -> failures
    since its last success; ``pending`` the started calls not yet finished, by call id.
    """

    pending: dict[str, PendingCall] = msgspec.field(default_factory=dict)
    same_call: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    per_tool: dict[str, int] = msgspec.field(default_factory=dict)
    patterns: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)


def apply_tool_breaker(state: ToolBreakerState, item: Event | RecordedEvent) -> ToolBreakerState:
    """The breaker after one more event (any other event leaves it as it is)."""
    event = item.event if isinstance(item, RecordedEvent) else item
    replace = msgspec.structs.replace
    match event:
        case ToolStarted():
            started = PendingCall(event.tool, canonical_arguments(event.arguments))
            return replace(state, pending={**state.pending, event.call_id: started})
        case ToolCompleted():
            pending, call = _finish(state, event.call_id)
            same = state.same_call
            if call is not None and call.tool == event.tool:
                same = _nested(same, event.tool, call.arguments, 0)
            return ToolBreakerState(
                pending=pending,
                same_call=same,
                per_tool=_without(state.per_tool, event.tool),
                patterns=_without(state.patterns, event.tool),
            )
        case ToolFailed():
            pending, call = _finish(state, event.call_id)
            if event.error_class in NEVER_BLOCK:
                return replace(state, pending=pending)
            tool = event.tool
            same = state.same_call
            if call is not None and call.tool == tool:
                same = _nested(same, tool, call.arguments, _count(same, tool, call.arguments) + 1)
            patterns = state.patterns
            if event.error_class in PATTERNS:
                count = _count(patterns, tool, event.error_class) + 1
                patterns = _nested(patterns, tool, event.error_class, count)
            return ToolBreakerState(
                pending=pending,
                same_call=same,
                per_tool={**state.per_tool, tool: state.per_tool.get(tool, 0) + 1},
                patterns=patterns,
            )
        case ToolBlocked():
            return replace(state, pending=_finish(state, event.call_id)[0])
        case _:
            return state


def fold_tool_breaker(
    events: Iterable[Event | RecordedEvent], state: ToolBreakerState | None = None
) -> ToolBreakerState:
    """``state`` (empty by default) after each event in turn."""
    current = ToolBreakerState() if state is None else state
    for item in events:
        current = apply_tool_breaker(current, item)
    return current


def _finish(
    state: ToolBreakerState, call_id: str
) -> tuple[dict[str, PendingCall], PendingCall | None]:
    call = state.pending.get(call_id)
    if call is None:
        return state.pending, None
    return _without(state.pending, call_id), call


def _without(mapping: dict[str, V], key: str) -> dict[str, V]:
    return {k: v for k, v in mapping.items() if k != key} if key in mapping else mapping


def _count(mapping: dict[str, dict[str, int]], outer: str, inner: str) -> int:
    return mapping.get(outer, {}).get(inner, 0)


def _nested(
    mapping: dict[str, dict[str, int]], outer: str, inner: str, count: int
) -> dict[str, dict[str, int]]:
    """``mapping`` with ``[outer][inner] = count``; a zero count removes the entry."""
    current = mapping.get(outer, {})
    if count:
        updated = {**current, inner: count}
    elif inner in current:
        updated = {k: v for k, v in current.items() if k != inner}
    else:
        return mapping
    if updated:
        return {**mapping, outer: updated}
    return {k: v for k, v in mapping.items() if k != outer}


def decide_tool_call(
    state: ToolBreakerState,
    tool: str,
    arguments: str,
    *,
    call_id: str = "",
    same_call: int = 3,
    per_tool: int = 5,
    per_pattern: int = 2,
) -> ToolBlocked | None:
    """``tool:blocked`` if a new call of ``tool`` with ``arguments`` must not run, else None.

    The rules are checked from the most specific: same call, error pattern, same tool.
    """
    canonical = canonical_arguments(arguments)
    failures = _count(state.same_call, tool, canonical)
    if 0 < same_call <= failures:
        return ToolBlocked(
            call_id=call_id,
            tool=tool,
            rule="same_call",
            failures=failures,
            threshold=same_call,
            arguments=canonical,
        )
    for pattern, failures in sorted(state.patterns.get(tool, {}).items()):
        if 0 < per_pattern <= failures:
            return ToolBlocked(
                call_id=call_id,
                tool=tool,
                rule="error_pattern",
                failures=failures,
                threshold=per_pattern,
                arguments=canonical,
                pattern=pattern,
            )
    failures = state.per_tool.get(tool, 0)
    if 0 < per_tool <= failures:
        return ToolBlocked(
            call_id=call_id,
            tool=tool,
            rule="same_tool",
            failures=failures,
            threshold=per_tool,
            arguments=canonical,
        )
    return None


def blocked_text(event: ToolBlocked) -> str:
    """What the model reads for a blocked call: which rule, the counts, what may help."""
    head = f"The call to tool '{event.tool}' was blocked and not run:"
    limit = f"(the limit is {event.threshold})"
    if event.rule == "same_call":
        return (
            f"{head} it failed {event.failures} times in a row with these same arguments "
            f"{limit}. Repeating it will not help; try different arguments or another tool."
        )
    if event.rule == "error_pattern":
        error = (event.pattern or "error").replace("_", " ")
        return (
            f"{head} it failed {event.failures} times with the same error, {error} {limit}. "
            "Try different arguments or another tool, or tell the user what is missing."
        )
    return (
        f"{head} the tool failed {event.failures} times with no success in between "
        f"{limit}. Try another tool or a different approach."
    )
