"""The dead-letter queue: fold of the ``deadletter`` stream, backoff, expiry and drain."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.config import Config, DeadLetterSettings
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
)
from stalwart.state import (
    DEADLETTER,
    DeadLetterState,
    aggregate_for,
    decide_drain,
    decide_expiry,
    decide_retries,
    expiry_at,
    fold,
    next_retry_at,
)
from tests._log import FoldedLog

T0 = 1_700_000_000.0
MS = 0.001
D = DeadLetterSettings()
RETRY = {"max_retries": D.max_retries, "base_ms": D.retry_base_ms, "cap_ms": D.retry_cap_ms}
EXPIRY = {"max_age_ms": D.max_age_ms, "max_retries": D.max_retries}


class Log(FoldedLog[DeadLetterState]):
    def __init__(self) -> None:
        super().__init__(DEADLETTER, "deadletter")


def lettered(entry: str, announcement: str | None = None) -> AnnouncementDeadLettered:
    return AnnouncementDeadLettered(
        entry_id=entry,
        announcement_id=announcement or f"an-{entry}",
        channel="chat:1",
        text="The sub-agent task did not complete.",
        reason="channel_unreachable",
    )


def retry_failed(entry: str) -> AnnouncementSendFailed:
    return AnnouncementSendFailed(
        announcement_id=f"an-{entry}", error_class="connect", entry_id=entry
    )


def test_the_seeds_numbers_are_the_defaults() -> None:
    assert Config().dead_letters == D
    assert (D.max_retries, D.max_age_ms) == (5, 3_600_000)
    assert (D.retry_base_ms, D.retry_cap_ms) == (30_000, 600_000)
    assert aggregate_for("deadletter") is DEADLETTER


def test_retries_back_off_exponentially_from_the_last_attempt() -> None:
    log = Log()
    state = log.add(lettered("x"), T0)
    assert (state.entries[0].enqueued_at, state.entries[0].attempts) == (T0, 0)
    now = T0
    for wait in (30, 60, 120, 240, 480):  # base 30 s, doubling, under the 10-minute cap
        assert next_retry_at(state, **RETRY) == now + wait
        assert decide_retries(state, now + wait - MS, **RETRY) == []
        attempt = state.entries[0].attempts + 1
        retried = AnnouncementDeadLetterRetried(entry_id="x", attempt=attempt)
        assert decide_retries(state, now + wait, **RETRY) == [retried]
        assert decide_retries(state, now + wait, **RETRY, busy={"x"}) == []  # in flight
        now += wait
        state = log.add(retry_failed("x"), now)
    assert state.entries[0].attempts == 5
    assert decide_retries(state, now + 10_000, **RETRY) == []  # five retries, no more
    assert next_retry_at(state, **RETRY) is None


def test_the_backoff_is_capped() -> None:
    log = Log()
    log.add(lettered("x"), T0)
    for i in range(6):
        log.add(retry_failed("x"), T0 + i)
    state = log.state
    assert next_retry_at(state, max_retries=10, base_ms=30_000, cap_ms=600_000) == T0 + 5 + 600


def test_exhausted_retries_expire_with_an_event() -> None:
    log = Log()
    log.add(lettered("x"), T0)
    for i in range(4):
        log.add(retry_failed("x"), T0 + i)
    assert decide_expiry(log.state, T0 + 10, **EXPIRY) == []
    assert expiry_at(log.state, max_age_ms=D.max_age_ms, max_retries=5) == T0 + 3600
    state = log.add(retry_failed("x"), T0 + 10)
    # due at once: at the failure that spent the last retry, long before the hour is up
    assert expiry_at(state, max_age_ms=D.max_age_ms, max_retries=5) == T0 + 10
    assert decide_expiry(state, T0 + 10, **EXPIRY) == [
        AnnouncementDeadLetterExpired(
            entry_id="x",
            age_ms=10_000,
            max_age_ms=3_600_000,
            attempts=5,
            reason="retries_exhausted",
            max_retries=5,
        )
    ]


def test_entries_expire_exactly_at_one_hour() -> None:
    log = Log()
    log.add(lettered("x"), T0)
    state = log.add(lettered("y"), T0 + 10)
    assert expiry_at(state, max_age_ms=D.max_age_ms, max_retries=5) == T0 + 3600
    assert decide_expiry(state, T0 + 3600 - MS, **EXPIRY) == []
    expired = decide_expiry(state, T0 + 3600, **EXPIRY)
    assert expired == [
        AnnouncementDeadLetterExpired(
            entry_id="x", age_ms=3_600_000, max_age_ms=3_600_000, reason="max_age", max_retries=5
        )
    ]
    state = log.add(expired[0], T0 + 3600)
    assert ([e.entry_id for e in state.entries], state.expired) == (["y"], 1)


def test_delivery_removes_the_entry_and_a_drain_takes_every_entry_in_order() -> None:
    log = Log()
    for i, name in enumerate(["c", "a", "b"]):
        log.add(lettered(name), T0 + i)
    state = log.state

    def drained(state: DeadLetterState, busy: tuple[str, ...] = ()) -> list[str]:
        decided = decide_drain(state, "p", busy=busy)
        assert all((e.reason, e.provider, e.attempt) == ("drain", "p", 1) for e in decided)
        return [e.entry_id for e in decided]

    assert drained(state) == ["c", "a", "b"]  # enqueue order, due or not
    assert drained(state, busy=("a",)) == ["c", "b"]  # a send in flight is not doubled
    state = log.add(AnnouncementDeadLetterDelivered(entry_id="a", attempts=1), T0 + 5)
    assert (drained(state), state.delivered) == (["c", "b"], 1)
    unknown = log.add(AnnouncementDeadLetterDelivered(entry_id="zz", attempts=1), T0 + 6)
    assert (unknown.delivered, len(unknown.entries)) == (1, 2)
    assert drained(DEADLETTER.initial("deadletter")) == []


def test_a_send_failure_without_an_entry_id_matches_the_announcement() -> None:
    log = Log()
    log.add(lettered("x", "an-1"), T0)
    log.add(lettered("y", "an-2"), T0)
    state = log.add(AnnouncementSendFailed(announcement_id="an-2", error_class="timeout"), T0 + 1)
    assert [(e.entry_id, e.attempts, e.last_error) for e in state.entries] == [
        ("x", 0, None),
        ("y", 1, "timeout"),
    ]
    state = log.add(AnnouncementSendFailed(announcement_id="an-9", error_class="t"), T0 + 2)
    assert [e.attempts for e in state.entries] == [0, 1]


# -- properties ---------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "d"])
STEPS = st.lists(
    st.tuples(
        st.floats(0, 900, allow_nan=False),
        st.one_of(
            st.builds(lettered, NAMES),
            st.builds(retry_failed, NAMES),
            st.builds(retry_failed, st.sampled_from(["a", "b"])),
            st.builds(AnnouncementDeadLetterDelivered, entry_id=NAMES, attempts=st.just(1)),
        ),
    ),
    max_size=50,
)


def _simulate(steps: list[tuple[float, Event]]) -> Log:
    log = Log()
    now = T0
    for gap, event in steps:
        now += gap
        log.add(event, now)
        for expired in decide_expiry(log.state, now, **EXPIRY):
            log.add(expired, now)
    return log


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, cut=st.integers(0, 100))
def test_fold_of_a_prefix_then_the_rest_is_the_fold_of_all(
    steps: list[tuple[float, Event]], cut: int
) -> None:
    records = _simulate(steps).records
    cut = min(cut, len(records))
    prefix = fold(DEADLETTER, "deadletter", records[:cut])
    assert fold(DEADLETTER, "deadletter", records[cut:], prefix) == fold(
        DEADLETTER, "deadletter", records
    )


@settings(max_examples=150, deadline=None)
@given(steps=STEPS)
def test_expiry_decisions_replay_and_nothing_outlives_its_limits(
    steps: list[tuple[float, Event]],
) -> None:
    log = _simulate(steps)
    records = log.records
    index = 0
    while index < len(records):  # a run of expiries is one decision, made on one state
        end = index
        while end < len(records) and isinstance(records[end].event, AnnouncementDeadLetterExpired):
            end += 1
        if end > index:
            before = fold(DEADLETTER, "deadletter", records[:index])
            decided = decide_expiry(before, records[index].ts, **EXPIRY)
            assert decided == [r.event for r in records[index:end]]
        index = max(end, index + 1)
    end = records[-1].ts if records else T0
    for entry in log.state.entries:
        assert entry.attempts < D.max_retries
        assert end < entry.enqueued_at + 3600
