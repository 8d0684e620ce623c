"""What a runtime stands on: its event log, its channels, the I/O portal and the
scheduler; opened first on start (``runtime:started`` recorded), closed last
(``runtime:stopped`` recorded, the store closed if the runtime opened it)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import stalwart
from stalwart._logs import get_logger
from stalwart.actors import IoPortal, LoopWatch, Scheduler, clock_timer
from stalwart.channels import Channel, ConsoleChannel, channel_from_settings
from stalwart.clock import Clock
from stalwart.config import Config
from stalwart.events import Event, RuntimeStarted, RuntimeStopped
from stalwart.ids import new_id
from stalwart.store import EventStore, NewEvent, open_configured

from ._handles import DEFAULT_CHANNEL, RUNTIME_STREAM, STOP_TIMEOUT_S
from ._wiring import Wiring

__all__ = ["Foundation", "runtime_started"]

log = get_logger(__name__)

T = TypeVar("T")

NOT_STARTED = "the runtime has not started: use start() or a with block"


def runtime_started(config: Config, store: EventStore, instance: str = "") -> RuntimeStarted:
    """The ``runtime:started`` of a process running ``config`` on ``store``: the config
    as replay needs it (no secret), with the store actually in use (password-free), and
    the runtime ``instance``'s id."""
    record = config.to_record()
    record["store"]["location"] = store.location
    return RuntimeStarted(
        config=record,
        stalwart_version=stalwart.__version__,
        host=socket.gethostname(),
        pid=os.getpid(),
        instance=instance,
    )


class Foundation:
    """The store (see :class:`Runtime` for ``store``), the channels (the config's, a
    ``console`` one when it names none, and the host's ``extra``), the portal and the
    scheduler."""

    def __init__(
        self,
        config: Config,
        clock: Clock,
        store: EventStore | str | os.PathLike[str] | None,
        extra: Mapping[str, Channel],
    ) -> None:
        self._config = config
        self._clock = clock
        self._store_arg = store
        self._extra = dict(extra)
        self.channels: dict[str, Channel] = {}
        self._built: list[Channel] = []
        self._store: EventStore | None = None
        self._owns_store = False
        self._started_recorded = False
        self._portal: IoPortal | None = None
        self._scheduler: Scheduler | None = None
        self._watch: LoopWatch | None = None
        #: this runtime instance (its restarts are counted apart from other processes')
        self.instance = new_id()

    @property
    def store(self) -> EventStore:
        if self._store is None:
            raise RuntimeError(NOT_STARTED)
        return self._store

    @property
    def portal(self) -> IoPortal:
        if self._portal is None:
            raise RuntimeError(NOT_STARTED)
        return self._portal

    def open(self) -> None:
        """The store, the channels, ``runtime:started``, then the portal and scheduler."""
        self._store, self._owns_store = self._open_store()
        # the channels first: a channel the config cannot build fails the start before
        # anything is recorded or started
        self.channels = self._build_channels()
        self._record(runtime_started(self._config, self._store, self.instance))
        self._started_recorded = True
        self._portal = IoPortal().start()
        self._scheduler = Scheduler(self._clock).start()
        self._watch = LoopWatch(self._portal, self._scheduler, self._clock).start()

    def wiring(self, lock: threading.RLock, running: Callable[[], bool]) -> Wiring:
        """What the runtime's layers are started on (once :meth:`open` has returned)."""
        assert self._scheduler is not None
        return Wiring(
            config=self._config,
            store=self.store,
            clock=self._clock,
            scheduler=self._scheduler,
            portal=self.portal,
            channels=self.channels,
            lock=lock,
            running=running,
            instance=self.instance,
        )

    def _open_store(self) -> tuple[EventStore, bool]:
        given = self._store_arg
        if given is None:
            given = self._config.store.location
        if isinstance(given, str | os.PathLike):
            return open_configured(self._config.store, given, clock=self._clock), True
        return given, False

    def _build_channels(self) -> dict[str, Channel]:
        built: dict[str, Channel] = {}
        for name, settings in self._config.channels.items():
            if name not in self._extra:
                built[name] = channel_from_settings(
                    name, settings, clock=self._clock, timer=self._timer
                )
        if not self._config.channels and DEFAULT_CHANNEL not in self._extra:
            built[DEFAULT_CHANNEL] = ConsoleChannel(DEFAULT_CHANNEL)
        self._built = list(built.values())
        return {**built, **self._extra}

    def _timer(self, seconds: float, expire: Callable[[], object]) -> Callable[[], object]:
        """The built channels' :data:`~stalwart.clock.Timer`: they are built before the
        scheduler starts, and send only once it runs."""
        if self._portal is None or self._scheduler is None:
            raise RuntimeError("the runtime's scheduler has not started")
        return clock_timer(self._portal, self._scheduler, self._clock, seconds, expire)

    # -- closing (each a step of Runtime.close) ------------------------------------------------

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the portal's loop (an async tool, a channel's send):
        a close there cannot wait for that loop, nor stop it."""
        portal = self._portal
        return portal is not None and portal.thread_ident == threading.get_ident()

    def on_loop(self, fn: Callable[[], Awaitable[T]] | None) -> T | None:
        """Run ``fn()`` on the portal's loop (where its clients live), within the stop bound."""
        if fn is None or self._portal is None or not self._portal.running:
            return None
        return self._portal.submit(fn).result(STOP_TIMEOUT_S)

    def close_channels(self) -> None:
        """Close the channels the runtime built (not the host's)."""
        for channel in self._built:
            try:
                self.on_loop(channel.aclose)
            except Exception:
                log.exception("runtime.channel_close_failed", channel=channel.name)

    def stop_threads(self) -> None:
        """The scheduler, then the portal (which cancels whatever is still in flight)."""
        if self._watch is not None:
            self._watch.stop()
        try:
            if self._scheduler is not None:
                self._scheduler.stop(STOP_TIMEOUT_S)
        finally:
            if self._portal is not None:
                self._portal.stop()

    def finish(self, reason: str) -> None:
        """Record ``runtime:stopped`` (after a recorded start) and close a store we opened."""
        if self._store is None:
            return
        try:
            if self._started_recorded:
                self._record(RuntimeStopped(reason=reason))
        finally:
            if self._owns_store:
                self._store.close()

    def _record(self, event: Event) -> None:
        self.store.append(RUNTIME_STREAM, [NewEvent(event=event, ts=self._clock.now())])
