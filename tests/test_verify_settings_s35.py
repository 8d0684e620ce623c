"""``replay --verify`` and the settings a log's config records (session 35): no finding
about a log a correct runtime wrote, because of a knob that did not bind the decision or
a setting that could not have mattered.

Tests marked ``# Was: DEFECT:`` failed on the code they were written against. Real parts:
LMDB stores in temporary directories, logs written with the store's own ``append``, and
the CLI's ``verify_store``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart import store as store_module
from stalwart.cli._replay import verify_store
from stalwart.config import Config, parse_config
from stalwart.events import (
    ActivationReady,
    ActivationRequeued,
    Event,
    ModelFallbackAttempt,
    PromptFailed,
    PromptStarted,
    RuntimeStarted,
    SessionCreated,
    SubagentCompleted,
    SubagentSpawned,
    SubagentSuspicious,
    SubagentWatchdogTimeout,
    TurnCompleted,
    TurnStarted,
)
from stalwart.state import (
    ACTIVATIONS,
    ActivationPolicy,
    VerifyReport,
    WakeResult,
    decide_lease,
    decide_settlement,
)
from stalwart.store import NewEvent

T0 = 1_800_000_000.0
HOUR = 3_600.0


def _config(section: str = "", knob: str = "", value: object = None) -> dict[str, Any]:
    """This version's config record, with ``section.knob = value`` when given (a record
    written by hand or by another program)."""
    record = parse_config({}).to_record()
    if section:
        record[section][knob] = value
    return record


def _started(config: dict[str, Any]) -> RuntimeStarted:
    return RuntimeStarted(config=config, stalwart_version="test")


def _verify(store_dir: Path, *entries: tuple[float, str, Event]) -> VerifyReport:
    """A store whose log is ``entries`` (time, stream, event, appended in order), verified
    whole."""
    with store_module.open(store_dir) as store:
        for ts, stream, event in entries:
            store.append(stream, [NewEvent(event=event, ts=ts)])
    with store_module.open(store_dir, read_only=True) as store:
        return verify_store(store, None)


def _found(report: VerifyReport) -> list[tuple[str, str, str, int]]:
    return [(f.kind, f.stream, f.tag, f.position) for f in report.findings]


def _spawned(timeout_ms: int = 60_000, max_steps: int | None = None) -> SubagentSpawned:
    return SubagentSpawned(
        parent="p",
        task="t",
        task_class="custom",
        timeout_ms=timeout_ms,
        max_steps=max_steps,
        timeout_knob="custom_timeout_ms",
    )


def _watchdog(started: float, limit_ms: int, at: float) -> SubagentWatchdogTimeout:
    return SubagentWatchdogTimeout(
        deadline=started + limit_ms / 1000,
        limit_ms=limit_ms,
        knob="custom_timeout_ms",
        elapsed_ms=round((at - started) * 1000),
    )


# -- 1. a step budget's knob, for a run with no step budget --------------------------------


# Was: DEFECT: a run with no max_steps: its watchdog "could not re-run" under a text per_step knob
def test_decisions_of_a_run_with_no_step_budget_ignore_the_per_step_knob(tmp_path: Path) -> None:
    """``per_step_timeout_ms`` is recorded as text. Run 1 (no ``max_steps``) times out at
    its own limit, run 2 (none either) is flagged suspicious at half its limit with its
    tokens frozen: neither decision reads the knob, so both follow. Run 3's watchdog (no
    step budget) fires 20 s early: it does not follow, and the words say why (its own
    limit), not that the knob is no number."""
    suspicious = SubagentSuspicious(
        tokens=0, elapsed_ms=300_000, expected_ms=300_000, frozen_ms=300_000, interval_ms=60_000
    )
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("subagents", "per_step_timeout_ms", "60000"))),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 2, "session:run-2", _spawned(timeout_ms=600_000)),
        (T0 + 3, "session:run-3", _spawned()),
        (T0 + 43, "session:run-3", _watchdog(T0 + 3, 60_000, T0 + 43)),
        (T0 + 61, "session:run-1", _watchdog(T0 + 1, 60_000, T0 + 61)),
        (T0 + 302, "session:run-2", suspicious),
        (T0 + 303, "session:run-2", SubagentCompleted(result="done")),
    )
    assert report.checked == {"subagent:suspicious": 1, "subagent:watchdog_timeout": 2}
    assert _found(report) == [("mismatch", "session:run-3", "subagent:watchdog_timeout", 5)]
    assert report.findings[0].message == (
        "the state just before it decides nothing at this time: the deadline is "
        "2027-01-15T08:01:03.000Z (started + 60000 ms, custom_timeout_ms); it fired 20000 ms "
        "before it"
    )


# -- 2. a setting that could not have mattered ----------------------------------------------


# Was: DEFECT: text ghost_grace_ms: runs that ended before their limit were reported NOT WATCHED
def test_a_ghost_grace_as_text_is_not_reported_for_runs_that_ended_before_it_could_matter(
    tmp_path: Path,
) -> None:
    """``ghost_grace_ms`` is recorded as text. A ghost sweep falls due no sooner than the
    run's own limit (a grace of 0), and is late no sooner than a sweep interval and the
    grace after it: run 1 (done after 30 s of its 60 s), run 2 (its watchdog at its limit)
    and run 3 (done after 100 s of its 600 s) cannot have been ghosts a sweep was late
    for, whatever the grace. Run 4 hangs for an hour: its sweep is NOT WATCHED, once, and
    its own limit's watchdog missed."""
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("subagents", "ghost_grace_ms", "120000"))),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 2, "session:run-2", _spawned()),
        (T0 + 3, "session:run-3", _spawned(timeout_ms=600_000)),
        (T0 + 4, "session:run-4", _spawned()),
        (T0 + 31, "session:run-1", SubagentCompleted(result="done")),
        (T0 + 62, "session:run-2", _watchdog(T0 + 2, 60_000, T0 + 62)),
        (T0 + 63, "session:run-4", SessionCreated(channel="chat")),  # not an end: still running
        (T0 + 103, "session:run-3", SubagentCompleted(result="done")),
        (T0 + HOUR, "session:chat", SessionCreated(channel="chat")),
    )
    assert _found(report) == [
        ("unwatched", "session:run-4", "subagent:ghost_swept", 5),
        ("missed", "session:run-4", "subagent:watchdog_timeout", 9),
    ]


# Was: DEFECT: text execution_timeout_ms: a turn that ended within a second was NOT WATCHED
def test_a_timeout_as_text_is_not_reported_where_nothing_waited_long_enough_to_be_late(
    tmp_path: Path,
) -> None:
    """``execution_timeout_ms`` is recorded as text. A turn that ends a second after it
    began cannot have outlived any timeout by the grace: nothing to say. One that runs for
    an hour is NOT WATCHED."""
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(_config("supervision", "execution_timeout_ms", "600000"))),
        (T0 + 1, "session:a", TurnStarted(turn_id="t1")),
        (T0 + 2, "session:a", TurnCompleted(turn_id="t1")),
        (T0 + 3, "session:b", TurnStarted(turn_id="t1")),
        (T0 + HOUR, "session:b", TurnCompleted(turn_id="t1")),
    )
    assert _found(report) == [("unwatched", "session:b", "execution:aborted", 4)]


# Was: DEFECT: a process whose ghost grace was text, replaced within seconds, was said NOT WATCHED
def test_a_process_with_a_text_grace_replaced_before_any_sweep_could_be_late_is_not_reported(
    tmp_path: Path,
) -> None:
    """Run 1 hangs. The next process records ``ghost_grace_ms`` as text, and is replaced
    10 s later by one that records a number: no sweep could have been late in between
    (the run's own limit had not even passed). The sweep the last process owes, and
    misses, is reported as usual."""
    good = _config()
    report = _verify(
        tmp_path / "store",
        (T0, "runtime", _started(good)),
        (T0 + 1, "session:run-1", _spawned()),
        (T0 + 10, "runtime", _started(_config("subagents", "ghost_grace_ms", "x"))),
        (T0 + 20, "runtime", _started(good)),
        (T0 + HOUR, "session:chat", SessionCreated(channel="chat")),
        (T0 + HOUR + 1, "session:chat", TurnStarted(turn_id="t1")),
    )
    assert _found(report) == [("missed", "session:run-1", "subagent:ghost_swept", 5)]


# -- 3. knobs a decision does not read -------------------------------------------------------


def _activations(store_dir: Path, config: dict[str, Any]) -> None:
    """A process whose recorded config is ``config``; a wake of session s1 leased by w1,
    failed (retryable) and requeued, leased again at its backoff's end and acked: each
    decision taken by the pure policy of this version's default activation knobs."""
    knobs = Config().activations
    rules = ActivationPolicy(
        **{name: getattr(knobs, name) for name in ActivationPolicy.__struct_fields__}
    )
    with store_module.open(store_dir) as store:
        store.append("runtime", [NewEvent(event=_started(config), ts=T0)])
        store.append("session:s1", [NewEvent(event=ActivationReady(activation_id="a1"), ts=T0)])

        def decide(at: float, result: WakeResult | None = None) -> list[Event]:
            state = ACTIVATIONS.initial("session:s1")
            for record in store.read_stream("session:s1"):
                state = ACTIVATIONS.apply(state, record)
            if result is None:
                return decide_lease(state, "w1", at, rules)
            assert state.lease is not None
            lease = state.lease
            return [decide_settlement(state, lease.activation_id, lease.epoch, result, at, rules)]

        def append(at: float, events: list[Event]) -> None:
            assert events
            store.append("session:s1", [NewEvent(event=e, ts=at) for e in events])

        append(T0 + 1, decide(T0 + 1))
        failed = WakeResult(status="failed", error_class="ProviderError", retryable=True)
        [requeued] = decide(T0 + 2, failed)
        append(T0 + 2, [requeued])
        assert isinstance(requeued, ActivationRequeued)
        append(requeued.run_at, decide(requeued.run_at))
        append(requeued.run_at + 1, decide(requeued.run_at + 1, WakeResult(status="ok")))


# Was: DEFECT: a wake's limits as text: every lease and settlement "could not re-run"
def test_activation_decisions_ignore_the_knobs_they_do_not_read(tmp_path: Path) -> None:
    """A wake's own limits and the renewal period are recorded as text: no lease nor
    settlement reads them, so all four verify. The backoff's cap recorded as text makes
    the requeue, which reads it, a finding that names it; the leases and the ack, which
    do not, still verify."""
    config = _config("activations", "max_wake_horizon_ms", "1 day")
    config["activations"]["max_pending_wakes"] = "many"
    config["activations"]["renew_every_ms"] = None
    _activations(tmp_path / "store", config)
    with store_module.open(tmp_path / "store", read_only=True) as store:
        report = verify_store(store, None)
    assert report.findings == (), [f.message for f in report.findings]
    assert sum(report.checked.values()) == 4
    _activations(tmp_path / "backoff", _config("activations", "backoff_cap_ms", "60000"))
    with store_module.open(tmp_path / "backoff", read_only=True) as store:
        report = verify_store(store, None)
    assert _found(report) == [("mismatch", "session:s1", "activation:requeued", 4)]
    assert "'activations.backoff_cap_ms' = '60000', not a number" in report.findings[0].message


def _agent(**settings: object) -> dict[str, Any]:
    """A config record whose agent ``default`` calls openai:gpt-4o, with ``settings``."""
    record = _config()
    record["agents"] = {"default": {"provider": "openai", "model": "gpt-4o", **settings}}
    return record


def _fell_back(store_dir: Path, config: dict[str, Any], *, vision: bool, to: str) -> None:
    """A call to openai:gpt-4o failed; the chain moved on to ``to``."""
    fallback = ModelFallbackAttempt(
        from_model="openai:gpt-4o",
        to_model=to,
        attempt=1,
        reason="server_error",
        agent="default",
        vision=vision,
        call_id="c1",
    )
    entries = [
        (T0, "runtime", _started(config)),
        (T0 + 1, "session:s1", PromptStarted(call_id="c1", provider="openai", model="gpt-4o")),
        (T0 + 2, "session:s1", PromptFailed(call_id="c1", error_class="server_error")),
        (T0 + 2, "session:s1", fallback),
    ]
    with store_module.open(store_dir) as store:
        for ts, stream, event in entries:
            store.append(stream, [NewEvent(event=event, ts=ts)])


# Was: DEFECT: a text vision_fallback_models: a plain request's fallback "could not re-run"
def test_a_fallback_reads_only_the_chain_it_took(tmp_path: Path) -> None:
    """The vision chain is recorded as one text, not a list: a plain request's fallback
    does not take it, and verifies. A vision request with a vision chain of its own does
    not take the plain chain (recorded as text there): it verifies too. A vision request
    whose vision chain is the text cannot be re-run, and says so."""
    cases = [
        ("plain", _agent(fallback_models=["anthropic:claude"], vision_fallback_models="x:y"),
         False, "anthropic:claude"),
        ("vision", _agent(fallback_models="anthropic:claude", vision_fallback_models=["x:y"]),
         True, "x:y"),
        ("unread", _agent(fallback_models=["anthropic:claude"], vision_fallback_models="x:y"),
         True, "anthropic:claude"),
    ]  # fmt: skip
    found = {}
    for name, config, vision, to in cases:
        _fell_back(tmp_path / name, config, vision=vision, to=to)
        with store_module.open(tmp_path / name, read_only=True) as store:
            report = verify_store(store, None)
        assert report.checked == {"model:fallback_attempt": 1}, name
        found[name] = [f.message for f in report.findings]
    assert found["plain"] == found["vision"] == []
    assert found["unread"] == [
        "replay could not re-run the decision: the config in force has "
        "'agents.default.vision_fallback_models' = 'x:y', not a list of names"
    ]
