"""A runtime's context engine: one ContextStore actor, and what its Agents get of it.

The ContextStore (``stalwart.actors.ContextStoreActor``) owns the ``context:<session>``
streams. Its summarizer is a model of the config: the ``default`` agent's (or the first
agent's) provider and model, through the provider layer's client, bounded by the
summarizer breaker's half-open time. Every session's Agent gets a :class:`ContextGate`
that reaches the store through a live reference (so a restarted ContextStore needs no
re-wiring; an ask while it restarts waits for it, within the ask's timeout, unless it
was given up on), and in ``dag`` mode the ``ctx_search`` / ``ctx_inspect`` / ``ctx_expand``
tools bound to its session and tenant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import (
    Assemble,
    Assembled,
    Calibrate,
    ContextStoreActor,
    IoPortal,
    ProviderSummarizer,
    context_tools,
)
from stalwart.clock import Clock, Timer
from stalwart.config import Config
from stalwart.context import ModelProfile
from stalwart.context.pipeline import FileReader
from stalwart.store import EventStore
from stalwart.tools import Tool

from ._handles import LiveRef, monotonic
from ._layer import ProviderLayer

__all__ = ["ContextLayer"]

log = get_logger(__name__)

#: How long an Agent waits for an assembly: its session's summarizer calls (each bounded
#: by its own timeout; other sessions' calls run beside them) and the engine's work.
ASSEMBLE_TIMEOUT_S = 90.0


class _Gate:
    """The ContextGate an Agent uses (see ``stalwart.actors.ContextGate``)."""

    def __init__(self, ref: LiveRef) -> None:
        self._ref = ref

    def assemble(self, request: Assemble) -> Assembled:
        assembled = ask_until_handled(self._ref, request, ASSEMBLE_TIMEOUT_S)
        assert isinstance(assembled, Assembled)
        return assembled

    def calibrate(self, request: Calibrate) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # a hint: the next call brings one
            self._ref.tell(request)


def ask_until_handled(ref: LiveRef, message: object, timeout: float) -> Any:
    """:func:`~stalwart.actors.ask_context` of the engine running now (or, while it
    restarts, of the restarted one), within ``timeout`` seconds in all; asked again of
    its successor when the engine died before it handled the ask: still in its mailbox,
    or queued in a lane that never ran it (pykka and the lanes answer those with
    ActorDeadError; a job that ran is answered by what it did, and the engine's work
    raises no ActorDeadError of its own). ActorDeadError once the engine will not run
    again (``ref.ask``), ``pykka.Timeout`` when the time runs out."""
    deadline = monotonic() + timeout
    while True:
        asked = ref.ask(message, block=False, timeout=_left(deadline))  # a restart waited for
        try:
            reply = asked.get(timeout=_left(deadline))
            if isinstance(reply, pykka.Future):  # the lane's: the rest of the time is its
                reply = reply.get(timeout=_left(deadline))
        except pykka.ActorDeadError:  # never handled: the successor takes it
            log.info("runtime.part_asked_again", part="context", message=type(message).__name__)
            continue
        return reply


def _left(deadline: float) -> float:
    return max(deadline - monotonic(), 0.0)


class ContextLayer:
    """Starts (and restarts) the ContextStore; hands out gates, profiles and tools."""

    def __init__(
        self,
        config: Config,
        store: EventStore,
        clock: Clock,
        portal: IoPortal,
        layer: ProviderLayer,
        *,
        timer: Timer,
        on_crash: Callable[[Callable[[], None], str], object],
        file_reader: FileReader | None = None,
        down_for_good: Callable[[], bool] = lambda: False,
    ) -> None:
        """``down_for_good()`` says whether an engine that is down will not start again
        (supervision gave up on it, or the runtime stopped): an assembly then fails at
        once instead of waiting for a restart."""
        self._file_reader = file_reader
        self._config = config
        self._store = store
        self._clock = clock
        self._portal = portal
        self._layer = layer
        self._timer = timer
        self._on_crash = on_crash
        self._actor: pykka.ActorRef[Any] | None = None
        self.ref = LiveRef(lambda: self._actor, "context", down_for_good=down_for_good)
        self.gate = _Gate(self.ref)

    def start(self) -> None:
        settings = self._config.context_engine
        name = "default" if "default" in self._config.agents else next(iter(self._config.agents))
        agent = self._config.agents[name]
        timeout_s = settings.summarizer_breaker.half_open_timeout_ms / 1000
        summarizer = ProviderSummarizer(
            self._layer.clients[agent.provider],
            agent.model,
            self._portal,
            timeout_s=timeout_s,
            window=agent.context_window,
            clock=self._clock,
            timer=self._timer,
        )
        self._actor = ContextStoreActor.start(
            store=self._store,
            clock=self._clock,
            summarizer=summarizer,
            settings=settings,
            on_crash=lambda reason: self._on_crash(self.start, reason),
            file_reader=self._file_reader,
        )

    def stop(self) -> None:
        actor = self._actor
        if actor is not None:
            with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
                actor.stop(timeout=5.0)

    def profile(self, agent: str) -> ModelProfile:
        """What the engine needs to know of an agent's model: Anthropic caches prompts."""
        settings = self._config.agent(agent)
        kind = self._config.providers[settings.provider].kind
        return ModelProfile(provider=kind, model=settings.model, caching=kind == "anthropic")

    def tools(self, session_id: str, tenant: str | None) -> tuple[Tool, ...]:
        """The session's ``ctx_*`` tools (none in pipeline mode)."""
        registry = context_tools(
            self.ref,
            session_id,
            tenant,
            settings=self._config.context_engine,
            asker=ask_until_handled,
        )
        return tuple(registry)
