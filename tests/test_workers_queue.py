"""The work queue (WorkQueue) on both stores: due rows written in the append's own
transaction, claims handed to one worker at a time, write-backs that never overwrite an
append they did not fold."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart import store as store_module
from stalwart.errors import ConcurrencyError, FencedError
from stalwart.events import (
    ActivationAcked,
    ActivationLeased,
    ActivationReady,
    Event,
    LeaseRenewed,
    MessageAppended,
)
from stalwart.store import Due, Fence, NewEvent, WorkQueue
from tests._postgres import install_old_schema

T0 = 1_000.0


@pytest.fixture(params=["lmdb", "postgres"])
def queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WorkQueue]:
    location = str(tmp_path / "store")
    if request.param == "postgres":
        location = request.getfixturevalue("pg_url")
    opened = store_module.open(location)
    assert isinstance(opened, WorkQueue)
    try:
        yield opened
    finally:
        opened.close()  # type: ignore[attr-defined]


def _ready(n: int, wake_at: float | None = None) -> ActivationReady:
    kind = "message" if wake_at is None else "wake"
    return ActivationReady(activation_id=f"a{n}", kind=kind, wake_at=wake_at)


def _at(event: Event, ts: float) -> NewEvent:
    return NewEvent(event=event, ts=ts)


def _claimed(queue: WorkQueue, owner: str, now: float, limit: int = 10) -> list[str]:
    return [c.stream for c in queue.claim_due(owner, now, limit, 5.0).claimed]


def test_a_new_activation_is_due_once_and_held_by_its_claimer(queue: WorkQueue) -> None:
    queue.append("session:a", [_at(_ready(1), T0)])
    queue.append("session:later", [_at(_ready(2, wake_at=T0 + 60), T0)])
    work = queue.claim_due("w1", T0 + 1, 10, 5.0)
    assert [c.stream for c in work.claimed] == ["session:a"]
    assert work.next_at == T0 + 60
    assert _claimed(queue, "w2", T0 + 1) == []  # held by w1
    assert _claimed(queue, "w1", T0 + 2) == ["session:a"]  # its holder may look again
    assert _claimed(queue, "w2", T0 + 7.5) == ["session:a"]  # w1's hold ran out
    assert _claimed(queue, "w3", T0 + 61) == ["session:a", "session:later"]


def test_only_session_activation_events_touch_the_queue(queue: WorkQueue) -> None:
    queue.append("deadletter", [_at(_ready(1), T0)])
    message = MessageAppended(message_id="m1", role="user", content="hi")
    queue.append("session:chat", [_at(message, T0)])
    assert _claimed(queue, "w", T0 + 100) == []


def test_an_exact_due_time_needs_the_version_it_was_folded_from(queue: WorkQueue) -> None:
    queue.append("session:a", [_at(_ready(1), T0)])
    leased = ActivationLeased(
        activation_id="a1", owner="w", epoch=1, expires_at=T0 + 30, covers=(), ttl_ms=30_000
    )
    with pytest.raises(ValueError, match="expected_version"):
        queue.append("session:a", [_at(leased, T0)], fence=Fence(1, claim=True), due=Due(T0 + 30))
    assert _claimed(queue, "w", T0) == ["session:a"]
    queue.append("session:a", [_at(leased, T0)], 1, fence=Fence(1, claim=True), due=Due(T0 + 30))
    work = queue.claim_due("other", T0 + 1, 10, 5.0)  # the hold was released, not due yet
    assert work.claimed == []
    assert work.next_at == T0 + 30
    # a renewal can only put the work off: the row stays (early is harmless)
    renewed = LeaseRenewed(activation_id="a1", owner="w", epoch=1, expires_at=T0 + 50)
    queue.append("session:a", [_at(renewed, T0 + 10)], fence=Fence(1))
    assert _claimed(queue, "other", T0 + 30) == ["session:a"]


def test_a_failed_append_leaves_the_due_row_as_it_was(queue: WorkQueue) -> None:
    queue.append("session:a", [_at(_ready(1, wake_at=T0 + 100), T0)])
    with pytest.raises(ConcurrencyError):
        queue.append("session:a", [_at(_ready(2), T0)], 5, due=Due(T0 + 1))
    with pytest.raises(FencedError):
        queue.append("session:a", [_at(_ready(3), T0)], fence=Fence(0, claim=True))
    work = queue.claim_due("w", T0 + 1, 10, 5.0)
    assert work.claimed == []
    assert work.next_at == T0 + 100


def test_a_write_back_never_hides_an_append_it_did_not_fold(queue: WorkQueue) -> None:
    queue.append("session:a", [_at(_ready(1), T0)])
    assert _claimed(queue, "w", T0) == ["session:a"]
    # while w folds version 1, someone settles and a new message arrives (version 2, 3)
    queue.append("session:a", [_at(ActivationAcked(activation_id="a1", epoch=1), T0 + 1)])
    queue.append("session:a", [_at(_ready(2), T0 + 1)])
    assert queue.set_due("session:a", 1, None, "w") is False
    assert _claimed(queue, "other", T0 + 2) == ["session:a"]  # still due, hold released
    assert queue.set_due("session:a", 3, T0 + 500, "other") is True
    assert _claimed(queue, "w", T0 + 2) == []
    assert queue.set_due("session:a", 3, None, "other") is True
    work = queue.claim_due("w", T0 + 1_000, 10, 5.0)
    assert work.claimed == []
    assert work.next_at is None


def test_a_claim_names_the_version_that_wrote_its_row_so_a_worker_can_put_it_off(
    queue: WorkQueue,
) -> None:
    """A worker that cannot settle a claimed session (its fold fails) writes its due row
    back, later, from the claimed version: accepted, and still beaten by a newer append."""
    queue.append("session:a", [_at(_ready(1), T0)])
    queue.append("session:a", [_at(_ready(2), T0)])
    (claim,) = queue.claim_due("w", T0, 10, 5.0).claimed
    assert (claim.stream, claim.version) == ("session:a", 2)
    assert queue.set_due("session:a", claim.version, T0 + 60, "w") is True
    assert _claimed(queue, "w", T0 + 1) == []  # put off, even for its own worker
    queue.append("session:a", [_at(_ready(3), T0 + 2)])  # new work: due again at once
    (again,) = queue.claim_due("w", T0 + 2, 10, 5.0).claimed
    assert again.version == 3


NOT_TIMES = [float("nan"), float("inf"), -float("inf"), "10", True]


# Was: DEFECT: NaN and inf due times were taken (a NaN row was never claimed on PostgreSQL)
@pytest.mark.parametrize("at", NOT_TIMES, ids=repr)
def test_a_due_time_that_is_not_finite_is_refused_before_anything_is_written(
    queue: WorkQueue, at: object
) -> None:
    """``set_due`` and ``Due`` took ``nan`` and ``inf``: PostgreSQL sorts NaN above every
    time, so that session was never claimed again, and LMDB below every time. Both stores
    now refuse them (None says "no work"), and write nothing."""
    queue.append("session:a", [_at(_ready(1, wake_at=T0 + 100), T0)])
    with pytest.raises(ValueError, match="due time"):
        queue.set_due("session:a", 1, at, "w")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="due time"):
        queue.append("session:a", [_at(_ready(2, wake_at=T0 + 100), T0)], 1, due=Due(at))  # type: ignore[arg-type]
    assert queue.stream_version("session:a") == 1  # type: ignore[attr-defined]
    work = queue.claim_due("w", T0, 10, 5.0)
    assert (work.claimed, work.next_at) == ([], T0 + 100)


# Was: DEFECT: a claim held for inf seconds held the session for ever; limit -1 differed
@pytest.mark.parametrize(
    ("now", "limit", "hold_s"),
    [
        (float("nan"), 10, 5.0),
        (T0, -1, 5.0),
        (T0, 1.5, 5.0),
        (T0, 10, float("inf")),
        (T0, 10, -1.0),
    ],
)
def test_a_claim_that_is_not_finite_or_counted_is_refused(
    queue: WorkQueue, now: float, limit: int, hold_s: float
) -> None:
    """``claim_due`` with ``hold_s=inf`` held a session for ever on both stores, and a
    negative ``limit`` was an error on PostgreSQL and no claim on LMDB. Both refuse them."""
    queue.append("session:a", [_at(_ready(1), T0)])
    with pytest.raises(ValueError, match="claim"):
        queue.claim_due("w1", now, limit, hold_s)
    assert _claimed(queue, "w2", T0 + 1) == ["session:a"]  # nobody holds it


def test_concurrent_claims_are_disjoint(queue: WorkQueue) -> None:
    streams = [f"session:s{i:02d}" for i in range(40)]
    for i, stream in enumerate(streams):
        queue.append(stream, [_at(_ready(i), T0)])
    got: dict[str, list[str]] = {}
    barrier = threading.Barrier(4)

    def claim(owner: str) -> None:
        barrier.wait()
        mine: list[str] = []
        while batch := _claimed(queue, owner, T0 + 1, limit=3):
            mine.extend(batch)
            for stream in batch:  # the fold found nothing more to do
                assert queue.set_due(stream, 1, None, owner)
        got[owner] = mine

    threads = [threading.Thread(target=claim, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    everything = [s for mine in got.values() for s in mine]
    assert sorted(everything) == streams  # each stream to exactly one worker


def test_a_version_1_postgres_store_is_upgraded_with_every_session_due(pg_url: str) -> None:
    """A store written before the work queue: its sessions are due once after the upgrade,
    so a worker looks at each (and its old appends keep their events)."""
    install_old_schema(pg_url, 1, ("session:old", "runtime"))
    opened = store_module.open(pg_url)
    try:
        assert isinstance(opened, WorkQueue)
        assert [c.stream for c in opened.claim_due("w", T0, 10, 5.0).claimed] == ["session:old"]
    finally:
        opened.close()
