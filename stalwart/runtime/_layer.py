"""The provider layer on a store: every provider's client and breaker, and the sink
that appends their events (``stalwart run`` uses it on its own too)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import anyio.to_thread

from stalwart.clock import Clock, SystemClock
from stalwart.config import Config
from stalwart.events import Event, RecordedEvent
from stalwart.providers import Breaker, ModelCaller, ProviderClient
from stalwart.state import BREAKER
from stalwart.store import EventStore, NewEvent, load_state

__all__ = ["ProviderLayer", "StoreSink"]


class StoreSink:
    """Appends to an EventStore from a worker thread (an append waits for its fsync)."""

    def __init__(self, store: EventStore) -> None:
        self._store = store

    async def emit(self, stream: str, events: Sequence[Event], ts: float) -> list[RecordedEvent]:
        if not events:
            return []
        news = [NewEvent(event=event, ts=ts) for event in events]
        return await anyio.to_thread.run_sync(self._store.append, stream, news)


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
        self.breakers = {
            name: Breaker(settings, load_state(store, f"provider:{name}", BREAKER))
            for name, settings in config.providers.items()
        }

    def caller(self, agent: str = "default") -> ModelCaller:
        """The caller for a configured agent."""
        return ModelCaller(
            self.config.agent(agent),
            self.clients,
            self.breakers,
            self.sink,
            self.clock,
            agent_name=agent,
            rng=self._rng,
        )

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()
