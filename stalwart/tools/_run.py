"""Running the calls a model asked for: validated, each under its own timeout, bounded.

Sync tools run in a worker thread; async ones are awaited on the caller's event loop.
A tool's timeout is a cancel scope: an async tool is cancelled, a sync one is abandoned
(Python cannot stop a thread; it finishes in the background and its result is dropped),
and either way the call is reported as ``timeout`` at once. Nothing a tool does is raised
at the caller: every call ends as a :class:`ToolOutcome`. Cancellation from outside (the
caller's own deadline) is not an outcome: it propagates.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from stalwart._aio import cut_after
from stalwart._text import scrub_surrogates
from stalwart.clock import Clock, SystemClock, Timer
from stalwart.errors import ToolError
from stalwart.events import ToolCall

from ._breaker import action_for, classify_tool_error
from ._context import CallContext, bind, unbind
from ._outcome import (
    Status,
    ToolOutcome,
    error_text,
    invalid_arguments_text,
    timeout_text,
    unknown_tool_text,
)
from ._registry import Tool, ToolRegistry

_SYSTEM_CLOCK = SystemClock()


def parse_arguments(tool: Tool, text: str) -> dict[str, Any] | str:
    """The keyword arguments for ``tool`` from a call's JSON text, or why they are invalid."""
    try:
        value = msgspec.json.decode(text if text.strip() else "{}")
    except msgspec.DecodeError as exc:
        return f"they are not valid JSON ({exc})"
    except RecursionError:
        return "they are nested too deeply"
    if not isinstance(value, dict):
        return f"they must be a JSON object, not {type(value).__name__}"
    try:
        parsed = msgspec.convert(value, tool.arguments)
    except msgspec.ValidationError as exc:
        return str(exc)
    kwargs = {name: getattr(parsed, name) for name in tool.arguments.__struct_fields__}
    if not tool.extra_keywords:
        return kwargs
    for key, item in value.items():  # the ones **kwargs takes, converted to its hint
        if key not in kwargs:
            try:
                kwargs[key] = msgspec.convert(item, tool.extra_type)
            except msgspec.ValidationError as exc:
                return _at(str(exc), key)
    return kwargs


def _at(message: str, key: str) -> str:
    """msgspec's ``message`` about one argument's value, with the path it is at."""
    head, marker, path = message.rpartition(" - at `$")  # msgspec puts the path last
    if marker:  # somewhere inside the value
        return f"{head}{marker}.{key}{path}"
    return f"{message} - at `$.{key}`"


def result_text(result: Any) -> str:
    """A tool's result as text: a str as it is, anything else as JSON; made valid Unicode
    (the lone surrogates of a file name that is not UTF-8 could not be recorded)."""
    if isinstance(result, str):
        return scrub_surrogates(result)
    try:
        return msgspec.json.encode(result).decode()
    except UnicodeEncodeError:  # a str somewhere inside: scrub them all, then encode
        return msgspec.json.encode(_scrubbed(msgspec.to_builtins(result))).decode()


def _scrubbed(value: Any) -> Any:
    """``value`` (builtins only) with every str in it, dict keys too, made valid Unicode."""
    if isinstance(value, str):
        return scrub_surrogates(value)
    if isinstance(value, dict):
        return {_scrubbed(key): _scrubbed(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_scrubbed(item) for item in value]
    return value


async def _invoke(
    fn: Callable[..., Any],
    is_async: bool,
    kwargs: dict[str, Any],
    limiter: anyio.CapacityLimiter | None,
    context: CallContext | None,
) -> Any:
    token = bind(context)
    try:
        if is_async:
            return await fn(**kwargs)
        # the worker thread runs in a copy of this context: current_call() works there too
        run = functools.partial(contextvars.copy_context().run, fn, **kwargs)
        result = await anyio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=limiter)
        if inspect.isawaitable(result):  # a sync callable (a decorator) handing back a coroutine
            result = await result  # inside the call's context: current_call() works there
        return result
    finally:
        unbind(token)


async def run_tool(
    registry: ToolRegistry,
    call: ToolCall,
    *,
    clock: Clock | None = None,
    limiter: anyio.CapacityLimiter | None = None,
    context: CallContext | None = None,
    reconcile: bool = False,
    timer: Timer | None = None,
) -> ToolOutcome:
    """Run one call and say how it ended; never raises for anything the tool or model did.

    ``limiter`` bounds the worker threads of sync tools (anyio's default one otherwise);
    ``clock`` measures ``elapsed_ms``; ``context`` is what :func:`current_call` returns
    inside the tool. ``reconcile``: the call was cut short by a crash; ask the tool's
    ``reconcile`` check first, and run the call only when it says the effect is absent.
    ``timer`` keeps the tool's time limit on the caller's Clock (see :data:`Timer`);
    without one, the event loop's clock does.
    """
    clock = clock or _SYSTEM_CLOCK
    started = clock.monotonic()

    def outcome(status: Status, text: str, error_class: str | None = None) -> ToolOutcome:
        return ToolOutcome(
            call_id=call.id,
            tool=call.name,
            status=status,
            text=text,
            error_class=error_class,
            action=None if error_class is None else action_for(error_class),
            elapsed_ms=max(0, round((clock.monotonic() - started) * 1000)),
        )

    tool = registry.get(call.name)
    if tool is None:
        return outcome(
            "unknown_tool", unknown_tool_text(call.name, registry.names()), "unknown_tool"
        )
    kwargs = parse_arguments(tool, call.arguments)
    if isinstance(kwargs, str):
        text = invalid_arguments_text(tool.name, kwargs)
        return outcome("invalid_arguments", text, "invalid_arguments")
    try:
        with cut_after(tool.timeout_ms / 1000, timer) as scope:
            try:
                if reconcile and tool.reconcile is not None:
                    key = (context.idempotency_key if context is not None else None) or call.id
                    check = functools.partial(tool.reconcile, key, kwargs)
                    # a check that hangs is abandoned at the tool's limit, like the tool
                    found = await anyio.to_thread.run_sync(
                        check, abandon_on_cancel=True, limiter=limiter
                    )
                    if found is not None:
                        return msgspec.structs.replace(outcome("ok", str(found)), reconciled=True)
                result = await _invoke(tool.fn, tool.is_async, kwargs, limiter, context)
            except anyio.get_cancelled_exc_class():
                if scope.cancel_called or anyio.current_effective_deadline() == -math.inf:
                    raise  # the call's own limit, or the caller's cancellation
                # a cancellation of the tool's own making (an inner task it cancelled and
                # awaited) escaped it: that call failed, nobody cancelled the caller
                return outcome("error", error_text(tool.name, "cancelled", "surface"), "cancelled")
    except BaseException as exc:  # sys.exit(), gevent's Timeout: whatever the tool raised
        if _not_the_tools(exc):
            raise
        error_class, action = classify_tool_error(exc)
        text = error_text(tool.name, error_class, action)
        if isinstance(exc, ToolError):
            text = scrub_surrogates(f"The tool '{tool.name}' failed: {exc}")
        return msgspec.structs.replace(outcome("error", text, error_class), action=action)
    if scope.cancelled_caught:
        return outcome("timeout", timeout_text(tool.name, tool.timeout_ms), "timeout")
    try:
        text = result_text(result)
    except (TypeError, ValueError, OverflowError, RecursionError):  # a cycle, too deep
        text = error_text(tool.name, "unencodable_result", "surface")
        return outcome("error", text, "unencodable_result")
    return outcome("ok", text)


def _not_the_tools(exc: BaseException) -> bool:
    """Whether ``exc`` ends more than the call: the event loop's cancellation (the
    caller's deadline; a tool's own was made an outcome above), an interrupt, or the
    closing of this coroutine (``GeneratorExit``: nothing may be awaited after it), alone
    or in a group."""
    kinds = (anyio.get_cancelled_exc_class(), KeyboardInterrupt, GeneratorExit)
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(kinds) is not None
    return isinstance(exc, kinds)


async def run_tools(
    registry: ToolRegistry,
    calls: Iterable[ToolCall],
    *,
    limit: int,
    clock: Clock | None = None,
    keys: Mapping[str, str] | None = None,
    reconcile: frozenset[str] = frozenset(),
    timer: Timer | None = None,
) -> tuple[ToolOutcome, ...]:
    """Run ``calls`` concurrently, at most ``limit`` at once; outcomes in the calls' order.

    A call's timeout starts when it gets its turn, not while it waits for one. ``keys``
    gives calls their idempotency keys (by call id); calls in ``reconcile`` are checked
    with their tool's ``reconcile`` before they run; ``clock`` and ``timer`` are
    :func:`run_tool`'s.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    pending = tuple(calls)
    outcomes: list[ToolOutcome | None] = [None] * len(pending)
    turns = anyio.CapacityLimiter(limit)
    threads = anyio.CapacityLimiter(limit)

    async def one(index: int, call: ToolCall) -> None:
        async with turns:
            context = CallContext(
                call_id=call.id, tool=call.name, idempotency_key=(keys or {}).get(call.id)
            )
            outcomes[index] = await run_tool(
                registry,
                call,
                clock=clock,
                limiter=threads,
                context=context,
                reconcile=call.id in reconcile,
                timer=timer,
            )

    async with anyio.create_task_group() as group:
        for index, call in enumerate(pending):
            group.start_soon(one, index, call)
    done = tuple(item for item in outcomes if item is not None)
    if len(done) != len(pending):  # never silently fewer outcomes than calls
        raise RuntimeError("a tool call ended without an outcome")
    return done
