"""The anyio patterns the layers share: a cancel scope cut on a Clock, a sleep on a Clock,
and a long wait on a worker thread of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.to_thread

from stalwart.clock import Timer

__all__ = ["cut_after", "sleep_for", "wait_on_own_thread"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@contextmanager
def cut_after(seconds: float, timer: Timer | None) -> Iterator[anyio.CancelScope]:
    """A cancel scope cut ``seconds`` from now: on ``timer``'s clock (disarmed when the
    scope ends), or without one on the event loop's clock. Like any cancel scope, it
    swallows its own cut: look at ``cancelled_caught`` afterwards."""
    with anyio.CancelScope() as scope:
        if timer is None:
            scope.deadline = anyio.current_time() + seconds
            yield scope
            return
        disarm = timer(seconds, scope.cancel)
        try:
            yield scope
        finally:
            disarm()


async def sleep_for(seconds: float, timer: Timer | None) -> None:
    """Sleep ``seconds`` on ``timer``'s clock, or without one on the event loop's."""
    if timer is None:
        await anyio.sleep(seconds)
        return
    with cut_after(seconds, timer):
        await anyio.sleep_forever()


async def wait_on_own_thread(fn: Callable[[Unpack[Ts]], T], *args: *Ts) -> T:
    """``fn(*args)`` on a worker thread that is not one of the loop's shared ones
    (anyio's default limit, 40), abandoned if the caller is cancelled. For a wait as long
    as a sub-agent run or a context assembly: on the shared threads, enough of them would
    leave none for the appends of model calls, which every run needs to end."""
    own = anyio.CapacityLimiter(1)
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=own)
