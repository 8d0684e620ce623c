"""Review of ``stalwart replay --verify``: logs it misjudges.

Two kinds of failure: logs a real Runtime wrote (real LMDB store on the fake clock, the
loopback fake provider, a chat MemoryChannel) that verification calls inconsistent, and
hand-built logs (appended to a real LMDB store) holding a decision that clearly does not
follow, or a deadline that clearly passed, that verification calls clean. Plus a crash on
a record from a newer version, and time that grows with streams x restarts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.cli._replay import REGISTRY, default_knobs, verify_store
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    ActivationAcked,
    ActivationRequeued,
    AnnouncementDeadLettered,
    AnnouncementDeadLetterRetried,
    AnnouncementSendFailed,
    Event,
    MessageAppended,
    PromptFailed,
    PromptRetryScheduled,
    PromptStarted,
    ProviderDegraded,
    ProviderRecovered,
    RecordedEvent,
    RuntimeStarted,
    RuntimeStopped,
    SessionCreated,
    SubagentSpawned,
    TurnCompleted,
    TurnStarted,
)
from stalwart.runtime import Runtime
from stalwart.state import decide_restart, verify
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, Fail, FakeProvider, Hang
from tests._log import recorded
from tests._runtime_support import (
    GUARD,
    agent_settings,
    delivered,
    delivered_by_clock,
    has,
    log_until,
)

T0 = 1_800_000_000.0

AGENT: dict[str, Any] = agent_settings()


def _config(fake: FakeProvider, **sections: Any) -> Any:
    return parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {"default": AGENT},
        }
        | sections
    )


def _started(**sections: Any) -> RuntimeStarted:
    return RuntimeStarted(config=parse_config(sections).to_record(), stalwart_version="test")


def _put(store: EventStore, stream: str, event: Event, at: float) -> None:
    store.append(stream, [NewEvent(event=event, ts=T0 + at)])


def _where(report: Any) -> list[tuple[str, str, str]]:
    return [(f.kind, f.tag, f.message) for f in report.findings]


# -- 1. a wider health window after a restart --------------------------------------------------


def test_a_health_window_widened_across_a_restart_does_not_break_the_degraded_check(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The health fold's horizon is fixed from the config in force at the provider
    stream's first event, so once an operator restarts with a wider ``health.window_ms``
    (here 120 s, above the 60 s default), every later ``provider:degraded`` the real
    runtime records is reported as DOES NOT FOLLOW ("replay could not re-run the
    decision: ... exceeds the health fold's horizon"). The runtime itself refolds with
    the wider horizon; verify should too, and find this log clean."""
    with Runtime(_config(fake), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("a", channel="chat").send("one")
        delivered(rt, chat, 1)
    clock.advance(10)
    fake.set_default(Fail(status=503))
    wider = _config(
        fake,
        agents={"default": AGENT | {"max_retries": 2, "retry_base_ms": 1, "retry_cap_ms": 2}},
        health={"window_ms": 120_000},
    )
    with Runtime(wider, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("b", channel="chat")
        for count, text in enumerate(("two", "three", "four"), start=2):
            session.send(text)  # three failed calls in a row (each retried), one per turn
            delivered_by_clock(clock, chat, count)  # the backoffs run on the Clock
        log_until(store, "provider:main", has(ProviderDegraded))
    report = verify_store(store, None)
    assert report.checked.get("provider:degraded") == 1
    assert _where(report) == []


# -- 2. a ghost already due when the next process starts ---------------------------------------


def test_a_ghost_sweep_owed_by_the_next_process_is_missed_when_it_never_comes(
    lmdb_store: EventStore, store_dir: Path
) -> None:
    """docs/replay.md: the ghost sweep "reads the log, so the new process owes [it],
    counted from its start". A run spawned at 0 s (120 s limit, ghost due at 240 s with
    the default 120 s ghost grace) is left running by a process that died; the next
    process starts at 250 s and runs for 45 minutes with sessions answering, and never
    sweeps the ghost. Verify calls the log clean: the restart re-arms the deadline at
    ``max(due, start)`` but keeps ``due`` as the pending one, so the re-armed entry looks
    stale and is dropped. It should report the missed ``subagent:ghost_swept``."""
    store = lmdb_store
    _put(store, "runtime", _started(), 0)
    spawned = SubagentSpawned(parent="chat", task="t", task_class="formatting", timeout_ms=120_000)
    _put(store, "session:run-a", spawned, 1)
    _put(store, "runtime", _started(), 250)  # the old process died (no runtime:stopped)
    for minute in range(1, 46):
        _put(store, "session:chat", TurnStarted(turn_id=f"t{minute}"), 250 + 60 * minute)
        _put(store, "session:chat", TurnCompleted(turn_id=f"t{minute}"), 251 + 60 * minute)
    result = CliRunner().invoke(
        cli, ["--store", str(store_dir), "replay", "--all", "--verify", "--json"]
    )
    missed = {f["tag"] for f in msgspec.json.decode(result.output)["findings"]}
    # the dead process's own watchdog (due at 121 s) is not: nothing it wrote after 1 s
    # shows it alive at 126 s, and the next process's start proves no miss of its own
    assert missed == {"subagent:ghost_swept"}, missed


# -- 3. a decision written by a newer version --------------------------------------------------


def _overwrite(where: Path, position: int, value: bytes) -> None:
    env = lmdb.open(str(where), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), value, db=env.open_db(b"log", txn=txn))
    finally:
        env.close()


def _newer_decision(store: EventStore, where: Path, tag: str, stream: str) -> int:
    """A ``tag`` record in ``stream`` as a newer stalwart would write it: a later schema
    whose shape this version cannot read (a field changed type). Its position."""
    _put(store, "runtime", _started(), 0)
    _put(store, stream, SessionCreated(channel="chat"), 1)
    _put(store, stream, SessionCreated(channel="chat"), 2)  # overwritten below
    _put(store, stream, SessionCreated(channel="chat"), 3)
    store.close()
    payload = {"type": tag, "call_id": {"nested": "now"}, "limit_ms": "five seconds"}
    raw = [3, stream, 2, T0 + 2, "f" * 32, None, None, 99, payload]
    _overwrite(where, 3, msgspec.msgpack.encode(raw))
    return 3


def test_a_decision_from_a_newer_version_is_reported_undecodable_not_a_crash(
    lmdb_store: EventStore, store_dir: Path
) -> None:
    """A record of a known decision tag (``execution:prompt_timeout``) at a newer schema
    that no longer fits its class is kept as an UnknownEvent. Verify then still hands it
    to the tag's verifier, whose ``assert isinstance(found, PromptTimeout)`` fails: the
    CLI dies with an AssertionError instead of the promised UNDECODABLE finding ("kept as
    raw bytes and shown ... Replay reports it and reads on past it")."""
    position = _newer_decision(lmdb_store, store_dir, "execution:prompt_timeout", "session:a")
    result = CliRunner().invoke(cli, ["--store", str(store_dir), "replay", "--all", "--verify"])
    assert not isinstance(result.exception, AssertionError), "verify crashed: AssertionError"
    assert result.exit_code == 1
    assert f"UNDECODABLE  position {position}" in result.output


def test_an_undecodable_decision_is_not_also_reported_as_a_decision_that_does_not_follow(
    lmdb_store: EventStore, store_dir: Path
) -> None:
    """An undecodable ``provider:degraded`` (newer schema) is reported UNDECODABLE, whose
    message says "its decisions cannot be checked", and then also DOES NOT FOLLOW: it is
    compared with what the policy decides, which can never equal an UnknownEvent. The
    operator is told the runtime took a wrong decision when verify could not read it."""
    _newer_decision(lmdb_store, store_dir, "provider:degraded", "provider:main")
    store = store_module.open(store_dir, create=False)
    try:
        report = verify_store(store, None)
    finally:
        store.close()
    assert [f.kind for f in report.findings] == ["undecodable"], _where(report)


# -- 4. an Agent that crashed in the middle of its model call ---------------------------------


def test_a_call_cut_short_by_an_agent_crash_is_not_a_missed_prompt_timeout(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The Agent dies during its model call; the supervisor restarts it
    (``supervisor:restarted`` for ``session:crash``), the call's HTTP request is closed,
    the wake is requeued and later answered (the golden "crash retried" path). The
    runtime owes no prompt timeout for the call the crash cut short, yet verify reports a
    MISSED DEADLINE ``execution:prompt_timeout`` for it as soon as another session's
    event passes its stall limit: only a ``runtime:started`` drops a dead actor's
    timers, not the restart of that very actor."""
    fake.add(Hang(model="m1"))
    fake.set_default(Answer(text="fine"))
    agent = AGENT | {"prompt_timeout_ms": 30_000, "retry_prompt_timeout_ms": 30_000}
    config = _config(
        fake,
        agents={"default": agent},
        activations={"backoff_base_ms": 60_000, "backoff_cap_ms": 60_000},
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        crash = rt.session("crash", channel="chat")
        crash.send("hello")
        fake.wait_for(lambda requests: len(requests) == 1, GUARD)
        crash.ref.tell(object())  # the Agent does not understand it: it crashes
        log_until(store, "session:crash", has(ActivationRequeued))
        assert fake.wait_finished(0, GUARD).outcome == "client_closed"
        clock.advance(40)
        rt.session("other", channel="chat").send("hi")
        delivered(rt, chat, 1)
        clock.advance(10)
        rt.session("other", channel="chat").send("hi again")
        delivered(rt, chat, 2)
        clock.advance(10)
        log_until(store, "session:crash", has(ActivationAcked))
    report = verify_store(store, None)
    assert report.checked.get("supervisor:restarted") == 1
    assert _where(report) == []
    # verifying the one stream reads its actor's restart from the runtime stream too
    assert _where(verify_store(store, "session:crash")) == []


def _call_then_restart(store: EventStore, actor: str | None) -> None:
    """A call with a 5 s stall limit in ``session:s`` at 1 s; ``actor`` (if any) restarted
    by the supervisor at 2 s; the stream's next event at 60 s, long past the limit."""
    _put(store, "runtime", _started(), 0)
    _put(store, "session:s", TurnStarted(turn_id="t1"), 1)
    started = PromptStarted(
        call_id="c1", provider="main", model="m1", deadline_kind="stall", timeout_ms=5_000
    )
    _put(store, "session:s", started, 1)
    if actor is not None:
        supervision = Config().supervision
        restarted = decide_restart(
            actor,
            (),
            T0 + 2,
            reason="TypeError",
            max_restarts=supervision.max_restarts,
            within_ms=supervision.within_ms,
            backoff_base_ms=supervision.restart_backoff_base_ms,
            backoff_cap_ms=supervision.restart_backoff_cap_ms,
        )
        _put(store, "runtime", restarted, 2)
    note = MessageAppended(message_id="m1", role="user", content="still there?")
    _put(store, "session:s", note, 60)


@pytest.mark.parametrize("target", [None, "session:s"], ids=["every stream", "the stream"])
def test_the_restart_of_a_streams_actor_drops_its_prompt_deadline(
    lmdb_store: EventStore, target: str | None
) -> None:
    _call_then_restart(lmdb_store, "session:s")
    assert _where(verify_store(lmdb_store, target)) == []


@pytest.mark.parametrize("actor", [None, "session:other"], ids=["no restart", "another actor"])
def test_without_its_actors_restart_the_prompt_deadline_is_missed(
    lmdb_store: EventStore, actor: str | None
) -> None:
    _call_then_restart(lmdb_store, actor)
    for target in (None, "session:s"):
        report = verify_store(lmdb_store, target)
        assert [(f.kind, f.tag) for f in report.findings] == [
            ("missed", "execution:prompt_timeout")
        ], target


# -- 5. agents and providers whose names hold a dot --------------------------------------------


def test_a_retry_of_an_agent_whose_name_has_a_dot_verifies_clean(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Config keys are free-form names (``agents.support.v2``, ``providers.eu.main``).
    Verify builds knob paths as dotted strings (``f"agents.{agent}.max_retries"``) and
    splits them on ".", so for such names every retry, fallback and breaker decision the
    real runtime recorded is reported DOES NOT FOLLOW ("replay could not re-run the
    decision: the config in force has no 'agents.support.v2.max_retries'")."""
    fake.add(Fail(status=503))
    fake.set_default(Answer(text="fine"))
    config = parse_config(
        {
            "providers": {"eu.main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {
                "support.v2": AGENT
                | {"provider": "eu.main", "max_retries": 2, "retry_base_ms": 1, "retry_cap_ms": 2}
            },
        }
    )
    with Runtime(config, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("a", agent="support.v2", channel="chat").send("one")
        assert delivered_by_clock(clock, chat, 1)[0].text == "fine"
    report = verify_store(store, "session:a")
    assert report.checked.get("prompt:retry_scheduled") == 1
    assert _where(report) == []


# -- 6. the dead-letter queue's retries --------------------------------------------------------


def test_dead_letter_retries_past_max_retries_and_before_their_backoff_are_found(
    lmdb_store: EventStore, store_dir: Path
) -> None:
    """docs/replay.md: "What the queue then does with the entry (its retries and
    announcement:dead_letter_expired) is verified." Here one entry is retried 8 times
    within a second of being queued (max_retries is 5; the first retry is due after
    retry_base_ms = 30 s) and never expired for its spent retries, though the log goes on
    for ten minutes. Verify calls this clean; it should report the retries that do not
    follow, or at least the ``retries_exhausted`` expiry that never came."""
    store = lmdb_store
    _put(store, "runtime", _started(), 0)
    queued = AnnouncementDeadLettered(
        entry_id="e1", announcement_id="n1", channel="chat", text="sorry", reason="send_failed"
    )
    _put(store, "deadletter", queued, 1)
    for attempt in range(8):
        failed = AnnouncementSendFailed(announcement_id="n1", error_class="timeout", entry_id="e1")
        _put(store, "deadletter", failed, 1.1 + attempt / 10)
    for minute in range(1, 11):
        _put(store, "session:chat", TurnStarted(turn_id=f"t{minute}"), 60 * minute)
    _put(store, "runtime", RuntimeStopped(), 601)
    report = verify_store(store, None)
    assert not report.clean, "8 retries of one dead letter in a second, none expired: clean"


def _letter_log(store: EventStore, retries: list[tuple[float, int, str]]) -> None:
    """One dead letter queued at 1 s; each ``(at, attempt, reason)`` a recorded retry of it
    that then fails; then the log goes on to 601 s with the entry expired at its hour
    (``max_retries`` 5, ``retry_base_ms`` 30 s: retry ``n`` is due ``30 x 2**(n-1)`` s
    after the attempt before it)."""
    _put(store, "runtime", _started(), 0)
    queued = AnnouncementDeadLettered(
        entry_id="e1", announcement_id="n1", channel="chat", text="sorry", reason="send_failed"
    )
    _put(store, "deadletter", queued, 1)
    for at, attempt, reason in retries:
        provider = "main" if reason == "drain" else None
        if provider is not None:  # what a drain follows (verify checks that one did)
            _put(store, "provider:main", ProviderRecovered(provider="main"), at)
        retried = AnnouncementDeadLetterRetried(
            entry_id="e1",
            attempt=attempt,
            reason=reason,  # type: ignore[arg-type]
            provider=provider,
        )
        _put(store, "deadletter", retried, at)
        failed = AnnouncementSendFailed(announcement_id="n1", error_class="timeout", entry_id="e1")
        _put(store, "deadletter", failed, at)
    _put(store, "runtime", RuntimeStopped(), 601)


def test_dead_letter_retries_on_their_backoff_and_a_drain_at_any_time_verify_clean(
    lmdb_store: EventStore,
) -> None:
    _letter_log(lmdb_store, [(31, 1, "backoff"), (40, 2, "drain"), (160, 3, "backoff")])
    report = verify_store(lmdb_store, None)
    assert report.checked.get("announcement:dead_letter_retried") == 3
    # the queue's stream only: the hand-made provider:recovered follows no outage
    assert [f for f in report.findings if f.stream == "deadletter"] == []


@pytest.mark.parametrize(
    ("retries", "why"),
    [
        ([(30.5, 1, "backoff")], "it went 500 ms early"),  # due at 31 s
        ([(31, 2, "backoff")], "this is not attempt 2"),
        ([(31, 1, "backoff"), (40, 1, "drain")], "this is not attempt 1"),
    ],
    ids=["before its backoff", "wrong attempt", "drain with a stale attempt"],
)
def test_a_dead_letter_retry_that_does_not_follow_is_a_mismatch(
    lmdb_store: EventStore, retries: list[tuple[float, int, str]], why: str
) -> None:
    _letter_log(lmdb_store, retries)
    report = verify_store(lmdb_store, None)
    # the queue's stream only: the hand-made provider:recovered follows no outage
    [finding] = [f for f in report.findings if f.stream == "deadletter"]
    assert (finding.kind, finding.tag) == ("mismatch", "announcement:dead_letter_retried")
    assert why in finding.message, finding.message


def test_a_dead_letter_retry_past_max_retries_is_a_mismatch(lmdb_store: EventStore) -> None:
    """Five retries spent at 31, 91, 211, 451 and 931 s would be clean; here the fifth
    failure is followed by a sixth retry instead of the ``retries_exhausted`` expiry."""
    store = lmdb_store
    _put(store, "runtime", _started(dead_letters={"max_age_ms": 7_200_000}), 0)
    queued = AnnouncementDeadLettered(
        entry_id="e1", announcement_id="n1", channel="chat", text="sorry", reason="send_failed"
    )
    _put(store, "deadletter", queued, 1)
    for attempt, at in enumerate((31, 91, 211, 451, 931, 1_000), start=1):
        retried = AnnouncementDeadLetterRetried(entry_id="e1", attempt=attempt)
        _put(store, "deadletter", retried, at)
        failed = AnnouncementSendFailed(announcement_id="n1", error_class="timeout", entry_id="e1")
        _put(store, "deadletter", failed, at)
    report = verify_store(store, None)
    kinds = [(f.kind, f.tag) for f in report.findings]
    assert ("mismatch", "announcement:dead_letter_retried") in kinds, _where(report)
    assert "already spent dead_letters.max_retries" in report.findings[0].message


# -- 7. a retry the failed call's attempt does not allow ---------------------------------------


def test_a_retry_after_the_last_allowed_attempt_is_a_mismatch(
    lmdb_store: EventStore,
) -> None:
    """``max_retries = 1``: a model may be tried twice. The log shows the second attempt
    (its ``prompt:started`` records ``attempt=2``) failing with a 503, then a
    ``prompt:retry_scheduled`` for that very call and a third attempt. The retry records
    ``attempt=2`` (as if it followed the first failure), and verify takes the attempt
    from the retry itself instead of from the failed call it names, so the retry past
    max_retries passes as clean."""
    store = lmdb_store
    started = _started(
        providers={"p": {"kind": "openai", "base_url": "http://127.0.0.1:9/v1"}},
        agents={"default": {"provider": "p", "model": "m1", "max_retries": 1}},
    )
    _put(store, "runtime", started, 0)
    s = "session:a"
    _put(store, s, TurnStarted(turn_id="t1"), 1)

    def call(call_id: str, attempt: int, at: float) -> None:
        kind = "stall" if attempt == 1 else "whole_call"
        started = PromptStarted(
            call_id=call_id,
            provider="p",
            model="m1",
            attempt=attempt,
            deadline_kind=kind,
            timeout_ms=5_000,
            makespan_ms=50_000 if attempt == 1 else 0,
        )
        _put(store, s, started, at)
        failed = PromptFailed(
            call_id=call_id, error_class="unavailable", status=503, retryable=True
        )
        _put(store, s, failed, at)

    def retry(call_id: str, attempt: int, delay_ms: int, at: float) -> None:
        event = PromptRetryScheduled(
            call_id=call_id,
            attempt=attempt,
            delay_ms=delay_ms,
            reason="unavailable",
            agent="default",
            status=503,
            jitter=0.5,
        )
        _put(store, s, event, at)

    call("c1", 1, 1)
    retry("c1", 2, 250, 1)  # retry 1 of 1: jitter 0.5 of min(8000, 500 ms) = 250 ms
    call("c2", 2, 1.5)
    retry("c2", 2, 250, 1.5)  # a second retry, recorded as if it were the first
    call("c3", 3, 2)
    report = verify_store(store, s)
    assert report.checked.get("prompt:retry_scheduled") == 2
    assert [(f.kind, f.tag) for f in report.findings] == [("mismatch", "prompt:retry_scheduled")], (
        _where(report)
    )


# -- 8. time: streams x restarts ---------------------------------------------------------------


def _sessions_and_restarts(count: int) -> list[RecordedEvent]:
    """``count`` process lives, each answering one new session's turn."""
    config = parse_config({}).to_record()
    records: list[RecordedEvent] = []
    versions: dict[str, int] = {}

    def add(stream: str, event: Event, at: float) -> None:
        version = versions[stream] = versions.get(stream, 0) + 1
        record = recorded(event, T0 + at, version, stream)
        records.append(msgspec.structs.replace(record, position=len(records) + 1))

    for life in range(count):
        at = 10.0 * life
        add("runtime", RuntimeStarted(config=config, stalwart_version="test"), at)
        add(f"session:s{life}", SessionCreated(channel="chat"), at + 1)
        add(f"session:s{life}", TurnStarted(turn_id="t"), at + 1)
        add(f"session:s{life}", TurnCompleted(turn_id="t"), at + 2)
        add("runtime", RuntimeStopped(), at + 3)
    return records


def _cpu(records: list[RecordedEvent]) -> float:
    best = float("inf")
    for _ in range(2):
        began = time.process_time()
        report = verify(records, REGISTRY, defaults=default_knobs())
        best = min(best, time.process_time() - began)
        assert report.clean
    return best


@pytest.mark.slow
def test_verify_time_grows_linearly_with_a_logs_restarts_and_sessions() -> None:
    """Every ``runtime:started`` recomputes every deadline of every stream seen so far,
    pending or not, so a store whose processes restarted R times over S sessions costs
    R x S: four times the log (four times the sessions and the restarts) takes about
    sixteen times as long (a 10 000-event log like this takes about 10 s). Only the
    deadlines that are pending need a look at a restart; the walk should stay linear."""
    small, large = _sessions_and_restarts(250), _sessions_and_restarts(1_000)
    ratio = _cpu(large) / _cpu(small)
    assert ratio < 8, f"4x the log took {ratio:.1f}x the time"
