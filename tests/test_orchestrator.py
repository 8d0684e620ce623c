"""The orchestrator projection: every stream folded into what the operator's views show."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    ActivationRequeued,
    AnnouncementDeadLettered,
    AnnouncementSendFailed,
    BreakerOpened,
    LeaseExpired,
    ProviderCallFailed,
    ProviderDegraded,
    RecordedEvent,
    SessionCreated,
    SessionRequiresAction,
)
from stalwart.runtime import confirm, send_message
from stalwart.state import (
    ABANDONED_KEPT,
    ACTIVATIONS,
    SESSION,
    OrchestratorFolder,
    OrchestratorState,
    apply_activations,
    apply_orchestrator,
    retry_posture,
    session_dead_letters,
)
from stalwart.store import EventStore


def _log(store: EventStore, clock: FakeClock) -> dict[str, str]:
    """Two sessions (one retrying after an expired lease, one waiting for an approval),
    one abandoned activation, a dead-lettered announcement and a degraded provider."""
    a1 = send_message(store, "s1", "first")
    store.append(
        "session:s1",
        [ActivationLeased(activation_id=a1, owner="w1", epoch=1, expires_at=clock.now() + 30)],
    )
    clock.advance(40)
    store.append(
        "session:s1",
        [
            LeaseExpired(
                activation_id=a1, owner="w1", epoch=1, expired_at=clock.now() - 10, streak=1
            ),
            ActivationLeased(activation_id=a1, owner="w2", epoch=2, expires_at=clock.now() + 30),
        ],
    )
    clock.advance(1)
    store.append(
        "session:s1",
        [
            ActivationRequeued(
                activation_id=a1,
                epoch=2,
                delay_ms=4000,
                streak=2,
                run_at=clock.now() + 4,
                error_class="provider_timeout",
            )
        ],
    )
    a2 = send_message(store, "s2", "second")
    store.append(
        "session:s2",
        [ActivationLeased(activation_id=a2, owner="w1", epoch=1, expires_at=clock.now() + 30)],
    )
    store.append(
        "session:s2",
        [SessionRequiresAction(request_id="r1", kind="approval", tool="rm", arguments='{"p": 1}')],
    )
    store.append("session:s2", [ActivationAcked(activation_id=a2, epoch=1)])
    store.append(
        "session:s3",
        [SessionCreated(), ActivationReady(activation_id="w9", kind="wake", text="later")],
    )
    store.append(
        "session:s3",
        [
            ActivationAbandoned(
                activation_id="w9", attempts=1, error_class="bad_request", retryable=False
            )
        ],
    )
    store.append(
        "deadletter",
        [
            AnnouncementDeadLettered(
                entry_id="e1",
                announcement_id="n1",
                channel="chat",
                text="hi",
                reason="timeout",
                conversation="s2",
            ),
            AnnouncementSendFailed(announcement_id="n1", error_class="send_timeout", entry_id="e1"),
        ],
    )
    store.append(
        "provider:openai",
        [
            ProviderCallFailed(provider="openai", model="m", agent="a", error_class="server_error"),
            ProviderDegraded(provider="openai", rule="agents", agents=("a", "b"), failures=3),
            BreakerOpened(provider="openai", failures=5, threshold=5),
        ],
    )
    return {"a1": a1, "a2": a2}


@pytest.fixture
def records(lmdb_store: EventStore, clock: FakeClock) -> list[RecordedEvent]:
    _log(lmdb_store, clock)
    return list(lmdb_store.read_all())


def _fold(records: list[RecordedEvent]) -> OrchestratorState:
    folder = OrchestratorFolder()
    for record in records:
        folder.add(record)
    return folder.state()


def test_sessions_carry_their_session_and_activation_folds(records: list[RecordedEvent]) -> None:
    state = _fold(records)
    assert [v.stream for v in state.sessions] == ["session:s1", "session:s2", "session:s3"]
    for view in state.sessions:
        own = [r for r in records if r.stream == view.stream]
        expected_session = SESSION.initial(view.stream)
        expected_activations = ACTIVATIONS.initial(view.stream)
        for record in own:
            expected_session = SESSION.apply(expected_session, record)
            expected_activations = apply_activations(expected_activations, record)
        assert view.session == expected_session
        assert view.activations == expected_activations
    assert state.position == records[-1].position
    assert state.newest_ts == max(r.ts for r in records)


def test_retrying_session_shows_its_posture(records: list[RecordedEvent]) -> None:
    s1 = _fold(records).find("session:s1")
    assert s1 is not None
    posture = retry_posture(s1.activations)
    assert (posture.attempt, posture.streak, posture.last_error) == (3, 2, "provider_timeout")
    assert posture.next_run_at == s1.activations.queue[0].run_at
    assert posture.retrying == s1.activations.queue[0].activation_id
    assert s1.activations.expired == 1
    assert [c.ended for c in s1.activations.history] == ["expired", "requeued"]


def test_posture_of_an_idle_and_a_fresh_session(records: list[RecordedEvent]) -> None:
    state = _fold(records)
    s2 = state.find("session:s2")
    assert s2 is not None
    assert retry_posture(s2.activations).attempt is None
    assert s2.session.pending is not None
    assert s2.session.pending.request_id == "r1"
    fresh = _fold(records[:2]).find("session:s1")  # created and ready, nothing else
    assert fresh is not None
    posture = retry_posture(fresh.activations)
    assert (posture.attempt, posture.streak, posture.retrying) == (1, 0, None)


def test_dead_letter_backlog_has_both_halves(records: list[RecordedEvent]) -> None:
    state = _fold(records)
    assert [(a.session, a.activation_id, a.kind, a.text) for a in state.abandoned] == [
        ("session:s3", "w9", "wake", "later")
    ]
    assert state.abandoned_total == 1
    (entry,) = state.deadletter.entries
    assert (entry.entry_id, entry.attempts, entry.last_error) == ("e1", 1, "send_timeout")
    assert session_dead_letters(state, "session:s2") == ((), (entry,))
    assert session_dead_letters(state, "session:s3") == (state.abandoned, ())
    assert session_dead_letters(state, "session:s1") == ((), ())


def test_provider_health_and_breaker(records: list[RecordedEvent]) -> None:
    (provider,) = _fold(records).providers
    assert provider.provider == "openai"
    assert provider.health.status == "degraded"
    assert provider.breaker.status == "open"


def test_folding_in_pieces_equals_folding_all(records: list[RecordedEvent]) -> None:
    whole = _fold(records)
    for split in range(len(records) + 1):
        folder = OrchestratorFolder()
        for record in records[:split]:
            folder.add(record)
        resumed = OrchestratorFolder(folder.state())
        for record in records[split:]:
            resumed.add(record)
        assert resumed.state() == whole, split


def test_state_asked_between_adds_equals_the_fold_and_reuses_what_did_not_change(
    records: list[RecordedEvent],
) -> None:
    """A live view asks a folder for its state between adds (``watch``, every second):
    each answer equals folding the records so far afresh, and the sessions no event
    touched since the last answer are the same objects (nothing rebuilt for them)."""
    folder = OrchestratorFolder()
    before = folder.state()
    for count, record in enumerate(records, start=1):
        folder.add(record)
        state = folder.state()
        assert state == _fold(records[:count]), count
        assert folder.state().sessions is state.sessions  # no add between: kept whole
        previous = {view.stream: view for view in before.sessions}
        for view in state.sessions:
            if view.stream != record.stream and view.stream in previous:
                assert view is previous[view.stream], (count, view.stream)
        before = state


def test_apply_is_the_folder_event_by_event(records: list[RecordedEvent]) -> None:
    state = OrchestratorState()
    for record in records:
        state = apply_orchestrator(state, record)
    assert state == _fold(records)


def test_abandoned_activations_kept_are_bounded(tmp_path: Path, clock: FakeClock) -> None:
    store = store_module.open(tmp_path / "many", clock=clock)
    try:
        for n in range(ABANDONED_KEPT + 5):
            store.append(
                "session:s",
                [
                    ActivationReady(activation_id=f"a{n}", kind="wake"),
                    ActivationAbandoned(activation_id=f"a{n}", attempts=5, error_class="internal"),
                ],
            )
        state = _fold(list(store.read_all()))
    finally:
        store.close()
    assert state.abandoned_total == ABANDONED_KEPT + 5
    assert len(state.abandoned) == ABANDONED_KEPT
    assert state.abandoned[0].activation_id == "a5"


def test_a_confirmation_clears_the_pending_request(
    lmdb_store: EventStore, clock: FakeClock
) -> None:
    _log(lmdb_store, clock)
    folder = OrchestratorFolder()
    for record in lmdb_store.read_all():
        folder.add(record)
    confirm(lmdb_store, "s2", "r1", allow=True)
    for record in lmdb_store.read_all(folder.position + 1):
        folder.add(record)
    s2 = folder.state().find("session:s2")
    assert s2 is not None
    assert s2.session.pending is None
    assert [a.kind for a in s2.activations.queue] == ["resume"]
