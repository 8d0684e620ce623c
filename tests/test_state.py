"""Folds: the session fold's rules, fold algebra, and snapshot rebuilds from a real store."""

from __future__ import annotations

from pathlib import Path

import lmdb
import msgspec
import pytest
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import (
    ContextDagDegraded,
    ContextSummaryCreated,
    Event,
    ExecutionAborted,
    MessageAppended,
    PromptFailed,
    PromptStarted,
    PromptTimeout,
    ProviderDegraded,
    RecordedEvent,
    SessionClosed,
    SessionCreated,
    SessionRequiresAction,
    ToolFailed,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
    UserInterrupt,
    UserToolConfirmation,
)
from stalwart.runtime import Runtime
from stalwart.state import (
    BREAKER,
    CONTEXT_DAG,
    SESSION,
    SUMMARY,
    SessionAggregate,
    SessionState,
    aggregate_for,
    apply_session,
    fold,
    fold_streams,
    under_way,
)
from stalwart.store import DEFAULT_SNAPSHOT_EVERY, EventStore, Snapshot, load_state, snapshot_name
from tests._log import FoldedLog, recorded


def records(events: list[Event], stream: str = "session:s") -> list[RecordedEvent]:
    return [
        RecordedEvent(
            position=i,
            stream=stream,
            version=i,
            ts=100.0 + i,
            id=f"e{i}",
            causation_id=None,
            correlation_id=None,
            schema=1,
            event=event,
        )
        for i, event in enumerate(events, start=1)
    ]


def session(events: list[Event]) -> SessionState:
    return fold(SESSION, "session:s", records(events))


def test_a_conversation_turn() -> None:
    state = session(
        [
            SessionCreated(agent="helper", channel="chat:1", title="t"),
            TurnStarted(turn_id="t1"),
            MessageAppended(message_id="m1", role="user", content="hello"),
            MessageAppended(message_id="m2", role="assistant", content="hi"),
        ]
    )
    assert state.status == "running"
    assert state.current_turn == "t1"
    assert (state.messages, state.user_messages, state.assistant_messages) == (2, 1, 1)
    assert state.last_message is not None
    assert state.last_message.excerpt == "hi"
    assert (state.agent, state.channel, state.created_at, state.version) == (
        "helper",
        "chat:1",
        101.0,
        4,
    )
    done = apply_session(state, records([*[SessionCreated()] * 4, TurnCompleted(turn_id="t1")])[-1])
    assert done.status == "idle"
    assert done.last_turn_outcome == "answered"
    assert done.current_turn is None


def test_approval_pause_and_resume() -> None:
    paused = session(
        [
            SessionCreated(),
            TurnStarted(turn_id="t1"),
            SessionRequiresAction(request_id="r1", kind="approval", tool="rm", arguments="{}"),
            TurnCompleted(turn_id="t1", outcome="paused"),
        ]
    )
    assert paused.status == "requires_action"
    assert paused.pending is not None
    assert paused.pending.request_id == "r1"
    wrong = apply_session(
        paused,
        records([SessionCreated()] * 4 + [UserToolConfirmation(request_id="nope", allow=True)])[-1],
    )
    assert wrong.status == "requires_action"
    right = apply_session(
        paused,
        records([SessionCreated()] * 4 + [UserToolConfirmation(request_id="r1", allow=True)])[-1],
    )
    assert right.status == "idle"
    assert right.pending is None


def test_interrupt_abort_close_and_tool_counts() -> None:
    state = session(
        [
            SessionCreated(),
            TurnStarted(turn_id="t1"),
            ToolStarted(call_id="c1", tool="search"),
            ToolFailed(call_id="c1", tool="search", error_class="timeout"),
            ExecutionAborted(reason="pipeline_timeout", turn_id="t1"),
        ]
    )
    assert (state.status, state.last_turn_outcome, state.tool_calls, state.tool_failures) == (
        "idle",
        "aborted",
        1,
        1,
    )
    interrupted = session([SessionCreated(), TurnStarted(turn_id="t"), UserInterrupt()])
    assert interrupted.status == "idle"
    assert interrupted.current_turn is None
    closed = session([SessionCreated(), SessionClosed(reason="done")])
    assert (closed.status, closed.closed_reason) == ("closed", "done")


def test_unrelated_events_only_move_version() -> None:
    state = session([SessionCreated(), ProviderDegraded(provider="p", rule="agents")])
    assert state.version == 2
    assert state.status == "idle"


def test_replay_picks_a_fold_by_stream() -> None:
    assert aggregate_for("session:abc") is SESSION
    assert aggregate_for("provider:openai") is BREAKER
    assert aggregate_for("runtime") is SUMMARY
    summary = fold(SUMMARY, "runtime", records([SessionCreated(), SessionCreated()], "runtime"))
    assert summary.counts == {"session:created": 2}
    assert (summary.first_ts, summary.last_ts) == (101.0, 102.0)


# -- fold algebra ---------------------------------------------------------------------------------

SESSION_EVENTS = st.one_of(
    st.builds(SessionCreated, agent=st.sampled_from(["a", "b"])),
    st.builds(
        MessageAppended,
        message_id=st.text(max_size=3),
        role=st.sampled_from(["user", "assistant", "tool"]),
        content=st.text(max_size=20),
    ),
    st.builds(TurnStarted, turn_id=st.sampled_from(["t1", "t2"])),
    st.builds(TurnCompleted, turn_id=st.sampled_from(["t1", "t2"])),
    st.builds(
        SessionRequiresAction,
        request_id=st.sampled_from(["r1", "r2"]),
        kind=st.just("approval"),
        tool=st.just("x"),
    ),
    st.builds(UserToolConfirmation, request_id=st.sampled_from(["r1", "r2"]), allow=st.booleans()),
    st.builds(UserInterrupt),
    st.builds(ToolStarted, call_id=st.just("c"), tool=st.just("t")),
    st.builds(ToolFailed, call_id=st.just("c"), tool=st.just("t"), error_class=st.just("e")),
    st.builds(ExecutionAborted, reason=st.just("pipeline_timeout")),
    st.builds(ProviderDegraded, provider=st.just("p"), rule=st.just("agents")),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(SESSION_EVENTS, max_size=40), st.integers(min_value=0, max_value=40))
def test_fold_of_prefix_then_rest_equals_fold_of_all(events: list[Event], cut: int) -> None:
    recs = records(events)
    cut = min(cut, len(recs))
    whole = fold(SESSION, "session:s", recs)
    prefix = fold(SESSION, "session:s", recs[:cut])
    assert fold(SESSION, "session:s", recs[cut:], prefix) == whole


@settings(max_examples=100, deadline=None)
@given(st.lists(SESSION_EVENTS, max_size=40))
def test_session_state_survives_snapshot_encoding(events: list[Event]) -> None:
    state = session(events)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=SessionState) == state


@settings(max_examples=200, deadline=None)
@given(st.lists(SESSION_EVENTS, max_size=40), st.integers(min_value=0, max_value=40))
def test_a_folder_equals_applying_event_by_event(events: list[Event], peek: int) -> None:
    recs = records(events)
    one_by_one = SESSION.initial("session:s")
    for record in recs:
        one_by_one = SESSION.apply(one_by_one, record)
    folder = SESSION.folder(SESSION.initial("session:s"))
    for i, record in enumerate(recs):
        if i == peek:
            folder.state()  # looking at the state mid-way changes nothing
        folder.add(record)
    assert folder.state() == one_by_one


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["session:a", "session:b", "provider:p"]), SESSION_EVENTS),
        max_size=60,
    )
)
def test_fold_streams_equals_folding_each_stream(tagged: list[tuple[str, Event]]) -> None:
    versions: dict[str, int] = {}
    log = []
    for position, (stream, event) in enumerate(tagged, start=1):
        versions[stream] = versions.get(stream, 0) + 1
        log.append(
            RecordedEvent(
                position=position,
                stream=stream,
                version=versions[stream],
                ts=float(position),
                id=str(position),
                causation_id=None,
                correlation_id=None,
                schema=1,
                event=event,
            )
        )
    states = fold_streams(log, aggregate_for)
    assert set(states) == set(versions)
    for stream, state in states.items():
        own = [r for r in log if r.stream == stream]
        assert state == fold(aggregate_for(stream), stream, own)


# -- snapshots against a real store ---------------------------------------------------------------


def _fill(store: EventStore, n: int) -> None:
    store.append("session:s", [SessionCreated()])
    batch: list[Event] = [
        MessageAppended(message_id=str(i), role="user", content=f"m{i}") for i in range(n - 1)
    ]
    for start in range(0, len(batch), 200):
        store.append("session:s", batch[start : start + 200])


def test_rebuild_saves_snapshots_every_n_events(lmdb_store: EventStore) -> None:
    _fill(lmdb_store, 1200)
    full = load_state(lmdb_store, "session:s", SESSION, use_snapshots=False, snapshot_every=0)
    first = load_state(lmdb_store, "session:s", SESSION, snapshot_every=500)
    assert first == full
    [snap] = lmdb_store.snapshots("session:s", snapshot_name(SESSION))
    assert snap.version == 1200
    lmdb_store.append("session:s", [TurnStarted(turn_id="t")])
    again = load_state(lmdb_store, "session:s", SESSION, snapshot_every=500)
    assert again.version == 1201
    assert again.status == "running"
    assert [s.version for s in lmdb_store.snapshots("session:s", snapshot_name(SESSION))] == [1200]


def test_the_configs_snapshot_every_is_the_stores_and_load_states_default(
    tmp_path: Path, clock: FakeClock
) -> None:
    """``store.snapshot_every`` in the config reaches the store the runtime (and the CLI)
    opens from it, and every ``load_state`` that does not say otherwise follows it: the
    runtime's folds save snapshots at that cadence, 0 never. (It used to be a knob that
    nothing read: every fold saved at 500 whatever the config said.)"""
    every = parse_config({"store": {"location": str(tmp_path / "a"), "snapshot_every": 20}})
    never = parse_config({"store": {"location": str(tmp_path / "b"), "snapshot_every": 0}})
    for cfg, saved in ((every, [30]), (never, [])):
        with store_module.open_configured(cfg.store, clock=clock) as store:  # type: ignore[attr-defined]
            assert store.snapshot_every == cfg.store.snapshot_every
            _fill(store, 30)
            load_state(store, "session:s", SESSION)
            snapshots = store.snapshots("session:s", snapshot_name(SESSION))
            assert [snap.version for snap in snapshots] == saved
    with Runtime(every, clock=clock) as rt:
        assert rt.store.location == str(tmp_path / "a")
        assert rt.store.snapshot_every == 20
    with store_module.open(tmp_path / "c") as default:  # type: ignore[attr-defined]
        assert default.snapshot_every == DEFAULT_SNAPSHOT_EVERY
    with pytest.raises(ValueError, match="snapshot_every"):
        store_module.open(tmp_path / "d", snapshot_every=-1)
    with pytest.raises(ValueError, match="poll_interval"):
        store_module.open(tmp_path / "e", poll_interval=0)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(n=st.integers(min_value=1, max_value=60), every=st.integers(min_value=1, max_value=25))
def test_snapshot_rebuild_equals_full_fold(tmp_path: Path, n: int, every: int) -> None:
    with store_module.open(tmp_path / f"s-{n}-{every}") as store:  # type: ignore[attr-defined]
        for i in range(n):
            store.append("session:s", [MessageAppended(message_id=str(i), role="user")])
            load_state(store, "session:s", SESSION, snapshot_every=every)
        full = load_state(store, "session:s", SESSION, use_snapshots=False, snapshot_every=0)
        assert load_state(store, "session:s", SESSION, snapshot_every=0) == full


class _LongNamed(SessionAggregate):
    name = "a-fold-whose-name-is-too-long-for-a-snapshot-key-" * 3


def test_a_snapshot_that_cannot_be_saved_leaves_the_state_right(lmdb_store: EventStore) -> None:
    """Saving a snapshot only saves time: when the store refuses it (here a fold name too
    long for a key; a full disk or an outage alike), the fold is still returned."""
    _fill(lmdb_store, 30)
    full = load_state(lmdb_store, "session:s", SESSION, use_snapshots=False, snapshot_every=0)
    with structlog.testing.capture_logs() as captured:
        state = load_state(lmdb_store, "session:s", _LongNamed(), snapshot_every=10)
    assert state == full
    assert [e["event"] for e in captured if e["log_level"] == "warning"] == [
        "state.snapshot_not_saved"
    ]


def test_time_travel_ignores_newer_snapshots(lmdb_store: EventStore) -> None:
    _fill(lmdb_store, 600)
    load_state(lmdb_store, "session:s", SESSION, snapshot_every=100)
    past = load_state(lmdb_store, "session:s", SESSION, until_position=10)
    assert past.version == 10
    assert past.messages == 9


def test_undecodable_snapshot_falls_back_to_the_full_fold(lmdb_store: EventStore) -> None:
    _fill(lmdb_store, 50)
    lmdb_store.put_snapshot(
        Snapshot(
            stream="session:s",
            name=snapshot_name(SESSION),
            version=40,
            position=40,
            data=b"\xc1junk",
        )
    )
    full = load_state(lmdb_store, "session:s", SESSION, use_snapshots=False, snapshot_every=0)
    assert load_state(lmdb_store, "session:s", SESSION, snapshot_every=0) == full


def test_bit_rot_in_a_snapshot_is_caught_by_its_checksum(store_dir: Path) -> None:
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        _fill(store, 30)
        load_state(store, "session:s", SESSION, snapshot_every=10)  # snapshot at 30
        store.append("session:s", [MessageAppended(message_id="x", role="user")] * 15)
        load_state(store, "session:s", SESSION, snapshot_every=10)  # snapshot at 45
        full = load_state(store, "session:s", SESSION, use_snapshots=False, snapshot_every=0)
    env = lmdb.open(str(store_dir), max_dbs=8)
    db = env.open_db(b"snapshots")
    with env.begin(write=True) as txn:
        key, value = list(txn.cursor(db=db))[-1]  # the newest snapshot
        damaged = bytearray(value)
        damaged[-3] ^= 0xFF
        txn.put(key, bytes(damaged), db=db)
    env.close()
    with store_module.open(store_dir) as store:  # type: ignore[attr-defined]
        assert [s.version for s in store.snapshots("session:s", snapshot_name(SESSION))] == [30]
        assert load_state(store, "session:s", SESSION, snapshot_every=0) == full


def test_a_context_stream_replays_with_the_dag_fold() -> None:
    assert aggregate_for("context:s1") is CONTEXT_DAG


def test_the_dag_fold_keeps_the_summarizers_episode_across_other_degradations() -> None:
    """``degraded`` is what a new summarizer episode (``spend_cap`` / ``breaker_open``) is
    compared with after a restart: a clipped tail or a refused write in between neither
    ends the episode nor starts one."""
    folded = FoldedLog(CONTEXT_DAG, "context:s1")
    folded.add(ContextDagDegraded(reason="spend_cap", knob="k", used=9, limit=8), 1.0)
    folded.add(ContextDagDegraded(reason="tail_over_budget"), 2.0)
    folded.add(ContextDagDegraded(reason="fail_closed_rollover"), 3.0)
    assert (folded.state.degraded, folded.state.tail_clipped) == ("spend_cap", True)
    folded.add(ContextDagDegraded(reason="breaker_open"), 4.0)
    assert folded.state.degraded == "breaker_open"
    condensed = ContextSummaryCreated(summary_id="c1", depth=1, covers=(), descendant_count=0)
    folded.add(condensed, 5.0)  # a real summary again, at any depth: the episode is over
    assert folded.state.degraded is None


def test_calls_under_way_are_those_with_no_outcome_in_the_current_turn() -> None:
    """Each outcome ends its own call (by call id); a turn's end, a new turn, an
    interrupt and an abort end them all: a crash's leftovers are not under way."""

    def names(*events: Event) -> list[str]:
        log = [recorded(e, 1.0 + i, i + 1, "session:s") for i, e in enumerate(events)]
        return [call.call_id for call in under_way(log)]

    started = [
        PromptStarted(call_id="p1", provider="a", model="m"),
        ToolStarted(call_id="t1", tool="x"),
        PromptStarted(call_id="p2", provider="a", model="m", attempt=2),
    ]
    assert names(*started) == ["p1", "t1", "p2"]
    assert names(*started, PromptFailed(call_id="p1", error_class="e")) == ["t1", "p2"]
    assert names(
        *started, PromptTimeout(call_id="p2", limit="stall", knob="k", limit_ms=1, elapsed_ms=1)
    ) == [
        "p1",
        "t1",
    ]
    assert names(*started, ToolFailed(call_id="t1", tool="x", error_class="unreconciled")) == [
        "p1",
        "p2",
    ]
    for ender in (
        TurnStarted(turn_id="t2"),
        UserInterrupt(),
        ExecutionAborted(elapsed_ms=1, limit_ms=1, reason="interrupted"),
    ):
        assert names(*started, ender) == []
