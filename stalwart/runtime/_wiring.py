"""What a started runtime's layers share: the pieces they start their actors on, and
how they stop them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pykka

from stalwart._logs import get_logger
from stalwart.actors import IoPortal, Scheduler, clock_timer
from stalwart.channels import Channel
from stalwart.clock import Clock
from stalwart.config import Config
from stalwart.store import EventStore

from ._handles import STOP_TIMEOUT_S

__all__ = ["Wiring", "stop_actors"]

log = get_logger(__name__)


@dataclass(frozen=True)
class Wiring:
    """One started runtime's pieces, given to its layers (the sessions, the runs, the
    restartable parts). ``lock`` is the runtime's own; ``running()`` is False once it
    closes, and a layer starts nothing then."""

    config: Config
    store: EventStore
    clock: Clock
    scheduler: Scheduler
    portal: IoPortal
    channels: Mapping[str, Channel]
    lock: threading.RLock
    running: Callable[[], bool]
    #: the runtime instance's id (``runtime:started``'s ``instance``)
    instance: str = ""

    def timer(self, seconds: float, expire: Callable[[], object]) -> Callable[[], object]:
        """A :data:`~stalwart.clock.Timer` on the runtime's Clock: ``expire`` runs on the
        portal's loop once ``seconds`` pass on the clock."""
        return clock_timer(self.portal, self.scheduler, self.clock, seconds, expire)


def stop_actors(refs: Sequence[pykka.ActorRef[Any] | None]) -> None:
    """Stop all at once, then wait for each within the stop bound."""
    futures = [ref.stop(block=False) for ref in refs if ref is not None]
    for future in futures:
        try:
            future.get(timeout=STOP_TIMEOUT_S)
        except pykka.Timeout:
            log.warning("runtime.actor_stop_timeout", timeout_s=STOP_TIMEOUT_S)
        except pykka.ActorDeadError:
            pass
