"""The provider circuit breaker: fold + pure decision on a FakeClock, and the probe slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.config import ProviderSettings
from stalwart.errors import BreakerOpenError
from stalwart.events import BreakerOpened, Event, ProviderCallFailed, ProviderCallSucceeded
from stalwart.providers import Breaker
from stalwart.state import BREAKER
from stalwart.store import EventStore, NewEvent, load_state

SETTINGS = ProviderSettings(
    kind="openai", base_url="http://x", breaker_failure_threshold=5, breaker_reset_timeout_ms=60_000
)


class Harness:
    """A breaker whose events really go to a store, as the caller records them."""

    def __init__(self, store: EventStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.breaker = Breaker(SETTINGS, load_state(store, "provider:p", BREAKER))

    def record(self, events: list[Event]) -> None:
        if events:
            now = self.clock.now()
            recorded = self.store.append("provider:p", [NewEvent(event=e, ts=now) for e in events])
            self.breaker.fold(recorded)

    def start(self) -> bool:
        """Admit one attempt, as the caller does: True when it is the half-open probe."""
        self.record(self.breaker.due(self.clock.now()))
        return self.breaker.admit()

    def end(
        self, probe: bool, ok: bool, error_class: str = "server_error", *, retry_of: str = ""
    ) -> None:
        """The attempt's outcome, then the decisions that follow it."""
        outcome: Event = (
            ProviderCallSucceeded(
                provider="p", model="m", agent="a", retry_of=retry_of, probe=probe
            )
            if ok
            else ProviderCallFailed(
                provider="p",
                model="m",
                agent="a",
                error_class=error_class,
                retry_of=retry_of,
                probe=probe,
            )
        )
        self.record([outcome])
        self.record(self.breaker.settled(probe, self.clock.now()))

    def call(self, ok: bool, error_class: str = "server_error", *, retry_of: str = "") -> None:
        """One attempt (``retry_of``: the failed attempt of the same call it retries)."""
        self.end(self.start(), ok, error_class, retry_of=retry_of)

    def open(self) -> None:
        for _ in range(SETTINGS.breaker_failure_threshold):
            self.call(ok=False)
        assert self.breaker.state.status == "open"


@pytest.fixture
def harness(lmdb_store: EventStore, clock: FakeClock) -> Harness:
    return Harness(lmdb_store, clock)


def test_opens_after_five_consecutive_failures(harness: Harness) -> None:
    for _ in range(4):
        harness.call(ok=False)
    assert harness.breaker.state.status == "closed"
    harness.call(ok=True)  # a success resets the streak
    for _ in range(4):
        harness.call(ok=False)
    assert harness.breaker.state.status == "closed"
    harness.call(ok=False)
    assert harness.breaker.state.status == "open"
    with pytest.raises(BreakerOpenError) as info:
        harness.call(ok=True)
    assert info.value.kind == "breaker_open"
    assert not info.value.retryable


def test_rejected_calls_do_not_count(harness: Harness) -> None:
    harness.open()
    failures = harness.breaker.state.consecutive_failures
    for _ in range(10):
        with pytest.raises(BreakerOpenError):
            harness.call(ok=False)
    assert harness.breaker.state.consecutive_failures == failures


def test_half_open_exactly_at_the_reset_timeout_with_one_probe(harness: Harness) -> None:
    harness.open()
    harness.clock.advance(60 - 0.001)
    with pytest.raises(BreakerOpenError):
        harness.call(ok=True)
    harness.clock.advance(0.001)
    harness.record(harness.breaker.due(harness.clock.now()))
    assert harness.breaker.state.status == "half_open"
    assert harness.breaker.admit() is True  # the probe
    with pytest.raises(BreakerOpenError, match="half-open"):
        harness.breaker.admit()  # a concurrent caller is refused at once
    harness.end(True, ok=True)
    assert harness.breaker.state.status == "closed"
    assert harness.breaker.admit() is False


def test_a_failed_probe_opens_again(harness: Harness) -> None:
    harness.open()
    harness.clock.advance(60)
    harness.call(ok=False)
    assert harness.breaker.state.status == "open"
    assert harness.breaker.state.opened_at == harness.clock.now()


def test_breaker_state_is_rebuilt_from_the_log(store_dir: Path, clock: FakeClock) -> None:
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        harness = Harness(store, clock)
        for _ in range(5):
            harness.call(ok=False)
    with store_module.open(store_dir, clock=clock) as store:  # type: ignore[attr-defined]
        again = Harness(store, clock)
        assert again.breaker.state.status == "open"
        with pytest.raises(BreakerOpenError):
            again.call(ok=True)
        types = [r.type for r in store.read_stream("provider:p")]
    assert types.count("breaker:opened") == 1
    assert types[-1] == "breaker:opened"


@pytest.mark.parametrize(
    "error_class", ["bad_request", "context_overflow", "content_policy", "not_found"]
)
def test_the_callers_own_mistakes_do_not_open_the_breaker(
    harness: Harness, error_class: str
) -> None:
    for _ in range(10):
        harness.call(ok=False, error_class=error_class)
    assert harness.breaker.state.status == "closed"
    assert harness.breaker.state.consecutive_failures == 0
    for _ in range(4):
        harness.call(ok=False)
    harness.call(ok=False, error_class=error_class)  # neither counts nor breaks the streak
    assert harness.breaker.state.consecutive_failures == 4
    harness.call(ok=False)
    assert harness.breaker.state.status == "open"


def test_a_callers_mistake_is_no_answer_to_the_probe(harness: Harness) -> None:
    harness.open()
    harness.clock.advance(60)
    harness.call(ok=False, error_class="bad_request")  # the probe: neither good nor bad news
    assert harness.breaker.state.status == "half_open"
    harness.call(ok=True)  # the next call is the probe again
    assert harness.breaker.state.status == "closed"


def test_a_call_is_one_failure_however_many_attempts_it_takes(harness: Harness) -> None:
    """Retries on the same model are inside one call (seed 000's SDK retries): five
    calls of three failed attempts each open the breaker, not the second call."""
    for _ in range(4):
        harness.call(ok=False)
        harness.call(ok=False, retry_of="first")
        harness.call(ok=False, retry_of="second")
    assert harness.breaker.state.status == "closed"
    assert harness.breaker.state.consecutive_failures == 4
    harness.call(ok=False)
    assert harness.breaker.state.status == "open"


def test_a_retry_that_succeeds_ends_the_streak(harness: Harness) -> None:
    for _ in range(4):
        harness.call(ok=False)
    harness.call(ok=True, retry_of="the fourth")
    assert harness.breaker.state.consecutive_failures == 0


def test_a_failed_probe_is_the_probes_answer_whatever_attempt_it_is(harness: Harness) -> None:
    harness.open()
    harness.clock.advance(60)
    harness.call(ok=False, retry_of="an attempt from before the breaker opened")
    assert harness.breaker.state.status == "open"
    assert harness.breaker.state.opened_at == harness.clock.now()


@pytest.mark.parametrize("ok", [True, False])
def test_a_call_from_before_the_breaker_opened_is_no_answer_to_the_probe(
    harness: Harness, ok: bool
) -> None:
    """A call admitted while the breaker was closed (a long stream, say) may end while it
    is half-open: whether it succeeded says nothing of the provider now, so only the
    probe's outcome closes or opens the breaker again."""
    early = harness.start()
    assert early is False
    harness.open()
    harness.clock.advance(60)
    probe = harness.start()
    assert probe is True
    harness.end(early, ok=ok)
    assert harness.breaker.state.status == "half_open"
    with pytest.raises(BreakerOpenError, match="half-open"):
        harness.start()  # the probe is still in flight
    harness.end(probe, ok=True)
    assert harness.breaker.state.status == "closed"


def test_a_failure_from_before_the_breaker_opened_still_counts_after_the_probe_fails(
    harness: Harness,
) -> None:
    early = harness.start()
    harness.open()
    harness.clock.advance(60)
    probe = harness.start()
    harness.end(early, ok=False)
    harness.end(probe, ok=False)
    state = harness.breaker.state
    assert (state.status, state.opened_at) == ("open", harness.clock.now())
    opened = [r.event for r in harness.store.read_stream("provider:p")][-1]
    assert isinstance(opened, BreakerOpened)
    assert opened.failures == SETTINGS.breaker_failure_threshold + 2


def test_an_outcome_recorded_before_outcomes_named_the_probe_still_answers_it(
    harness: Harness,
) -> None:
    """A log written before ``probe`` existed: any outcome while half-open was the
    probe's answer, and folding that log again decides as it did then."""
    harness.open()
    harness.clock.advance(60)
    harness.record(harness.breaker.due(harness.clock.now()))
    assert harness.breaker.state.status == "half_open"
    harness.record([ProviderCallSucceeded(provider="p", model="m", agent="a")])
    assert harness.breaker.state.probe_outcome == "success"
    harness.record(harness.breaker.settled(False, harness.clock.now()))
    assert harness.breaker.state.status == "closed"
