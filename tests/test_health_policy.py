"""Provider health: degraded / recovered from a fold of the provider stream, exact windows."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.config import Config, HealthSettings
from stalwart.errors import ConfigError
from stalwart.events import (
    BreakerOpened,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    ProviderRecovered,
)
from stalwart.state import (
    HEALTH,
    PROBE_AGENT,
    HealthAggregate,
    HealthState,
    decide_health,
    fold,
    health_deadline,
)
from tests._log import FoldedLog

T0 = 1_700_000_000.0
MS = 0.001
H = HealthSettings()
KNOBS = {
    "window_ms": H.window_ms,
    "min_agents": H.min_agents,
    "consecutive": H.consecutive_failures,
}


def failed(agent: str, *, call_id: str = "", retry_of: str = "") -> ProviderCallFailed:
    return ProviderCallFailed(
        provider="p",
        model="m",
        agent=agent,
        error_class="server_error",
        call_id=call_id,
        retry_of=retry_of,
    )


def succeeded(agent: str, *, retry_of: str = "") -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="p", model="m", agent=agent, retry_of=retry_of)


class Log(FoldedLog[HealthState]):
    def __init__(self, aggregate: HealthAggregate = HEALTH) -> None:
        super().__init__(aggregate, "provider:p")


def test_the_seeds_numbers_are_the_defaults() -> None:
    assert Config().health == H
    assert (H.window_ms, H.min_agents, H.consecutive_failures) == (60_000, 2, 3)
    assert HEALTH.initial("provider:p").horizon_ms == 60_000


def test_failures_from_two_agents_within_the_window_degrade_once() -> None:
    log = Log()
    state = log.add(failed("a"), T0)
    assert decide_health(state, T0, **KNOBS) == []
    state = log.add(failed("b"), T0 + 60 - MS)
    decided = decide_health(state, T0 + 60 - MS, **KNOBS)
    assert decided == [
        ProviderDegraded(
            provider="p", rule="agents", agents=("a", "b"), failures=2, window_ms=60_000
        )
    ]
    state = log.add(decided[0], T0 + 60 - MS)
    assert state.status == "degraded"
    state = log.add(failed("c"), T0 + 61)
    assert decide_health(state, T0 + 61, **KNOBS) == []  # once per episode


def test_failures_exactly_one_window_apart_do_not_combine() -> None:
    log = Log()
    log.add(failed("a"), T0)
    state = log.add(failed("b"), T0 + 60)
    assert decide_health(state, T0 + 60, **KNOBS) == []


def test_three_consecutive_failures_from_one_agent_degrade() -> None:
    log = Log()
    log.add(failed("a"), T0)
    state = log.add(failed("a"), T0 + 1)
    assert decide_health(state, T0 + 1, **KNOBS) == []
    state = log.add(failed("a"), T0 + 2)
    assert decide_health(state, T0 + 2, **KNOBS) == [
        ProviderDegraded(
            provider="p", rule="consecutive", agents=("a",), failures=3, window_ms=60_000
        )
    ]


def test_a_success_breaks_the_streak_and_old_failures_leave_the_window() -> None:
    log = Log()
    log.add(failed("a"), T0)
    log.add(failed("a"), T0 + 1)
    log.add(succeeded("a"), T0 + 2)
    state = log.add(failed("a"), T0 + 3)
    assert decide_health(state, T0 + 3, **KNOBS) == []
    log = Log()
    log.add(failed("a"), T0)
    log.add(failed("a"), T0 + 30)
    state = log.add(failed("a"), T0 + 60)  # the first one is exactly a window old
    assert decide_health(state, T0 + 60, **KNOBS) == []
    log = Log()
    log.add(failed("a"), T0)
    log.add(failed("a"), T0 + 30)
    state = log.add(failed("a"), T0 + 60 - MS)
    assert len(decide_health(state, T0 + 60 - MS, **KNOBS)) == 1


def _degraded(log: Log, at: float) -> HealthState:
    log.add(failed("a"), at)
    log.add(failed("b"), at)
    [decided] = decide_health(log.state, at, **KNOBS)
    return log.add(decided, at)


def test_recovery_after_a_quiet_window_exactly() -> None:
    log = Log()
    state = _degraded(log, T0)
    assert health_deadline(state, window_ms=60_000) == T0 + 60
    state = log.add(failed("a"), T0 + 30)  # still failing: the quiet window restarts
    deadline = T0 + 90
    assert health_deadline(state, window_ms=60_000) == deadline
    assert decide_health(state, deadline - MS, **KNOBS) == []
    assert decide_health(state, deadline, **KNOBS) == [
        ProviderRecovered(provider="p", rule="quiet_window")
    ]
    state = log.add(ProviderRecovered(provider="p"), deadline)
    assert (state.status, state.failures) == ("healthy", ())
    assert health_deadline(state, window_ms=60_000) is None
    assert decide_health(state, deadline + 1, **KNOBS) == []


@pytest.mark.parametrize(("agent", "rule"), [(PROBE_AGENT, "probe"), ("a", "success")])
def test_a_success_while_degraded_recovers_at_once(agent: str, rule: str) -> None:
    log = Log()
    _degraded(log, T0)
    state = log.add(succeeded(agent), T0 + 5)
    decided = decide_health(state, T0 + 5, **KNOBS)
    assert decided == [ProviderRecovered(provider="p", rule=rule)]  # type: ignore[arg-type]
    state = log.add(decided[0], T0 + 5)
    assert decide_health(state, T0 + 5, **KNOBS) == []  # the old failures do not count again


def test_memory_stays_bounded_by_the_horizon() -> None:
    log = Log()
    for i in range(2_000):  # one failure a second from one agent, a success after each
        log.add(failed("a"), T0 + i)
        log.add(succeeded("a"), T0 + i + 0.5)
        log.add(BreakerOpened(provider="p", failures=1, threshold=5), T0 + i + 0.5)
    state = log.state
    assert len(state.failures) <= 61
    assert len(state.successes) == 1


def test_a_window_wider_than_the_fold_remembers_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        decide_health(
            HEALTH.initial("provider:p"), T0, window_ms=120_000, min_agents=2, consecutive=3
        )
    assert info.value.key == "health.window_ms"
    wide = HealthAggregate(horizon_ms=120_000).initial("provider:p")
    assert decide_health(wide, T0, window_ms=120_000, min_agents=2, consecutive=3) == []


# -- properties ---------------------------------------------------------------------------

CALLS = st.lists(
    st.tuples(
        st.floats(0, 90, allow_nan=False),
        st.sampled_from(["a", "b", "c", PROBE_AGENT]),
        st.sampled_from([True, False, False, None]),  # None: a timer tick, no call
    ),
    max_size=60,
)


def _simulate(calls: list[tuple[float, str, bool | None]]) -> Log:
    log = Log()
    now = T0
    for gap, agent, ok in calls:
        now += gap
        if ok is not None:
            log.add(succeeded(agent) if ok else failed(agent), now)
        for event in decide_health(log.state, now, **KNOBS):
            log.add(event, now)
    return log


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, cut=st.integers(0, 200))
def test_fold_of_a_prefix_then_the_rest_is_the_fold_of_all(
    calls: list[tuple[float, str, bool | None]], cut: int
) -> None:
    records = _simulate(calls).records
    cut = min(cut, len(records))
    prefix = fold(HEALTH, "provider:p", records[:cut])
    assert fold(HEALTH, "provider:p", records[cut:], prefix) == fold(HEALTH, "provider:p", records)


@settings(max_examples=150, deadline=None)
@given(calls=CALLS)
def test_every_decision_replays_and_episodes_alternate(
    calls: list[tuple[float, str, bool | None]],
) -> None:
    records = _simulate(calls).records
    kinds = []
    for index, record in enumerate(records):
        if isinstance(record.event, ProviderDegraded | ProviderRecovered):
            before = fold(HEALTH, "provider:p", records[:index])
            assert decide_health(before, record.ts, **KNOBS) == [record.event]
            kinds.append(type(record.event))
    assert all(a is not b for a, b in itertools.pairwise(kinds))
    assert not kinds or kinds[0] is ProviderDegraded


def test_the_callers_own_mistakes_never_degrade_a_provider() -> None:
    log = Log()
    for index, agent in enumerate(["a", "b", "a", "a", "b"]):
        mistake = ProviderCallFailed(
            provider="p", model="m", agent=agent, error_class="context_overflow"
        )
        state = log.add(mistake, T0 + index)
        assert decide_health(state, T0 + index, **KNOBS) == []
    assert state.failures == ()
    state = log.add(failed("a"), T0 + 10)  # a real failure still counts
    assert len(state.failures) == 1


def test_a_call_is_one_failure_however_many_attempts_it_took() -> None:
    """One agent's turn whose three attempts fail (``max_retries`` 2) is one failed call,
    not the three in a row that degrade the provider: seed 000's SDK retries are inside
    one call. Three such calls are."""
    log = Log()
    for call in range(3):
        at = T0 + 10 * call
        state = log.add(failed("a", call_id=f"{call}.1"), at)
        assert len(state.failures) == call + 1  # counted from its first failed attempt
        log.add(failed("a", call_id=f"{call}.2", retry_of=f"{call}.1"), at + 1)
        state = log.add(failed("a", call_id=f"{call}.3", retry_of=f"{call}.2"), at + 2)
        expected = (
            []
            if call < 2
            else [
                ProviderDegraded(
                    provider="p", rule="consecutive", agents=("a",), failures=3, window_ms=60_000
                )
            ]
        )
        assert decide_health(state, at + 2, **KNOBS) == expected
    assert [m.ts for m in state.failures] == [T0, T0 + 10, T0 + 20]  # each call from its start


def test_a_retry_that_succeeds_takes_its_calls_failure_back() -> None:
    """Agent a's call fails once and its retry succeeds; agent b's call fails: one
    agent's failure in the window, not two."""
    log = Log()
    log.add(failed("a", call_id="a1"), T0)
    log.add(succeeded("a", retry_of="a1"), T0 + 1)
    state = log.add(failed("b", call_id="b1"), T0 + 2)
    assert [m.agent for m in state.failures] == ["b"]
    assert decide_health(state, T0 + 2, **KNOBS) == []


def test_a_failed_attempt_whose_retry_never_comes_stays_a_failed_call() -> None:
    """A call cut during its retry's backoff (a turn's execution timeout, an interrupt,
    a crash), or whose retry the breaker refuses, records no more: its first failure is
    still the call's. Three of them in a row degrade the provider."""
    log = Log()
    for call in range(3):
        state = log.add(failed("a", call_id=f"c{call}"), T0 + call)
    assert decide_health(state, T0 + 2, **KNOBS)[0].rule == "consecutive"
