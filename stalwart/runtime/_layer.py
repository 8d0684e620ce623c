"""The provider layer on a store: every provider's client and breaker, and the sink
that appends their events (``stalwart run`` uses it on its own too)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial

import anyio.to_thread

from stalwart._logs import get_logger
from stalwart.clock import Clock, SystemClock, Timer
from stalwart.config import Config
from stalwart.events import Event, RecordedEvent
from stalwart.providers import Breaker, ModelCaller, ProviderClient
from stalwart.state import BREAKER
from stalwart.store import EventStore, Fence, NewEvent, load_state, read_readable

__all__ = ["ProviderLayer", "StoreSink"]

log = get_logger(__name__)


class StoreSink:
    r"""Appends to an EventStore from a worker thread (an append waits for its fsync).

    A stream under a lease is fenced: while an Agent runs a wake it :meth:`hold`\ s the
    stream with the lease's fence, so the provider layer's events for it go through only
    while the lease is this process's (a holder that froze past its lease cannot write
    prompt events after the takeover either)."""

    def __init__(self, store: EventStore) -> None:
        self._store = store
        self._fences: dict[str, Fence] = {}

    def hold(self, stream: str, fence: Fence | None) -> None:
        """Fence the stream's appends with ``fence`` (None: unfenced again)."""
        if fence is None:
            self._fences.pop(stream, None)
        else:
            self._fences[stream] = fence

    async def emit(self, stream: str, events: Sequence[Event], ts: float) -> list[RecordedEvent]:
        if not events:
            return []
        news = [NewEvent(event=event, ts=ts) for event in events]
        fence = self._fences.get(stream)
        return await anyio.to_thread.run_sync(
            partial(self._store.append, fence=fence), stream, news
        )

    async def emit_expecting(
        self, stream: str, events: Sequence[Event], ts: float, expected_version: int
    ) -> list[RecordedEvent]:
        news = [NewEvent(event=event, ts=ts) for event in events]
        append = partial(
            self._store.append, expected_version=expected_version, fence=self._fences.get(stream)
        )
        return await anyio.to_thread.run_sync(append, stream, news)

    async def read(self, stream: str, from_version: int) -> list[RecordedEvent]:
        # a damaged record is passed over, as the breaker's start-up fold passes it over
        return await anyio.to_thread.run_sync(
            lambda: list(read_readable(self._store, stream, from_version))
        )


class ProviderLayer:
    """Every configured provider's client and breaker, over one store."""

    def __init__(
        self,
        config: Config,
        store: EventStore,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock or SystemClock()
        self.sink = StoreSink(store)
        self._rng = rng
        self.clients = {
            name: ProviderClient(name, settings, clock=self.clock)
            for name, settings in config.providers.items()
        }
        for name, client in self.clients.items():
            if client.settings.api_key_env and not client.has_api_key:  # every call a 401
                log.warning(
                    "provider.api_key_missing", provider=name, env=client.settings.api_key_env
                )
        self.breakers = {
            # a damaged record is passed over (logged): the breaker's state is advisory,
            # and one lost record must not keep the runtime from starting
            name: Breaker(
                settings, load_state(store, f"provider:{name}", BREAKER, skip_unreadable=True)
            )
            for name, settings in config.providers.items()
        }

    def caller(
        self,
        agent: str = "default",
        *,
        skip: Callable[[str], bool] | None = None,
        timer: Timer | None = None,
    ) -> ModelCaller:
        """The caller for a configured agent (``skip``: providers its chain passes over;
        ``timer``: keeps its deadlines and backoffs on the layer's clock)."""
        return ModelCaller(
            self.config.agent(agent),
            self.clients,
            self.breakers,
            self.sink,
            self.clock,
            agent_name=agent,
            rng=self._rng,
            skip=skip,
            timer=timer,
        )

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()
