"""Running the calls a model asked for: validated, each under its own timeout, bounded.

Sync tools run on a daemon thread; async ones are awaited on the caller's event loop.
A tool's timeout is a cancel scope: an async tool is cancelled, a sync one is abandoned
(Python cannot stop a thread; it finishes in the background and its result is dropped),
and either way the call is reported as ``timeout`` at once. Nothing a tool does is raised
at the caller: every call ends as a :class:`ToolOutcome`. Cancellation from outside (the
caller's own deadline) is not an outcome: it propagates.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec

from stalwart._aio import cut_after
from stalwart._text import scrub_surrogates
from stalwart.clock import Clock, SystemClock, Timer
from stalwart.errors import ToolError
from stalwart.events import ToolCall

from ._breaker import Action, action_for, classify_tool_error
from ._context import CallContext, bind, unbind
from ._outcome import (
    Status,
    ToolOutcome,
    bounded_text,
    error_text,
    invalid_arguments_text,
    timeout_text,
    unknown_tool_text,
    unreconciled_text,
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
    try:  # JSON's object keys are text: str_keys converts them as a JSON decode would
        parsed = msgspec.convert(value, tool.arguments, str_keys=True)
    except msgspec.ValidationError as exc:
        return str(exc)
    kwargs = {name: getattr(parsed, name) for name in tool.arguments.__struct_fields__}
    if not tool.extra_keywords:
        return kwargs
    for key, item in value.items():  # the ones **kwargs takes, converted to its hint
        if key not in kwargs:
            try:
                kwargs[key] = msgspec.convert(item, tool.extra_type, str_keys=True)
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


class _RaisedOnThread(Exception):
    """A ``KeyboardInterrupt`` or ``GeneratorExit`` a sync tool (or a reconcile check)
    raised on its worker thread: the tool's own (Python delivers Ctrl-C to the main
    thread only, and no coroutine is being closed there), carried as an ordinary
    exception so that it ends the call, not the event loop."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(type(raised).__name__)
        self.raised = raised


def _on_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a worker thread (see :class:`_RaisedOnThread`)."""
    try:
        return fn()
    except (KeyboardInterrupt, GeneratorExit) as exc:
        raise _RaisedOnThread(exc) from exc


class _DaemonThreads:
    """Daemon threads for sync tool calls, reused while they idle (starting a thread per
    call cost about 0.25 ms). A call abandoned at its limit keeps its thread and the
    next call gets another; a thread idle for ``idle_s`` ends. Daemon threads never keep
    the process from exiting, where anyio's worker threads would: the interpreter waits
    for those at exit, for as long as an abandoned tool hangs."""

    def __init__(self, idle_s: float = 10.0) -> None:
        self._idle_s = idle_s
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not promised one yet

    def forget_after_fork(self) -> None:
        """In a forked child: none of the parent's threads is there (its idle ones would
        be promised jobs no one takes, and its lock may have been held at the fork)."""
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # promised this job
        if start:  # before the job is queued: one no thread could take is not left behind
            threading.Thread(target=self._work, name="stalwart-tool", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # not promised a job: end
                        self._idle -= 1
                        return
                continue  # promised one that is on its way
            job()
            with self._lock:
                self._idle += 1


_THREADS = _DaemonThreads()
os.register_at_fork(after_in_child=_THREADS.forget_after_fork)


class _DaemonCall:
    """One sync call on a daemon thread, in a copy of the caller's context
    (``current_call()`` works there), which tells the event loop when it ends."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._context = contextvars.copy_context()
        self._token = anyio.lowlevel.current_token()
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def start(self) -> None:
        _THREADS.submit(self._target)

    def _target(self) -> None:
        try:
            self.result = self._context.run(_on_thread, self._fn)
        except BaseException as exc:  # handed to the waiting task, raised there
            self.error = exc
        # the loop may be gone (the call was abandoned and the runtime closed): no one waits
        with contextlib.suppress(anyio.RunFinishedError, RuntimeError):
            anyio.from_thread.run_sync(self.done.set, token=self._token)


async def _in_thread(fn: Callable[[], Any], limiter: anyio.CapacityLimiter | None) -> Any:
    """``fn()`` on a daemon thread, one of at most ``limiter``'s (anyio's default one
    without) while it is waited for; abandoned if the caller is cancelled."""
    call = _DaemonCall(fn)
    async with limiter or anyio.to_thread.current_default_thread_limiter():
        call.start()
        await call.done.wait()
    if call.error is not None:
        raise call.error
    return call.result


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
        result = await _in_thread(functools.partial(fn, **kwargs), limiter)
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
    ``reconcile`` check first, and run the call only when it says the effect is absent
    (a check that raises or runs out of time ends the call as ``unreconciled``).
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
    found = None  # what a reconcile check found: the effect happened, this is its output
    # until the check answers, a failure is the check's: whether the effect happened is
    # unknown, so the call is surfaced as unreconciled, never offered for a blind retry
    check = tool.reconcile if reconcile else None
    checking = check is not None

    def unreconciled(status: Status = "error") -> ToolOutcome:
        return outcome(status, unreconciled_text(tool.name), "unreconciled")

    try:
        with cut_after(tool.timeout_ms / 1000, timer) as scope:
            try:
                if check is not None:
                    key = (context.idempotency_key if context is not None else None) or call.id
                    found = await _check(check, key, kwargs, limiter)
                    checking = False
                if found is None:
                    result = await _invoke(tool.fn, tool.is_async, kwargs, limiter, context)
            except anyio.get_cancelled_exc_class():
                if scope.cancel_called or anyio.current_effective_deadline() == -math.inf:
                    raise  # the call's own limit, or the caller's cancellation
                # a cancellation of the tool's own making (an inner task it cancelled and
                # awaited) escaped it: that call failed, nobody cancelled the caller
                if checking:
                    return unreconciled()
                return outcome("error", error_text(tool.name, "cancelled", "surface"), "cancelled")
    except BaseException as exc:  # sys.exit(), gevent's Timeout: whatever the tool raised
        if _not_the_tools(exc):
            raise
        if checking:
            return unreconciled()
        text, error_class, action = _failure(tool.name, exc)
        text = bounded_text(text, tool.max_result_bytes, error=True)
        return msgspec.structs.replace(outcome("error", text, error_class), action=action)
    if scope.cancelled_caught:
        if checking:  # the check ran out of the tool's time
            return unreconciled("timeout")
        return outcome("timeout", timeout_text(tool.name, tool.timeout_ms), "timeout")
    try:  # a reconciled call's output is made text like a result (surrogates scrubbed)
        text = result_text(result if found is None else found)
    except (TypeError, ValueError, OverflowError, RecursionError):  # a cycle, too deep
        text = error_text(tool.name, "unencodable_result", "surface")
        return outcome("error", text, "unencodable_result")
    text = bounded_text(text, tool.max_result_bytes)  # one call never blows log or window
    return msgspec.structs.replace(outcome("ok", text), reconciled=found is not None)


def _failure(tool: str, exc: BaseException) -> tuple[str, str, Action]:
    """What the model reads for an exception a tool raised, its error class and action."""
    if isinstance(exc, _RaisedOnThread):
        exc = exc.raised
    error_class, action = classify_tool_error(exc)
    if isinstance(exc, ToolError):  # its message is written for the model
        return scrub_surrogates(f"The tool '{tool}' failed: {exc}"), error_class, action
    return error_text(tool, error_class, action), error_class, action


async def _check(
    reconcile: Callable[[str, dict[str, Any]], Any],
    key: str,
    kwargs: dict[str, Any],
    limiter: anyio.CapacityLimiter | None,
) -> Any:
    """What a tool's ``reconcile`` check found for the call ``key`` (None: no effect).
    A check that hangs is abandoned at the tool's limit, like the tool; an async check
    (or a sync one handing back a coroutine) is awaited."""
    found = await _in_thread(functools.partial(reconcile, key, kwargs), limiter)
    if inspect.isawaitable(found):
        found = await found
    return found


def _not_the_tools(exc: BaseException) -> bool:
    """Whether ``exc`` ends more than the call: the event loop's cancellation (the
    caller's deadline; a tool's own was made an outcome above), an interrupt (Ctrl-C:
    only ever raised on the main thread; elsewhere a ``KeyboardInterrupt`` is the
    tool's own), or the closing of this coroutine (``GeneratorExit``: nothing may be
    awaited after it), alone or in a group."""
    kinds: tuple[type[BaseException], ...] = (anyio.get_cancelled_exc_class(), GeneratorExit)
    if threading.current_thread() is threading.main_thread():
        kinds = (*kinds, KeyboardInterrupt)
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
