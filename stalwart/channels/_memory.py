"""A channel for tests: records what it was given and fails or hangs on demand."""

from __future__ import annotations

import threading
from collections import deque

import anyio
import msgspec

from stalwart.errors import ChannelError

from ._types import Delivery, OutboundMessage, closed_error

__all__ = ["MemoryChannel"]


class _Fail(msgspec.Struct, frozen=True):
    kind: str
    retryable: bool
    status: int | None


class _Hang(msgspec.Struct, frozen=True):
    pass


class MemoryChannel:
    """Keeps every message in order; its next sends can be scripted to fail or to hang.

    ``attempted`` holds every message given to :meth:`send` (failed and hung ones too),
    ``messages`` only the delivered ones. A scripted failure raises ChannelError with the
    given kind; a scripted hang waits until the caller cancels it, which is how a caller
    tests its own announcement timeout. Use it from one event loop; scripting it from
    another thread is safe.
    """

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.messages: list[OutboundMessage] = []
        self.attempted: list[OutboundMessage] = []
        self._script: deque[_Fail | _Hang] = deque()
        self._lock = threading.Lock()
        self._changed: anyio.Event | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"MemoryChannel({self.name!r}, delivered={len(self.messages)})"

    def fail_next(
        self,
        count: int = 1,
        *,
        kind: str = "server_error",
        retryable: bool = True,
        status: int | None = None,
    ) -> None:
        """Make the next ``count`` sends (after those already scripted) raise ChannelError."""
        with self._lock:
            self._script.extend([_Fail(kind, retryable, status)] * count)

    def hang_next(self, count: int = 1) -> None:
        """Make the next ``count`` sends (after those already scripted) wait until cancelled."""
        with self._lock:
            self._script.extend([_Hang()] * count)

    async def send(self, message: OutboundMessage) -> Delivery:
        with self._lock:
            if self._closed:
                raise closed_error(self.name)
            self.attempted.append(message)
            step = self._script.popleft() if self._script else None
            if step is None:
                self.messages.append(message)
        self._notify()
        if isinstance(step, _Fail):
            raise ChannelError(
                f"memory channel {self.name!r}: scripted failure ({step.kind})",
                kind=step.kind,
                retryable=step.retryable,
                channel=self.name,
                status=step.status,
            )
        if step is not None:  # a scripted hang: only a cancel ends it
            await anyio.sleep_forever()
        return Delivery(channel=self.name, attempts=1)

    async def wait_for(self, count: int, *, attempted: bool = False) -> list[OutboundMessage]:
        """Wait until ``count`` messages were delivered (or attempted); bound it yourself."""
        while True:
            with self._lock:
                seen = self.attempted if attempted else self.messages
                if len(seen) >= count:
                    return list(seen)
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def aclose(self) -> None:
        with self._lock:
            self._closed = True
