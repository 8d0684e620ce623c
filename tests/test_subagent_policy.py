"""Sub-agent runs: the fold, spawn timeouts, watchdog, ghost sweep, heartbeat and recovery.

Ten-minute timers tested in milliseconds: boundaries are exact (nothing at deadline - 1 ms,
the decision at the deadline).
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.config import Config, SubagentSettings, parse_config
from stalwart.errors import ConfigError, SpawnRefusedError, StalwartError
from stalwart.events import (
    Event,
    MessageAppended,
    RecordedEvent,
    SessionCreated,
    SubagentArtifact,
    SubagentCompleted,
    SubagentGhostSwept,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentSuspicious,
    SubagentWatchdogTimeout,
    TaskClass,
)
from stalwart.state import (
    RUN,
    SESSION,
    STEP_KNOB,
    RunState,
    aggregate_for,
    apply_run,
    decide_ghost,
    decide_recovery,
    decide_suspicious,
    decide_watchdog,
    fold,
    ghost_deadline,
    spawn_timeout,
    suspicious_at,
    watchdog_deadline,
)
from tests._log import FoldedLog

T0 = 1_700_000_000.0
MS = 0.001
S = SubagentSettings()
CLASSES = msgspec.structs.asdict(S.class_timeouts_ms)
KNOBS = {
    "per_step_timeout_ms": S.per_step_timeout_ms,
    "expected_fraction": S.expected_fraction,
    "heartbeat_interval_ms": S.heartbeat_interval_ms,
}


class Log(FoldedLog[RunState]):
    """A run's stream with chosen timestamps, folded as it grows."""

    def __init__(self) -> None:
        super().__init__(RUN, "session:run")


def spawned(
    log: Log,
    *,
    task_class: TaskClass = "research",
    timeout_ms: int = 600_000,
    max_steps: int | None = None,
    attempt: int = 1,
    knob: str = "",
) -> RunState:
    event = SubagentSpawned(
        parent="session:parent",
        task="summarise",
        task_class=task_class,
        timeout_ms=timeout_ms,
        max_steps=max_steps,
        attempt=attempt,
        timeout_knob=knob,
    )
    return log.add(event, T0)


def timeout(task_class: str | None, custom: int | None = None, reason: str | None = None) -> object:
    return spawn_timeout(
        task_class,
        custom,
        reason,
        class_timeouts_ms=CLASSES,
        custom_max_ms=S.custom_max_ms,
        default_ms=S.max_run_timeout_ms,
    )


# -- config: the seeds' numbers -----------------------------------------------------------


def test_the_seeds_numbers_are_the_defaults() -> None:
    assert Config().subagents == S
    assert (S.per_step_timeout_ms, S.max_run_timeout_ms, S.ghost_grace_ms) == (
        60_000,
        600_000,
        120_000,
    )
    assert (S.ghost_sweep_interval_ms, S.heartbeat_interval_ms) == (60_000, 60_000)
    assert CLASSES == {"formatting": 120_000, "code": 300_000, "research": 600_000, "deep": 900_000}
    assert S.custom_max_ms == 1_800_000
    assert (S.expected_fraction, S.recovery_max_attempts) == (0.5, 2)
    assert Config().supervision.execution_timeout_ms == 600_000
    assert Config().dead_letters.announce_timeout_ms == 30_000


def test_subagent_config_loads_and_names_bad_keys() -> None:
    config = parse_config({"subagents": {"class_timeouts_ms": {"code": 240_000}}})
    assert config.subagents.class_timeouts_ms.code == 240_000
    assert config.subagents.class_timeouts_ms.deep == 900_000
    for data, key in [
        ({"subagents": {"class_timeouts_ms": {"cod": 1}}}, "subagents.class_timeouts_ms.cod"),
        ({"subagents": {"per_step_timeout_ms": 0}}, "subagents.per_step_timeout_ms"),
        ({"subagents": {"expected_fraction": 1.5}}, "subagents.expected_fraction"),
        ({"subagents": {"custom_max_ms": 60_000}}, "subagents.custom_max_ms"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse_config(data, source="app.toml")
        assert info.value.key == key
        assert key in str(info.value)


# -- spawn timeouts -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_class", "expected"),
    [("formatting", 120_000), ("code", 300_000), ("research", 600_000), ("deep", 900_000)],
)
def test_every_task_class_has_its_timeout(task_class: str, expected: int) -> None:
    assert timeout(task_class) == (expected, f"class_timeouts_ms.{task_class}")


def test_a_custom_timeout_up_to_thirty_minutes_with_a_reason() -> None:
    assert timeout(None, 1_800_000, "a long crawl") == (1_800_000, "custom_timeout_ms")
    assert timeout("custom", 1, "tiny") == (1, "custom_timeout_ms")


def test_a_spawn_naming_neither_still_gets_the_run_limit() -> None:
    assert timeout(None) == (600_000, "max_run_timeout_ms")


@pytest.mark.parametrize(
    ("args", "field", "words"),
    [
        ((None, 1_800_001, "long"), "custom_timeout_ms", "1800000"),
        ((None, 0, "zero"), "custom_timeout_ms", "found 0"),
        ((None, 60_000, None), "reason", "reason"),
        (("custom", 60_000, "   "), "reason", "reason"),
        (("custom", None, "why"), "custom_timeout_ms", "custom_timeout_ms"),
        (("code", 60_000, "why"), "custom_timeout_ms", "not both"),
        (("chat", None, None), "task_class", "'formatting'"),
    ],
)
def test_a_spawn_without_a_valid_timeout_is_refused(
    args: tuple[str | None, int | None, str | None], field: str, words: str
) -> None:
    with pytest.raises(SpawnRefusedError) as info:
        timeout(*args)
    assert isinstance(info.value, StalwartError)
    assert info.value.field == field
    assert words in str(info.value)


# -- the fold -----------------------------------------------------------------------------


def test_the_fold_records_the_run() -> None:
    log = Log()
    state = spawned(log, task_class="code", timeout_ms=300_000, max_steps=4)
    assert state.status == "running"
    assert (state.parent, state.task_class, state.timeout_ms, state.max_steps) == (
        "session:parent",
        "code",
        300_000,
        4,
    )
    assert (state.started_at, state.tokens_grew_at) == (T0, T0)
    assert state.timeout_knob == "class_timeouts_ms.code"  # derived for logs without the knob
    log.add(SubagentProgress(tokens=100, step=1), T0 + 5)
    log.add(MessageAppended(message_id="m", role="assistant", content="x"), T0 + 6)
    state = log.add(SubagentProgress(tokens=100, step=2), T0 + 7)
    assert (state.tokens, state.step, state.tokens_grew_at, state.version) == (100, 2, T0 + 5, 4)
    state = log.add(SubagentCompleted(result="done"), T0 + 9)
    assert (state.status, state.ended_at, state.result) == ("succeeded", T0 + 9, "done")


def test_runs_replay_with_the_run_fold_when_their_first_event_is_the_spawn() -> None:
    assert aggregate_for("session:run") is SESSION  # by name alone: a session
    spawn = SubagentSpawned(parent="p", task="t", task_class="code", timeout_ms=1)
    assert aggregate_for("session:run", spawn) is RUN
    assert aggregate_for("session:chat", SessionCreated()) is SESSION


# -- watchdog -----------------------------------------------------------------------------


def test_watchdog_fires_exactly_at_the_run_limit_and_once() -> None:
    log = Log()
    state = spawned(log, timeout_ms=600_000, knob="max_run_timeout_ms")
    deadline = T0 + 600
    assert watchdog_deadline(state, per_step_timeout_ms=60_000) == deadline
    assert decide_watchdog(state, deadline - MS, per_step_timeout_ms=60_000) == []
    decided = decide_watchdog(state, deadline, per_step_timeout_ms=60_000)
    assert decided == [
        SubagentWatchdogTimeout(
            deadline=deadline, limit_ms=600_000, knob="max_run_timeout_ms", elapsed_ms=600_000
        )
    ]
    state = log.add(decided[0], deadline)
    assert (state.status, state.ended_at) == ("timed_out", deadline)
    assert decide_watchdog(state, deadline + 1000, per_step_timeout_ms=60_000) == []
    assert watchdog_deadline(state, per_step_timeout_ms=60_000) is None


def test_a_late_completion_does_not_change_the_outcome() -> None:
    log = Log()
    spawned(log, timeout_ms=120_000)
    log.add(
        SubagentWatchdogTimeout(deadline=T0 + 120, limit_ms=1, knob="k", elapsed_ms=1), T0 + 120
    )
    state = log.add(SubagentCompleted(result="the analysis"), T0 + 130)
    assert (state.status, state.ended_at) == ("timed_out", T0 + 120)
    assert state.late_completion
    assert state.result == "the analysis"


@pytest.mark.parametrize(
    ("max_steps", "limit_ms", "knob"),
    [
        (3, 180_000, STEP_KNOB),  # 3 x 60 s < 10 min: the step budget binds
        (10, 600_000, "class_timeouts_ms.research"),  # equal: the run limit
        (20, 600_000, "class_timeouts_ms.research"),  # 20 min > 10 min: the run limit
        (None, 600_000, "class_timeouts_ms.research"),  # unset: the run limit
    ],
)
def test_watchdog_is_the_smaller_of_the_step_budget_and_the_run_limit(
    max_steps: int | None, limit_ms: int, knob: str
) -> None:
    state = spawned(Log(), max_steps=max_steps)
    deadline = T0 + limit_ms / 1000
    assert decide_watchdog(state, deadline - MS, per_step_timeout_ms=60_000) == []
    [event] = decide_watchdog(state, deadline, per_step_timeout_ms=60_000)
    assert isinstance(event, SubagentWatchdogTimeout)
    assert (event.limit_ms, event.knob, event.deadline) == (limit_ms, knob, deadline)


def test_a_finished_run_has_no_watchdog() -> None:
    log = Log()
    spawned(log)
    state = log.add(SubagentCompleted(outcome="failed"), T0 + 1)
    assert state.status == "failed"
    assert decide_watchdog(state, T0 + 10_000, per_step_timeout_ms=60_000) == []
    assert decide_ghost(state, T0 + 10_000, ghost_grace_ms=120_000) == []
    assert decide_watchdog(Log().state, T0 + 10_000, per_step_timeout_ms=60_000) == []


# -- ghost sweep --------------------------------------------------------------------------


def test_a_run_left_running_is_swept_at_its_limit_plus_the_grace() -> None:
    log = Log()
    state = spawned(log)  # a crashed process: no watchdog event was ever written
    log.add(SubagentProgress(tokens=5), T0 + 1)
    state = log.state
    deadline = T0 + 720  # 600 s + 120 s: the seed's 12 minutes
    assert ghost_deadline(state, ghost_grace_ms=S.ghost_grace_ms) == deadline
    assert decide_ghost(state, deadline - MS, ghost_grace_ms=120_000) == []
    assert decide_ghost(state, deadline, ghost_grace_ms=120_000) == [
        SubagentGhostSwept(
            started_at=T0, grace_ms=120_000, elapsed_ms=720_000, limit_ms=600_000, deadline=deadline
        )
    ]
    state = log.add(SubagentGhostSwept(started_at=T0, grace_ms=1, elapsed_ms=1), deadline)
    assert state.status == "swept"
    assert decide_ghost(state, deadline + 60, ghost_grace_ms=120_000) == []


def test_a_watchdog_timeout_leaves_nothing_to_sweep() -> None:
    log = Log()
    spawned(log)
    [fired] = decide_watchdog(log.state, T0 + 600, per_step_timeout_ms=60_000)
    state = log.add(fired, T0 + 600)
    assert decide_ghost(state, T0 + 10_000, ghost_grace_ms=120_000) == []


# -- heartbeat ----------------------------------------------------------------------------


def test_frozen_tokens_past_the_expected_time_are_suspicious_once() -> None:
    log = Log()
    spawned(log)
    state = log.add(SubagentProgress(tokens=21_634), T0 + 10)
    due = T0 + 300  # expected: 0.5 x 600 s; frozen since T0 + 10, long past one interval
    assert suspicious_at(state, **KNOBS) == due
    assert decide_suspicious(state, due - MS, **KNOBS) == []
    assert decide_suspicious(state, due, **KNOBS) == [
        SubagentSuspicious(
            tokens=21_634,
            elapsed_ms=300_000,
            expected_ms=300_000,
            frozen_ms=290_000,
            interval_ms=60_000,
        )
    ]
    state = log.add(decide_suspicious(state, due, **KNOBS)[0], due)
    assert state.status == "running"  # detection only: never kills
    assert decide_suspicious(state, due + 120, **KNOBS) == []  # the same frozen episode
    state = log.add(SubagentProgress(tokens=21_700), due + 130)  # grows, then freezes again
    assert decide_suspicious(state, due + 190 - MS, **KNOBS) == []
    assert len(decide_suspicious(state, due + 190, **KNOBS)) == 1


def test_tokens_still_climbing_are_healthy_whatever_the_time() -> None:
    log = Log()
    spawned(log, timeout_ms=900_000)
    for i in range(1, 40):  # 20 minutes, a new token count every 30 s
        state = log.add(SubagentProgress(tokens=i * 500), T0 + i * 30)
        assert decide_suspicious(state, T0 + i * 30 + 30, **KNOBS) == []


def test_a_freeze_shorter_than_one_sweep_interval_is_not_suspicious() -> None:
    log = Log()
    spawned(log)
    state = log.add(SubagentProgress(tokens=9), T0 + 400)
    assert decide_suspicious(state, T0 + 460 - MS, **KNOBS) == []
    assert len(decide_suspicious(state, T0 + 460, **KNOBS)) == 1
    state = log.add(SubagentProgress(tokens=9), T0 + 450)  # the same count is not growth
    assert state.tokens_grew_at == T0 + 400


# -- recovery -----------------------------------------------------------------------------


def _failed_run(*events: tuple[Event, float], attempt: int = 1) -> RunState:
    log = Log()
    spawned(log, attempt=attempt)
    for event, ts in events:
        log.add(event, ts)
    return log.add(
        SubagentWatchdogTimeout(deadline=T0 + 600, limit_ms=1, knob="k", elapsed_ms=1), T0 + 600
    )


def _decide(state: RunState, *, can_split: bool = False) -> SubagentRecoveryDecided:
    [decided] = decide_recovery(state, max_attempts=2, can_split=can_split)
    assert isinstance(decided, SubagentRecoveryDecided)
    return decided


ART = SubagentArtifact(path="notes.md", sha256="ab")
FINAL = SubagentArtifact(path="analysis.md", sha256="cd", final=True)


def test_finished_work_is_delivered_not_redone() -> None:
    decided = _decide(_failed_run((FINAL, T0 + 100)))
    assert (decided.action, decided.reason) == ("deliver", "final_artifact")
    log = Log()
    spawned(log)
    log.add(SubagentGhostSwept(started_at=T0, grace_ms=1, elapsed_ms=1), T0 + 720)
    state = log.add(SubagentCompleted(result="the report"), T0 + 800)
    assert (_decide(state).action, _decide(state).reason) == ("deliver", "completed_result")


def test_partial_work_is_continued_with_context() -> None:
    decided = _decide(_failed_run((SubagentProgress(tokens=9, step=3), T0 + 9), (ART, T0 + 10)))
    assert (decided.action, decided.reason) == ("respawn_continue", "partial_work")
    assert decided.context == (
        "The last attempt completed steps 1-3 and saved notes.md. Pick up from step 4."
    )
    assert (decided.steps_done, decided.artifacts) == (3, ("notes.md",))
    only_steps = _decide(_failed_run((SubagentProgress(tokens=9, step=2), T0 + 9)))
    assert only_steps.context == "The last attempt completed steps 1-2. Pick up from step 3."
    only_files = _decide(_failed_run((ART, T0 + 9)))
    assert only_files.context == "The last attempt saved notes.md. Continue from where it stopped."


def test_nothing_done_is_respawned_and_a_second_failure_escalates() -> None:
    assert (_decide(_failed_run()).action, _decide(_failed_run()).reason) == ("respawn", "no_work")
    again = _failed_run((ART, T0 + 1), attempt=2)
    assert (_decide(again).action, _decide(again).reason) == ("escalate", "attempts_exhausted")
    assert _decide(again, can_split=True).action == "split"
    assert _decide(_failed_run((FINAL, T0 + 1), attempt=2)).action == "deliver"


def test_a_splits_subtask_escalates_when_exhausted_even_with_a_splitter() -> None:
    """A subtask's lineage (``split_from``) is never split again: a splitter that gives
    back its own task would split for ever."""
    again = msgspec.structs.replace(_failed_run((ART, T0 + 1), attempt=2), split_from="r0")
    decided = _decide(again, can_split=True)
    assert (decided.action, decided.reason) == ("escalate", "attempts_exhausted")


def test_host_code_the_process_does_not_hold_escalates_instead_of_a_respawn() -> None:
    """A run of the host's own code is never re-spawned where that code is missing (a
    model would stand in for it): it escalates. Delivery and attempts come first; a
    model-driven run, or one from a log that does not say, is re-spawned as before."""
    hosted = msgspec.structs.replace(_failed_run(), host_work=True)
    [decided] = decide_recovery(hosted, max_attempts=2, can_respawn=False)
    assert isinstance(decided, SubagentRecoveryDecided)
    assert (decided.action, decided.reason) == ("escalate", "work_unavailable")
    [held] = decide_recovery(hosted, max_attempts=2, can_respawn=True)
    assert isinstance(held, SubagentRecoveryDecided)
    assert held.action == "respawn"
    delivered = msgspec.structs.replace(_failed_run((FINAL, T0 + 1)), host_work=True)
    [final] = decide_recovery(delivered, max_attempts=2, can_respawn=False)
    assert isinstance(final, SubagentRecoveryDecided)
    assert final.action == "deliver"
    for unsaid in (False, None):
        model = msgspec.structs.replace(_failed_run(), host_work=unsaid)
        [again] = decide_recovery(model, max_attempts=2, can_respawn=False)
        assert isinstance(again, SubagentRecoveryDecided)
        assert again.action == "respawn"


def test_recovery_is_decided_once_and_only_for_failed_runs() -> None:
    state = _failed_run()
    log_state = apply_run(
        state,
        RecordedEvent(
            position=9,
            stream="session:run",
            version=9,
            ts=T0 + 601,
            id="r",
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=_decide(state),
        ),
    )
    assert log_state.recovery is not None
    assert log_state.recovery.action == "respawn"
    assert decide_recovery(log_state, max_attempts=2) == []
    running = spawned(Log())
    assert decide_recovery(running, max_attempts=2) == []
    log = Log()
    spawned(log)
    done = log.add(SubagentCompleted(result="ok"), T0 + 1)
    assert decide_recovery(done, max_attempts=2) == []


# -- properties: fold algebra, decisions replay, the watchdog fires at most once ----------

OBSERVATIONS = st.one_of(
    st.builds(SubagentProgress, tokens=st.integers(0, 50), step=st.integers(0, 5)),
    st.builds(
        SubagentArtifact, path=st.sampled_from(["a", "b"]), sha256=st.just("x"), final=st.booleans()
    ),
    st.builds(
        SubagentCompleted,
        outcome=st.sampled_from(["succeeded", "failed"]),
        result=st.text(max_size=2),
    ),
)


def _simulate(
    steps: list[tuple[float, Event | None]], max_steps: int | None, *, lost: bool = False
) -> Log:
    """A run driven the way the actors will: observe, then append every decision due.

    ``lost``: the watchdog timer died with its process, so only the sweeps remain.
    """
    log = Log()
    spawned(log, timeout_ms=300_000, max_steps=max_steps)
    now = T0
    for gap, observed in steps:
        now += gap
        if observed is not None:
            log.add(observed, now)
        for event in _decisions(log.state, now, lost=lost):
            log.add(event, now)
    return log


def _decisions(state: RunState, now: float, *, lost: bool = False) -> list[Event]:
    return [
        *([] if lost else decide_watchdog(state, now, per_step_timeout_ms=60_000)),
        *decide_ghost(state, now, ghost_grace_ms=120_000),
        *decide_suspicious(state, now, **KNOBS),
        *decide_recovery(state, max_attempts=2),
    ][:1]


STEPS = st.lists(
    st.tuples(st.floats(0, 200, allow_nan=False), st.one_of(st.none(), OBSERVATIONS)),
    max_size=40,
)
DECISIONS = (
    SubagentWatchdogTimeout,
    SubagentGhostSwept,
    SubagentSuspicious,
    SubagentRecoveryDecided,
)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, max_steps=st.one_of(st.none(), st.integers(1, 8)), cut=st.integers(0, 100))
def test_fold_of_a_prefix_then_the_rest_is_the_fold_of_all(
    steps: list[tuple[float, Event | None]], max_steps: int | None, cut: int
) -> None:
    records = _simulate(steps, max_steps).records
    cut = min(cut, len(records))
    prefix = fold(RUN, "session:run", records[:cut])
    assert fold(RUN, "session:run", records[cut:], prefix) == fold(RUN, "session:run", records)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, max_steps=st.one_of(st.none(), st.integers(1, 8)), lost=st.booleans())
def test_every_decision_replays_and_the_watchdog_fires_at_most_once(
    steps: list[tuple[float, Event | None]], max_steps: int | None, lost: bool
) -> None:
    records = _simulate(steps, max_steps, lost=lost).records
    for index, record in enumerate(records):
        if isinstance(record.event, DECISIONS):
            before = fold(RUN, "session:run", records[:index])
            assert _decisions(before, record.ts, lost=lost) == [record.event]
    fired = [
        r for r in records if isinstance(r.event, SubagentWatchdogTimeout | SubagentGhostSwept)
    ]
    assert len(fired) <= 1
