"""What running a tool call came to, the text the model reads, and the event it makes.

The Agent appends the events; these helpers only build them, so the same outcome always
makes the same event.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from stalwart.events import ToolBlocked, ToolCall, ToolCompleted, ToolFailed, ToolStarted

from ._breaker import Action, blocked_text

Status = Literal["ok", "error", "timeout", "invalid_arguments", "blocked", "unknown_tool"]

#: What each error class means, in words the model can act on.
_DESCRIPTIONS: dict[str, str] = {
    "timeout": "it timed out",
    "connection": "it could not connect to what it uses",
    "rate_limited": "it was rate limited",
    "unavailable": "what it uses is unavailable",
    "permission_denied": "permission was denied",
    "unauthorized": "it is not authorized",
    "not_found": "what it looked for was not found",
    "not_supported": "the operation is not supported",
    "invalid_value": "it rejected a value of its arguments",
    "unencodable_result": "its result cannot be turned into text",
    "os_error": "an operating-system error occurred",
    "exception": "it raised an unexpected error",
}
_ADVICE: dict[Action, str] = {
    "retry": " Trying again may work.",
    "alternative": " Try different arguments or another tool.",
    "surface": "",
}


class ToolOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How one tool call ended.

    ``text`` is what the model reads: the result for ``ok``, otherwise one short, plain
    sentence (never a traceback, never an exception's raw text unless the tool raised a
    ``ToolError`` meant for the model). ``error_class`` and ``action`` come from the tool
    retry breaker's classification; ``blocked`` is the decision that blocked the call.
    """

    call_id: str
    tool: str
    status: Status
    text: str
    error_class: str | None = None
    action: Action | None = None
    elapsed_ms: int = 0
    blocked: ToolBlocked | None = None
    reconciled: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def error_text(tool: str, error_class: str, action: Action) -> str:
    """The static sentence for a tool that raised (no exception text in it)."""
    description = _DESCRIPTIONS.get(error_class, f"it failed ({error_class})")
    return f"The tool '{tool}' failed: {description}.{_ADVICE[action]}"


def timeout_text(tool: str, timeout_ms: int) -> str:
    return (
        f"The tool '{tool}' did not finish within its time limit of {timeout_ms / 1000:g} s "
        "and was stopped. Trying again may work; if it keeps timing out, try smaller "
        "inputs or another tool."
    )


def unreconciled_text(tool: str) -> str:
    """For a call a crash cut short whose ``reconcile`` check could not tell (it raised,
    or did not finish within the tool's limit) whether the effect happened."""
    return (
        f"The call to tool '{tool}' was interrupted by a restart and may or may not have "
        "taken effect; checking whether it did failed, so it was not run again. Check its "
        "effect before repeating it."
    )


def invalid_arguments_text(tool: str, reason: str) -> str:
    return (
        f"The arguments for tool '{tool}' are invalid: {reason}. "
        "Call it again with arguments that match its parameters schema."
    )


def unknown_tool_text(name: str, available: tuple[str, ...]) -> str:
    shown = name if len(name) <= 64 else f"{name[:64]}..."
    listed = ", ".join(available) if available else "none"
    return f"There is no tool named '{shown}'. The available tools are: {listed}."


def bounded_text(text: str, limit: int | None, *, error: bool = False) -> str:
    """``text`` if its UTF-8 form is at most ``limit`` bytes (or there is no limit), else
    its start within them, ended on a line break when one ends the second half, and a
    marker saying how much was cut; for a result (not an ``error`` message) it also says
    how the model may read the rest."""
    kept = cut_start(text, limit)
    return text if kept is None else kept + _cut_marker(text, kept, limit or 0, error)


def cut_start(text: str, limit: int | None) -> str | None:
    """None if ``text``'s UTF-8 form is at most ``limit`` bytes (or there is no limit),
    else its start within them, ended on a line break when one ends the second half (and
    never on half a character)."""
    if limit is None or len(text) <= limit // 4:  # no character takes more than 4 bytes
        return None
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return None
    kept = data[:limit].decode("utf-8", "ignore")  # not half a character at the end
    line_end = kept.rfind("\n")
    if line_end >= len(kept) // 2:
        kept = kept[: line_end + 1]
    return kept


def _cut_marker(text: str, kept: str, limit: int, error: bool) -> str:
    """What the model reads after a cut text: how much it is, how much is shown."""
    shown = f"{len(kept):,} of its {len(text):,} characters"
    lines, kept_lines = text.count("\n") + (not text.endswith("\n")), kept.count("\n")
    if lines > 1:
        shown += f" ({kept_lines:,} of its {lines:,} lines)"
    what = "message" if error else "result"
    marker = (
        f"\n[stalwart: the tool's {what} is longer than its limit of {limit:,} bytes: "
        f"only the first {shown} are shown."
    )
    if error:
        return marker + "]"
    return (
        f"{marker} Call the tool again with arguments that narrow it (a filter, a range, "
        "a page) to read the rest.]"
    )


def blocked_outcome(call: ToolCall, event: ToolBlocked) -> ToolOutcome:
    """The outcome of a call the tool retry breaker blocked (``event`` is its decision)."""
    return ToolOutcome(
        call_id=call.id,
        tool=call.name,
        status="blocked",
        text=blocked_text(event),
        error_class="blocked",
        action="alternative",
        blocked=event,
    )


def started_event(
    call: ToolCall, *, turn_id: str | None = None, idempotency_key: str | None = None
) -> ToolStarted:
    """``tool:started`` for a call about to run."""
    return ToolStarted(
        call_id=call.id,
        tool=call.name,
        arguments=call.arguments,
        idempotency_key=idempotency_key,
        turn_id=turn_id,
    )


def outcome_event(outcome: ToolOutcome) -> ToolCompleted | ToolFailed | ToolBlocked:
    """The event that records ``outcome``: completed, failed, or the blocking decision."""
    if outcome.status == "ok":
        return ToolCompleted(
            call_id=outcome.call_id,
            tool=outcome.tool,
            output=outcome.text,
            duration_ms=outcome.elapsed_ms,
            reconciled=outcome.reconciled,
        )
    if outcome.status == "blocked":
        if outcome.blocked is None:
            raise ValueError(f"blocked outcome of call {outcome.call_id!r} has no decision")
        return outcome.blocked
    return ToolFailed(
        call_id=outcome.call_id,
        tool=outcome.tool,
        error_class=outcome.error_class or outcome.status,
        retryable=outcome.action == "retry",
        timed_out=outcome.status == "timeout",
    )
