"""The I/O portal: one anyio event loop in a background thread, shared by every actor.

An actor never blocks on the network. It submits a coroutine function and gets a
:class:`concurrent.futures.Future`; when the future completes, a done-callback turns the
outcome into a message to the actor, which folds, decides and appends as for any other
message::

    future = portal.submit(channel.send, message)
    future.add_done_callback(lambda f: tell(actor_ref, Sent.of(f)))

The callback runs on the portal's thread (or on the thread that cancelled the future), so
it must be cheap and must not raise: build a message and ``tell`` it, nothing more. The
coroutine owns its own deadline (a cancel scope inside it), as the caller of a channel or
a provider does.

Stopping the portal cancels whatever is still in flight; the futures of those calls end
cancelled, and their done-callbacks run. The stop waits a bounded time for the loop to
end: a call that blocks it, or does not end when cancelled, does not hold it up.

Neither ``submit`` nor ``call_soon`` waits for the loop: the call is handed over with
``call_soon_threadsafe`` and started there. A channel that blocks the loop (a synchronous
HTTP call inside ``async def send``, say) delays every call on it, but no actor's thread
is stuck behind it, so each can still keep its own time (``send_by_clock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Self, TypeVar, TypeVarTuple, Unpack

import anyio
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from stalwart._logs import get_logger

__all__ = ["IoPortal"]

log = get_logger(__name__)

#: How long ``stop()`` waits for the loop to end, by default (the runtime's stop bound).
STOP_TIMEOUT_S = 5.0

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _Job:
    """One submitted call: the coroutine function, its arguments, the caller's future."""

    __slots__ = ("args", "fn", "future")

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.future: Future[Any] = Future()


class _Spawner:
    """The task on the loop that starts the jobs handed to it from other threads."""

    def __init__(self) -> None:
        send, receive = anyio.create_memory_object_stream[_Job](math.inf)
        self._send: MemoryObjectSendStream[_Job] = send
        self._receive: MemoryObjectReceiveStream[_Job] = receive

    def post(self, job: _Job) -> None:
        """On the loop: queue ``job`` (cancelled when the spawner has stopped)."""
        try:
            self._send.send_nowait(job)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            job.future.cancel()

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        try:
            async with anyio.create_task_group() as group:
                task_status.started()
                async for job in self._receive:
                    group.start_soon(_run, job)
                    del job  # not kept while waiting for the next (its fn holds the host's)
        finally:  # jobs still queued never started: ``stop`` cancels their futures
            self._send.close()
            self._receive.close()


async def _run(job: _Job) -> None:
    """Run one job; its future ends with the outcome. Cancelling the future cancels the
    call; a cancelled call (the portal stopping) ends the future cancelled. The future
    stays pending while the call runs, so that ``cancel()`` can still reach it."""
    future = job.future
    if future.cancelled():
        return
    loop = asyncio.get_running_loop()
    scope = anyio.CancelScope()

    def cancelled(done: Future[Any]) -> None:
        if done.cancelled():
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing left to cancel
                loop.call_soon_threadsafe(scope.cancel)

    try:
        with scope:
            future.add_done_callback(cancelled)
            result = await job.fn(*job.args)
    except anyio.get_cancelled_exc_class():
        future.cancel()
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the portal is stopping: the cancellation is the loop's, let it through
        # else the call raised a CancelledError of its own (a future someone else
        # cancelled): its outcome, not a reason to stop every other call on the loop
    except BaseException as exc:  # sys.exit() in a channel or a run's work: its outcome
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)
        if isinstance(exc, GeneratorExit):
            raise  # this coroutine is being closed: nothing may run after it
        # anything else raised through would end the loop, and every call on it
    else:
        if not scope.cancelled_caught and future.set_running_or_notify_cancel():
            future.set_result(result)


def _end(portal: BlockingPortal, context: AbstractContextManager[BlockingPortal]) -> None:
    """Stop ``portal``'s loop, cancelling what is in flight, and join its thread."""
    with contextlib.suppress(RuntimeError):  # the loop has ended already
        portal.call(portal.stop, True)  # cancel_remaining: what is in flight ends now
    context.__exit__(None, None, None)  # joins the thread


class IoPortal:
    """Runs coroutines on one event loop in a daemon thread, for callers in other threads.

    ``start()`` opens the loop, ``stop()`` cancels what is in flight and joins the thread;
    a stopped portal can be started again. ``with IoPortal() as portal:`` does both.
    """

    def __init__(self, *, backend: str = "asyncio", name: str = "stalwart-io") -> None:
        if backend != "asyncio":
            raise ValueError(f"IoPortal runs on asyncio only, not {backend!r}")
        self._name = name
        self._lock = threading.Lock()
        self._context: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        #: the asyncio loop, for :meth:`call_soon` (read without the lock: see there)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spawner: _Spawner | None = None
        self._thread_ident: int | None = None
        #: futures of the calls handed over and not yet ended, cancelled by ``stop``
        self._pending: set[Future[Any]] = set()

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        with self._lock:
            return self._portal is not None

    @property
    def thread_ident(self) -> int | None:
        """The loop thread's ``threading.get_ident()`` while running (to say where it is
        blocked), else None."""
        return self._thread_ident if self.running else None

    def start(self) -> Self:
        """Start the event loop thread (a no-op when it runs already)."""
        with self._lock:
            if self._portal is None:
                context = start_blocking_portal("asyncio", name=self._name)
                portal = context.__enter__()
                spawner = _Spawner()
                portal.start_task(spawner.serve)
                self._loop = portal.call(asyncio.get_running_loop)
                self._thread_ident = portal.call(threading.get_ident)
                self._portal, self._context, self._spawner = portal, context, spawner
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel every call still in flight, stop the loop and join its thread within
        ``timeout`` seconds. A loop still held up then (a call blocking it, or one that
        does not end when cancelled) is left to end on its daemon thread, and said
        (``io.portal_stop_timed_out``); the futures of its calls end cancelled all the
        same, so nobody waits for them."""
        with self._lock:
            portal, self._portal = self._portal, None
            context, self._context = self._context, None
            self._loop = self._spawner = None
            # this loop's calls: a start while this stop waits has calls of its own
            left, self._pending = self._pending, set()
        if portal is None or context is None:
            return
        ending = threading.Thread(
            target=_end, args=(portal, context), name=f"{self._name}-stop", daemon=True
        )
        ending.start()
        ending.join(timeout)
        if ending.is_alive():
            log.warning("io.portal_stop_timed_out", timeout_s=timeout)
        for future in left:  # never started as the loop closed, or still held up in it
            future.cancel()

    def submit(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> Future[T]:
        """Run ``fn(*args)`` on the loop; its outcome arrives in the returned future.

        Never waits for the loop. Cancelling the future cancels the call. Raises
        RuntimeError when the portal is not running.
        """
        job = _Job(fn, args)
        with self._lock:
            loop, spawner = self._loop, self._spawner
            if loop is None or spawner is None:
                raise RuntimeError("the I/O portal is not running: call start() first")
            self._pending.add(job.future)
            try:
                loop.call_soon_threadsafe(spawner.post, job)
            except RuntimeError:  # the loop closed meanwhile
                self._pending.discard(job.future)
                raise RuntimeError("the I/O portal is not running: call start() first") from None
        job.future.add_done_callback(self._ended)
        return job.future

    def _ended(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def call_soon(self, fn: Callable[[], object]) -> bool:
        """Run the plain callable ``fn()`` on the loop soon, without waiting for the loop
        to take it; False when the portal is not running. The lock is not taken, so a
        thread that must never stall (the scheduler's) can call it at any time."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"IoPortal({state})"
