"""The live breaker of one provider: the pure fold and decision, plus the probe slot."""

from __future__ import annotations

import anyio
import msgspec

from stalwart.config import ProviderSettings
from stalwart.errors import BreakerOpenError
from stalwart.events import Event, RecordedEvent
from stalwart.state import BreakerState, apply_breaker, decide_breaker


class Breaker:
    """Admits or refuses calls to one provider; every change of state is an event.

    The state is a fold of the provider stream (so it survives restarts: build it with
    ``load_state(store, "provider:NAME", BREAKER)``). Half-open admits exactly one probe;
    callers that arrive while it is in flight are refused at once, not queued.

    ``lock`` serializes what this process records in the provider stream: a decision is
    taken on the state every earlier event was folded into, so callers that fail
    together open the breaker once, and callers that arrive together after the reset
    share one probe. Other processes on the same store append to the same stream: the
    caller folds what they appended before it decides, and records a decision expecting
    the version it decided on (see ``ModelCaller``), so every process's decision is the
    one the log's fold re-derives. (The probe slot is this process's: each process on
    a half-open breaker may send one probe.)
    """

    def __init__(self, settings: ProviderSettings, state: BreakerState) -> None:
        self._threshold = settings.breaker_failure_threshold
        self._reset_ms = settings.breaker_reset_timeout_ms
        self.state = state
        self._probe_in_flight = False
        self.lock = anyio.Lock()

    @property
    def provider(self) -> str:
        return self.state.provider

    def _decide(self, now: float) -> list[Event]:
        return decide_breaker(
            self.state, now, threshold=self._threshold, reset_timeout_ms=self._reset_ms
        )

    def fold(self, records: list[RecordedEvent]) -> None:
        """Fold records of the provider stream, in order; one already folded is passed
        over (a catch-up read may return what an append of this process folded)."""
        for record in records:
            if record.version > self.state.version:
                self.state = apply_breaker(self.state, record)

    def passed_over(self, version: int) -> None:
        """The stream's records up to ``version`` are folded, or cannot be read (passed
        over, as the start-up fold passes over them): decisions expect what follows."""
        if version > self.state.version:
            self.state = msgspec.structs.replace(self.state, version=version)

    def due(self, now: float) -> list[Event]:
        """Decisions due at ``now``: open -> half_open after the reset timeout, and what
        an outcome just folded calls for (opened, closed)."""
        return self._decide(now)

    def admit(self) -> bool:
        """Take a slot for one call, or raise BreakerOpenError. True when it is the probe."""
        status = self.state.status
        if status == "closed":
            return False
        if status == "half_open" and not self._probe_in_flight:
            self._probe_in_flight = True
            return True
        raise BreakerOpenError(
            f"the circuit breaker of {self.provider} is {status.replace('_', '-')}",
            kind="breaker_open",
            retryable=False,
            provider=self.provider,
        )

    def settled(self, probe: bool, now: float) -> list[Event]:
        """A call ended (its outcome already folded): free its slot, and the decisions
        that follow. For a caller that does both in one step; ``ModelCaller`` takes
        :meth:`due` when it folds an outcome and frees the slot once its attempt is over."""
        self.release(probe)
        return self._decide(now)

    def release(self, probe: bool) -> None:
        """Free the probe slot, once the call that took it has ended (outcome or none).
        Exactly once per admitted call: a second release would free the slot of the
        next probe while it is in flight, and let a third caller probe beside it."""
        if probe:
            self._probe_in_flight = False
