"""The prompt deadline as a pure decision, driven by a FakeClock: exact boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.clock import FakeClock
from stalwart.events import PromptStarted
from stalwart.state import decide_prompt_timeout, next_deadline, window_started, window_touched

MS = 0.001


def _primary(clock: FakeClock, timeout_ms: int = 180_000, multiplier: int = 10) -> object:
    started = PromptStarted(
        call_id="c",
        provider="p",
        model="m",
        deadline_kind="stall",
        timeout_ms=timeout_ms,
        makespan_ms=timeout_ms * multiplier,
    )
    return window_started(started, clock.now())


def test_stall_fires_exactly_at_the_budget() -> None:
    clock = FakeClock()
    window = _primary(clock)
    clock.advance(180 - MS)
    assert decide_prompt_timeout(window, clock.now()) is None  # type: ignore[arg-type]
    clock.advance(MS)
    decision = decide_prompt_timeout(window, clock.now())  # type: ignore[arg-type]
    assert decision is not None
    assert (decision.limit, decision.knob, decision.limit_ms) == (
        "stall",
        "prompt_timeout_ms",
        180_000,
    )
    assert decision.elapsed_ms == 180_000


def test_recorded_activity_restarts_the_stall_budget() -> None:
    clock = FakeClock()
    window = _primary(clock)
    for _ in range(5):  # a slow but steady stream: activity every 170 s
        clock.advance(170)
        window = window_touched(window, clock.now())  # type: ignore[arg-type]
        assert decide_prompt_timeout(window, clock.now()) is None
    clock.advance(180 - MS)
    assert decide_prompt_timeout(window, clock.now()) is None
    clock.advance(MS)
    assert decide_prompt_timeout(window, clock.now()).limit == "stall"  # type: ignore[union-attr]


def test_makespan_bounds_a_trickle() -> None:
    clock = FakeClock()
    window = _primary(clock, timeout_ms=1000, multiplier=10)
    while clock.now() - 1_700_000_000.0 < 10 - 0.5:
        clock.advance(0.5)
        window = window_touched(window, clock.now())  # type: ignore[arg-type]
        assert decide_prompt_timeout(window, clock.now()) is None
    clock.advance(0.5)
    decision = decide_prompt_timeout(window, clock.now())  # type: ignore[arg-type]
    assert decision is not None
    assert (decision.limit, decision.limit_ms) == ("makespan", 10_000)
    assert decision.knob == "prompt_timeout_ms x stall_ceiling_multiplier"


def test_retry_calls_have_a_whole_call_limit_that_activity_does_not_reset() -> None:
    clock = FakeClock()
    started = PromptStarted(
        call_id="c",
        provider="p",
        model="m",
        attempt=2,
        deadline_kind="whole_call",
        timeout_ms=60_000,
    )
    window = window_started(started, clock.now())
    clock.advance(59.999)
    window = window_touched(window, clock.now())
    assert decide_prompt_timeout(window, clock.now()) is None
    clock.advance(MS)
    decision = decide_prompt_timeout(window, clock.now())
    assert decision is not None
    assert (decision.limit, decision.knob) == ("retry_deadline", "retry_prompt_timeout_ms")


def test_activity_never_moves_the_window_backwards() -> None:
    clock = FakeClock()
    window = _primary(clock)
    clock.advance(10)
    later = window_touched(window, clock.now())  # type: ignore[arg-type]
    assert window_touched(later, clock.now() - 5) is later


@settings(max_examples=200, deadline=None)
@given(
    timeout_ms=st.integers(min_value=1, max_value=10_000_000),
    multiplier=st.integers(min_value=1, max_value=20),
    gaps=st.lists(st.floats(min_value=0, max_value=1000, allow_nan=False), max_size=20),
)
def test_the_decision_is_exactly_the_next_deadline(
    timeout_ms: int, multiplier: int, gaps: list[float]
) -> None:
    clock = FakeClock()
    window = _primary(clock, timeout_ms, multiplier)
    for gap in gaps:
        when, _, _ = next_deadline(window)  # type: ignore[arg-type]
        now = clock.now() + gap
        decided = decide_prompt_timeout(window, now)  # type: ignore[arg-type]
        assert (decided is not None) == (now >= when)
        if decided is not None:
            return
        clock.advance(gap)
        window = window_touched(window, clock.now())  # type: ignore[arg-type]
