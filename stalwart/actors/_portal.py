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
cancelled, and their done-callbacks run.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Self, TypeVar, TypeVarTuple, Unpack

from anyio.from_thread import BlockingPortal, start_blocking_portal

__all__ = ["IoPortal"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class IoPortal:
    """Runs coroutines on one event loop in a daemon thread, for callers in other threads.

    ``start()`` opens the loop, ``stop()`` cancels what is in flight and joins the thread;
    a stopped portal can be started again. ``with IoPortal() as portal:`` does both.
    """

    def __init__(self, *, backend: str = "asyncio", name: str = "stalwart-io") -> None:
        self._backend = backend
        self._name = name
        self._lock = threading.Lock()
        self._context: AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        #: the asyncio loop, for :meth:`call_soon` (read without the lock: see there)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        """True between ``start()`` and ``stop()``."""
        with self._lock:
            return self._portal is not None

    def start(self) -> Self:
        """Start the event loop thread (a no-op when it runs already)."""
        with self._lock:
            if self._portal is None:
                context = start_blocking_portal(self._backend, name=self._name)
                self._portal = context.__enter__()
                self._context = context
                if self._backend == "asyncio":
                    self._loop = self._portal.call(asyncio.get_running_loop)
        return self

    def stop(self) -> None:
        """Cancel every call still in flight, stop the loop and join its thread."""
        with self._lock:
            portal, self._portal = self._portal, None
            context, self._context = self._context, None
            self._loop = None
        if portal is None or context is None:
            return
        portal.call(portal.stop, True)  # cancel_remaining: what is in flight ends now
        context.__exit__(None, None, None)  # joins the thread

    def submit(self, fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> Future[T]:
        """Run ``fn(*args)`` on the loop; its outcome arrives in the returned future.

        Cancelling the future cancels the call. Raises RuntimeError when the portal is
        not running.
        """
        with self._lock:
            portal = self._portal
            if portal is None:
                raise RuntimeError("the I/O portal is not running: call start() first")
            return portal.start_task_soon(fn, *args)

    def call_soon(self, fn: Callable[[], object]) -> bool:
        """Run the plain callable ``fn()`` on the loop soon, without waiting for the loop
        to take it (``submit`` waits, so a thread that must never stall, the scheduler's,
        uses this); False when the portal is not running. The lock is not taken: a
        ``submit`` holds it while the loop is busy."""
        loop = self._loop
        if loop is None:
            if not self.running:
                return False
            self.submit(_run, fn)  # another backend: no loop to hand it to directly
            return True
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
        return f"IoPortal({self._backend!r}, {state})"


async def _run(fn: Callable[[], object]) -> None:
    fn()
