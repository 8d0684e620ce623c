"""Replay verification as a pure walk over hand-built logs: each decision re-derived at its
own ts with the config in force, deadlines missed, undecodable records, the registry."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgspec
import pytest
from hypothesis import event as note
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.cli._replay import default_knobs
from stalwart.config import parse_config
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    BreakerOpened,
    Event,
    ExecutionAborted,
    PromptActivity,
    PromptCompleted,
    PromptRetryScheduled,
    PromptStarted,
    PromptTimeout,
    ProviderCallFailed,
    ProviderDegraded,
    RecordedEvent,
    RuntimeStarted,
    SessionCreated,
    SubagentCompleted,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    SupervisorGaveUp,
    SupervisorRestarted,
    TurnStarted,
    UnknownEvent,
)
from stalwart.state import (
    RUN,
    VERIFIERS,
    Deadline,
    Knobs,
    Registry,
    Selective,
    Verification,
    Verifier,
    VerifyReport,
    decide_restart,
    decide_watchdog,
    restart_history,
    verify,
)
from tests._log import recorded

T0 = 1_800_000_000.0
RUN_STREAM = "session:run-1"
DEFAULTS = default_knobs()


class Log:
    """Records in log order across streams (positions global, versions per stream)."""

    def __init__(self) -> None:
        self.records: list[RecordedEvent] = []
        self._versions: dict[str, int] = {}

    def add(self, stream: str, event: Event, at: float) -> Log:
        version = self._versions[stream] = self._versions.get(stream, 0) + 1
        record = recorded(event, T0 + at, version, stream)
        self.records.append(msgspec.structs.replace(record, position=len(self.records) + 1))
        return self

    def verify(self, **options: Any) -> VerifyReport:
        return verify(self.records, VERIFIERS, defaults=DEFAULTS, **options)


def spawned(timeout_ms: int = 120_000, max_steps: int | None = None) -> SubagentSpawned:
    return SubagentSpawned(
        parent="p",
        task="t",
        task_class="formatting",
        timeout_ms=timeout_ms,
        max_steps=max_steps,
        timeout_knob="class_timeouts_ms.formatting",
    )


def watchdog(elapsed_ms: int, deadline_at: float = 120, limit_ms: int = 120_000) -> Event:
    knob = "class_timeouts_ms.formatting"
    return SubagentWatchdogTimeout(
        deadline=T0 + deadline_at, limit_ms=limit_ms, knob=knob, elapsed_ms=elapsed_ms
    )


def kinds(report: VerifyReport) -> list[tuple[str, str, int]]:
    return [(f.kind, f.tag, f.position) for f in report.findings]


# -- decisions that follow, and ones that do not --------------------------------------------


def test_a_watchdog_at_its_deadline_follows_and_one_a_millisecond_early_does_not() -> None:
    on_time = Log().add(RUN_STREAM, spawned(), 0).add(RUN_STREAM, watchdog(120_000), 120)
    report = on_time.verify()
    assert report.clean
    assert report.checked == {"subagent:watchdog_timeout": 1}
    early = Log().add(RUN_STREAM, spawned(), 0).add(RUN_STREAM, watchdog(119_999), 119.999)
    [finding] = early.verify().findings
    assert (finding.kind, finding.position, finding.version) == ("mismatch", 2, 2)
    assert finding.message.startswith("the state just before it decides nothing at this time")
    assert "it fired 1 ms before it" in finding.message
    assert finding.expected == []
    assert finding.found["elapsed_ms"] == 119_999


def test_a_decision_with_the_wrong_numbers_shows_what_was_expected() -> None:
    log = Log().add(RUN_STREAM, spawned(), 0).add(RUN_STREAM, watchdog(99_000), 130)
    [finding] = log.verify().findings
    assert finding.message.startswith("the state just before it decides differently")
    assert finding.expected[0]["elapsed_ms"] == 130_000


def test_the_config_in_force_is_the_latest_recorded_before_the_decision() -> None:
    tight = parse_config({"subagents": {"per_step_timeout_ms": 10_000}}).to_record()
    log = Log().add("runtime", RuntimeStarted(config=tight, stalwart_version="x"), 0)
    log.add(RUN_STREAM, spawned(max_steps=2), 1)  # 2 x 10 s binds: the deadline is 21 s
    step_knob = "max_steps x per_step_timeout_ms"
    timeout = SubagentWatchdogTimeout(
        deadline=T0 + 21, limit_ms=20_000, knob=step_knob, elapsed_ms=20_000
    )
    assert log.add(RUN_STREAM, timeout, 21).verify().clean
    # under the defaults (60 s a step) the same decision would be early
    [finding] = verify(log.records[1:], VERIFIERS, defaults=DEFAULTS).findings
    assert finding.kind == "mismatch"
    # a later start with other knobs governs what follows it
    other = Log().add("runtime", RuntimeStarted(config=tight, stalwart_version="x"), 0)
    other.add("runtime", RuntimeStarted(config={}, stalwart_version="x"), 0.5)
    other.add(RUN_STREAM, spawned(max_steps=2), 1).add(RUN_STREAM, timeout, 21)
    assert kinds(other.verify()) == [("mismatch", "subagent:watchdog_timeout", 4)]


def test_only_the_streams_asked_for_are_checked() -> None:
    log = Log().add(RUN_STREAM, spawned(), 0).add(RUN_STREAM, watchdog(1_000), 1)
    assert log.verify(verify=lambda stream: stream != RUN_STREAM).clean
    assert not log.verify(verify=lambda stream: stream == RUN_STREAM).clean


def test_an_early_prompt_timeout_and_activity_that_restarted_the_stall_budget() -> None:
    started = PromptStarted(call_id="c", provider="p", model="m", timeout_ms=10_000)
    stall = PromptTimeout(
        call_id="c", limit="stall", knob="prompt_timeout_ms", limit_ms=10_000, elapsed_ms=15_000
    )
    log = Log().add("session:s", started, 0).add("session:s", PromptActivity(call_id="c"), 5)
    assert log.add("session:s", stall, 15).verify().clean
    early = Log().add("session:s", started, 0).add("session:s", PromptActivity(call_id="c"), 5)
    early.add("session:s", msgspec.structs.replace(stall, elapsed_ms=10_000), 10)
    [finding] = early.verify().findings
    assert "the stall limit (10000 ms) falls at" in finding.message
    assert "5000 ms later" in finding.message


def test_the_execution_timeout_allows_the_agents_second_clock_read_but_not_an_early_abort() -> None:
    def aborted(elapsed_ms: int) -> ExecutionAborted:
        return ExecutionAborted(
            reason="pipeline_timeout", turn_id="t", limit_ms=600_000, elapsed_ms=elapsed_ms
        )

    def log(elapsed_ms: int, at: float) -> Log:
        return (
            Log()
            .add("session:s", TurnStarted(turn_id="t"), 0)
            .add("session:s", aborted(elapsed_ms), at)
        )

    assert log(600_000, 600.003).verify().clean  # decided at 600.000, appended 3 ms later
    assert not log(599_999, 600.003).verify().clean
    assert not log(600_000, 599.5).verify().clean
    interrupted = ExecutionAborted(reason="interrupted", turn_id="t")
    other = Log().add("session:s", TurnStarted(turn_id="t"), 0).add("session:s", interrupted, 1)
    assert other.verify().checked == {}  # not the execution timeout's decision


def test_restarts_are_re_derived_from_the_restart_history() -> None:
    def restarted(n: int, backoff_ms: int) -> SupervisorRestarted:
        return SupervisorRestarted(
            actor="deadletter",
            restarts=n,
            backoff_ms=backoff_ms,
            reason="RuntimeError",
            window_ms=5_000,
            max_restarts=3,
        )

    def three() -> Log:
        log = Log()
        for n, (at, backoff) in enumerate(((0, 100), (1, 200), (2, 400)), start=1):
            log.add("runtime", restarted(n, backoff), at)
        return log

    gave_up = SupervisorGaveUp(
        actor="deadletter", restarts=3, window_ms=5_000, max_restarts=3, reason="RuntimeError"
    )
    assert three().add("runtime", gave_up, 3).verify().clean
    [finding] = three().add("runtime", restarted(4, 800), 3).verify().findings
    assert finding.expected[0]["type"] == "supervisor:gave_up"
    assert three().add("runtime", restarted(1, 100), 7.5).verify().clean  # a calm window


def test_each_runtime_instance_counts_only_its_own_restarts() -> None:
    """Processes sharing a store restart actors of the same names ("deadletter"): their
    restarts were counted together, so three processes' crashes made the fourth give up."""
    log = Log()
    for at, runtime in enumerate(("w1", "w2", "w3")):
        restarted = SupervisorRestarted(
            actor="deadletter",
            restarts=1,
            backoff_ms=100,
            reason="RuntimeError",
            window_ms=5_000,
            max_restarts=3,
            runtime=runtime,
        )
        log.add("runtime", restarted, at * 0.1)
    fourth = SupervisorRestarted(
        actor="deadletter",
        restarts=2,
        backoff_ms=200,
        reason="RuntimeError",
        window_ms=5_000,
        max_restarts=3,
        runtime="w1",
    )
    assert log.add("runtime", fourth, 0.5).verify().clean
    records = log.records
    assert restart_history(records, "deadletter", "w1") == (T0, T0 + 0.5)
    assert restart_history(records, "deadletter", "w4") == ()
    decided = decide_restart(
        "deadletter",
        restart_history(records, "deadletter", "w2"),
        T0 + 1,
        reason="r",
        max_restarts=3,
        within_ms=5_000,
        backoff_base_ms=100,
        backoff_cap_ms=1_000,
        runtime="w2",
    )
    assert isinstance(decided, SupervisorRestarted)
    assert (decided.restarts, decided.runtime) == (2, "w2")


def test_provider_and_dead_letter_decisions_are_re_derived() -> None:
    failed = ProviderCallFailed(provider="main", model="m", agent="a", error_class="server_error")
    log = Log()
    for at in range(5):
        log.add("provider:main", failed, at)
    opened = BreakerOpened(provider="main", failures=5, threshold=5, reset_timeout_ms=60_000)
    log.add("provider:main", opened, 5)
    degraded = ProviderDegraded(
        provider="main", rule="consecutive", agents=("a",), failures=5, window_ms=60_000
    )
    log.add("provider:main", degraded, 5)
    lettered = AnnouncementDeadLettered(
        entry_id="e1", announcement_id="a1", channel="chat", text="x", reason="timeout"
    )
    log.add("deadletter", lettered, 10)
    expired = AnnouncementDeadLetterExpired(
        entry_id="e1", age_ms=3_600_000, max_age_ms=3_600_000, max_retries=5
    )
    log.add("deadletter", expired, 3_610)
    report = log.verify()
    assert report.clean, report.findings
    assert report.checked == {
        "announcement:dead_letter_expired": 1,
        "breaker:opened": 1,
        "provider:degraded": 1,
    }


def test_a_split_recovery_is_read_from_the_decision_and_its_subtasks_taken_as_recorded() -> None:
    def log(decided: SubagentRecoveryDecided) -> Log:
        spawn = msgspec.structs.replace(spawned(), attempt=2)
        return (
            Log()
            .add(RUN_STREAM, spawn, 0)
            .add(RUN_STREAM, watchdog(120_000), 120)
            .add(RUN_STREAM, decided, 120)
        )

    split = SubagentRecoveryDecided(
        action="split", reason="attempts_exhausted", attempt=2, subtasks=("a", "b")
    )
    assert log(split).verify().clean
    failed = SubagentRecoveryDecided(action="escalate", reason="splitter_empty", attempt=2)
    assert log(failed).verify().clean
    respawn = SubagentRecoveryDecided(action="respawn", reason="no_work", attempt=2)
    assert not log(respawn).verify().clean  # attempts exhausted: no respawn


def test_a_host_work_run_escalates_where_its_code_is_missing_and_only_such_a_run() -> None:
    """Whether the process held the host's code is not in the log: a ``work_unavailable``
    escalation is read from the decision, but only a run whose spawn says it ran host
    code may take it; a model-driven run is respawned."""

    def log(host_work: bool | None, decided: SubagentRecoveryDecided) -> Log:
        spawn = msgspec.structs.replace(spawned(), host_work=host_work)
        return (
            Log()
            .add(RUN_STREAM, spawn, 0)
            .add(RUN_STREAM, watchdog(120_000), 120)
            .add(RUN_STREAM, decided, 120)
        )

    missing = SubagentRecoveryDecided(action="escalate", reason="work_unavailable")
    respawn = SubagentRecoveryDecided(action="respawn", reason="no_work")
    assert log(True, missing).verify().clean
    assert log(True, respawn).verify().clean  # the process held the code
    assert not log(False, missing).verify().clean
    assert not log(None, missing).verify().clean
    assert log(None, respawn).verify().clean


# -- deadlines that passed with no decision -------------------------------------------------


def test_a_watchdog_that_never_fired_is_missed_once_time_moves_past_it() -> None:
    log = Log().add(RUN_STREAM, spawned(), 0).add("session:other", SessionCreated(), 126)
    log.add(RUN_STREAM, SubagentProgress(tokens=5), 127)
    report = log.verify()
    assert kinds(report) == [("missed", "subagent:watchdog_timeout", 2)]
    [finding] = report.findings
    assert finding.stream == RUN_STREAM
    assert "6000 ms past it" in finding.message
    assert "in session:other" in finding.message


def test_within_the_grace_or_cut_off_by_the_log_end_nothing_is_missed() -> None:
    within = Log().add(RUN_STREAM, spawned(), 0).add("session:x", SessionCreated(), 124.9)
    assert within.add("session:x", SessionCreated(), 125).verify().clean
    cut = Log().add(RUN_STREAM, spawned(), 0).add("session:x", SessionCreated(), 60)
    assert cut.verify().clean
    assert not within.verify(grace_ms=1_000).clean


def test_a_late_decision_at_the_moment_the_clock_jumped_to_is_made_not_missed() -> None:
    jumped = Log().add(RUN_STREAM, spawned(), 0).add("session:x", SessionCreated(), 700)
    jumped.add(RUN_STREAM, watchdog(700_000), 700).add("session:x", SessionCreated(), 701)
    assert jumped.verify().clean


def test_a_new_process_drops_the_old_ones_timers_but_owes_the_ghost_sweep() -> None:
    log = Log().add(RUN_STREAM, spawned(), 0)
    log.add("runtime", RuntimeStarted(config={}, stalwart_version="x"), 100)  # crashed, restarted
    log.add("session:x", SessionCreated(), 200)
    assert log.verify().clean  # the watchdog died with its process
    # the ghost deadline (120 + 120 s grace) + the sweep interval (60 s) + grace (5 s)
    log.add("session:x", SessionCreated(), 306).add("session:x", SessionCreated(), 307)
    assert kinds(log.verify()) == [("missed", "subagent:ghost_swept", 4)]


def test_a_restart_long_after_a_crash_proves_no_miss_of_the_dead_process() -> None:
    """The first record past a dead process's deadline is the new process's start: the
    old one may have died before the deadline came, so nothing is missed (the restart
    drops its timers). A record of the old process past the deadline still proves one."""
    started = PromptStarted(call_id="c", provider="p", model="m", timeout_ms=10_000)
    restart = RuntimeStarted(config={}, stalwart_version="x")
    late = Log().add("session:s", started, 0).add("runtime", restart, 720)
    assert late.add("session:x", SessionCreated(), 721).verify().clean
    alive = Log().add("session:s", started, 0).add("session:x", SessionCreated(), 30)
    alive.add("runtime", restart, 720).add("session:x", SessionCreated(), 721)
    assert kinds(alive.verify()) == [("missed", "execution:prompt_timeout", 2)]


def test_a_call_that_outlived_its_stall_limit_is_a_missed_prompt_timeout() -> None:
    started = PromptStarted(call_id="c", provider="p", model="m", timeout_ms=10_000)
    log = Log().add("session:s", started, 0).add("session:s", PromptCompleted(call_id="c"), 30)
    assert kinds(log.verify()) == [("missed", "execution:prompt_timeout", 2)]


@settings(max_examples=50, deadline=None)
@given(
    progress=st.lists(st.floats(min_value=0.1, max_value=119.9), max_size=5),
    late=st.floats(min_value=0, max_value=4.9),
)
def test_a_watchdog_decided_by_the_policy_always_verifies(
    progress: list[float], late: float
) -> None:
    log = Log().add(RUN_STREAM, spawned(), 0)
    for tokens, at in enumerate(sorted(progress), start=1):
        log.add(RUN_STREAM, SubagentProgress(tokens=tokens), at)
    state = RUN.initial(RUN_STREAM)
    for record in log.records:
        state = RUN.apply(state, record)
    [decided] = decide_watchdog(state, T0 + 120 + late, per_step_timeout_ms=60_000)
    log.add(RUN_STREAM, decided, 120 + late).add(RUN_STREAM, SubagentCompleted(), 130)
    assert log.verify().clean


# -- undecodable records and the registry ---------------------------------------------------


def test_unknown_and_corrupt_records_are_reported() -> None:
    unknown = UnknownEvent(tag="session:sentiment_scored", schema=3, raw=b"{}")
    log = Log().add("session:s", SessionCreated(), 0).add("session:s", unknown, 1)
    verification = Verification(VERIFIERS, defaults=DEFAULTS)
    for record in log.records:
        verification.add(record)
    verification.undecodable(3, "not a stalwart record")
    report = verification.report()
    assert [(f.kind, f.position, f.tag) for f in report.findings] == [
        ("undecodable", 2, "session:sentiment_scored"),
        ("undecodable", 3, ""),
    ]


class _Pings(msgspec.Struct, frozen=True):
    count: int = 0
    last: float | None = None


class _PingFold:
    name = "test_pings"
    version = 1
    state_type = _Pings

    def initial(self, stream: str) -> _Pings:
        return _Pings()

    def apply(self, state: _Pings, record: RecordedEvent) -> _Pings:
        if isinstance(record.event, SubagentProgress):
            return _Pings(count=state.count + 1, last=record.ts)
        return state

    def folder(self, state: _Pings) -> Any:
        from stalwart.state import ApplyFolder

        return ApplyFolder(self.apply, state)


def test_a_registered_verifier_and_deadline_run_with_the_built_in_ones() -> None:
    """How the activation verifiers plug in: a fold, a decide at the record's ts, a due."""

    def decide(state: _Pings, record: RecordedEvent, knobs: Knobs) -> list[Event]:
        limit = knobs.get_int("subagents.per_step_timeout_ms")
        if state.last is not None and record.ts >= state.last + limit / 1000:
            return [SubagentCompleted(outcome="failed")]
        return []

    def due(state: _Pings, knobs: Knobs) -> float | None:
        if state.last is None:
            return None
        return state.last + knobs.get_int("subagents.per_step_timeout_ms") / 1000

    fold = _PingFold()
    registry = VERIFIERS.with_(
        Verifier("subagent:completed", fold, decide, "session:", ignore=("result",)),
        Deadline("ping timeout", "subagent:completed", fold, due, "session:"),
    )
    assert "subagent:completed" in registry.decisions
    failed = SubagentCompleted(outcome="failed", result="whatever")
    good = Log().add("session:p", SubagentProgress(tokens=1), 0).add("session:p", failed, 60)
    assert verify(good.records, registry, defaults=DEFAULTS).clean
    early = Log().add("session:p", SubagentProgress(tokens=1), 0).add("session:p", failed, 59)
    assert [f.kind for f in verify(early.records, registry, defaults=DEFAULTS).findings] == [
        "mismatch"
    ]
    silent = Log().add("session:p", SubagentProgress(tokens=1), 0)
    silent.add("session:q", SessionCreated(), 66).add("session:q", SessionCreated(), 67)
    report = verify(silent.records, registry, defaults=DEFAULTS)
    assert kinds(report) == [("missed", "subagent:completed", 2)]


def test_decisions_with_no_verifier_are_counted_not_failed() -> None:
    retry = PromptRetryScheduled(call_id="c", attempt=2, delay_ms=500, reason="rate_limited")
    log = Log().add("session:s", retry, 0)
    report = log.verify()
    assert report.clean
    assert report.unchecked == {"prompt:retry_scheduled": 1}


def test_a_knob_nobody_recorded_or_defaulted_is_a_mismatch_that_says_so() -> None:
    knobs = Knobs({"a": {"b": 1}}, {"a": {"*": {"c": 2}}})
    assert knobs.get_int("a.b") == 1
    assert knobs.get_int("a.x.c") == 2
    from stalwart.errors import ConfigError

    with pytest.raises(ConfigError, match=r"no 'q\.z'"):
        knobs.get("q.z")
    # a run with a step budget: its watchdog reads per_step_timeout_ms (one with none is
    # bound by its own limit alone, and reads no knob)
    log = Log().add(RUN_STREAM, spawned(max_steps=5), 0).add(RUN_STREAM, watchdog(120_000), 120)
    [finding] = verify(log.records, VERIFIERS, defaults={}).findings
    assert "replay could not re-run the decision" in finding.message


# -- the walk's shortcuts change nothing ----------------------------------------------------


def _plain(registry: Registry) -> Registry:
    """The registry without shortcuts: every fold sees every event, every deadline is
    recomputed after every event."""

    def unwrap(fold: Any) -> Any:
        return fold.aggregate if isinstance(fold, Selective) else fold

    return Registry(
        verifiers=tuple(replace(v, fold=unwrap(v.fold)) for v in registry.verifiers),
        deadlines=tuple(
            replace(d, fold=unwrap(d.fold), moves=frozenset()) for d in registry.deadlines
        ),
        decisions=registry.decisions,
    )


_STEP = st.one_of(
    st.tuples(st.just("progress"), st.integers(1, 50)),
    st.tuples(st.just("watchdog"), st.integers(0, 1)),
    st.tuples(st.just("complete"), st.just(0)),
    st.tuples(st.just("call"), st.integers(0, 2)),
    st.tuples(st.just("activity"), st.integers(0, 2)),
    st.tuples(st.just("timeout"), st.integers(0, 2)),
    st.tuples(st.just("restart"), st.just(0)),
    st.tuples(st.just("other"), st.just(0)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(_STEP, st.floats(0, 90)), max_size=25))
def test_the_shortcuts_find_what_the_plain_walk_finds(
    steps: list[tuple[tuple[str, int], float]],
) -> None:
    log = Log().add(RUN_STREAM, spawned(max_steps=2), 0)
    at = 0.0
    for (kind, n), gap in steps:
        at += gap
        call = f"c{n}"
        event: Event
        stream = RUN_STREAM
        if kind == "progress":
            event = SubagentProgress(tokens=n, step=n % 3)
        elif kind == "watchdog":
            event = watchdog(round(at * 1000) - n, deadline_at=120, limit_ms=120_000)
        elif kind == "complete":
            event = SubagentCompleted()
        elif kind == "call":
            stream = "session:s"
            event = PromptStarted(call_id=call, provider="p", model="m", timeout_ms=30_000)
        elif kind == "activity":
            stream, event = "session:s", PromptActivity(call_id=call)
        elif kind == "timeout":
            stream = "session:s"
            event = PromptTimeout(
                call_id=call, limit="stall", knob="prompt_timeout_ms", limit_ms=30_000,
                elapsed_ms=30_000,
            )  # fmt: skip
        elif kind == "restart":
            stream, event = "runtime", RuntimeStarted(config={}, stalwart_version="x")
        else:
            stream, event = "session:other", SessionCreated()
        log.add(stream, event, at)
    fast = verify(log.records, VERIFIERS, defaults=DEFAULTS)
    plain = verify(log.records, _plain(VERIFIERS), defaults=DEFAULTS)
    assert fast.findings == plain.findings
    assert fast.checked == plain.checked
    note(" ".join(sorted({f.kind for f in fast.findings})) or "clean")


def test_an_activation_abandoned_when_its_lease_expired_once_too_often_verifies() -> None:
    """The expiry and the abandonment are one append; replay checks each against the
    state just before it, so the abandonment follows from the state with the expiry in."""
    from stalwart.events import ActivationAbandoned, ActivationReady, LeaseExpired
    from stalwart.state import ACTIVATIONS, ActivationPolicy, decide_lease, fold

    knobs = Knobs(None, DEFAULTS)
    policy = ActivationPolicy(
        **{
            name: knobs.get_int(f"activations.{name}")
            for name in ActivationPolicy.__struct_fields__
        }
    )
    stream = "session:expiring"
    log = Log().add(stream, ActivationReady(activation_id="a1", kind="message"), 0.0)
    at = 0.0
    decided: list[Event] = []
    for _ in range(policy.max_attempts + 1):
        at += policy.lease_ttl_ms / 1000 + 1.0  # every holder dies: its lease runs out
        state = fold(ACTIVATIONS, stream, log.records)
        decided = decide_lease(state, f"worker-{at:.0f}", T0 + at, policy)
        for event in decided:
            log.add(stream, event, at)
    assert [type(e) for e in decided] == [LeaseExpired, ActivationAbandoned]
    report = log.verify()
    assert report.findings == ()
    assert report.checked["activation:abandoned"] == 1
    assert report.checked["lease:expired"] == policy.max_attempts
