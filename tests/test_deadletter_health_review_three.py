"""Third review of the dead-letter queue, the provider-health monitor and ``stalwart
incidents`` (seed 000).

Real parts only: an LMDB store in tmp_path, MemoryChannels, a real Scheduler and IoPortal,
the CLI through click's runner; time from the FakeClock. A test marked
``# Was: DEFECT:`` failed before its fix; the others check a claim the fix relies on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pykka
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import DeadLetterActor, Drain, IoPortal, QueueState, Scheduler
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import DeadLetterSettings
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementSendFailed,
    ProviderCallFailed,
    ProviderRecovered,
)
from stalwart.state import DEADLETTER, DeadLetterState, apply_deadletter
from stalwart.store import EventStore, NewEvent
from tests._runtime_support import GUARD, of

#: a backlog an hour's outage of a busy deployment leaves behind
BACKLOG = 8_000
#: what a drain of BACKLOG entries may take, generously (a loaded 2-core machine); the
#: drain took about 26 s before the fix (quadratic), about 3 s after
DRAIN_LIMIT_S = 12.0


def _queued(index: int) -> AnnouncementDeadLettered:
    return AnnouncementDeadLettered(
        entry_id=f"e{index}",
        announcement_id=f"ann-{index}",
        channel="chat",
        text="Sorry, that took too long.",
        reason="timeout",
        conversation=f"conv-{index % 50}",
    )


def _backlog(store: EventStore, clock: FakeClock, count: int) -> None:
    """``count`` entries queued during an outage, in batches as senders queue them."""
    for first in range(0, count, 1_000):
        batch = [_queued(i) for i in range(first, min(count, first + 1_000))]
        store.append("deadletter", [NewEvent(event=e, ts=clock.now()) for e in batch])
    store.append("provider:main", [NewEvent(event=ProviderRecovered("main"), ts=clock.now())])


def _queue(
    store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    chat: MemoryChannel,
) -> pykka.ActorRef[Any]:
    return DeadLetterActor.start(
        store=store,
        clock=clock,
        scheduler=scheduler,
        portal=portal,
        channels={"chat": chat},
        settings=DeadLetterSettings(),
        runtime="rt-a",
    )


def _drained(ref: pykka.ActorRef[Any], limit_s: float) -> tuple[DeadLetterState, float]:
    """Drain the queue; its state once empty (or at the limit) and how long it took."""
    started = time.monotonic()
    ref.tell(Drain("main"))
    while True:
        state = ref.ask(QueueState(), timeout=limit_s)
        elapsed = time.monotonic() - started
        if not state.entries or elapsed > limit_s:
            return state, elapsed
        time.sleep(0.05)  # real-time: the sends run on the portal's thread


# -- 1. a drain of a large backlog takes quadratic time ----------------------------------------


def test_a_drain_of_a_large_backlog_delivers_it_in_time_linear_in_its_size(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """An hour's outage leaves thousands of dead letters; recovery drains them. Each one
    cost the queue a pass over the whole queue, several times (the fold of its retry and
    of its outcome, an append, then expiry, retries and the timer over every entry), so
    8,000 entries took about 26 s, 30,000 minutes, with every Enqueue (senders wait 5 s)
    and QueueState stuck behind it."""
    # Was: DEFECT: a drain cost O(n) per entry: the fold searched the entry tuple for each
    # event and the queue re-decided over all entries after each send's outcome.
    _backlog(lmdb_store, clock, BACKLOG)
    chat = MemoryChannel("chat")
    ref = _queue(lmdb_store, clock, scheduler, portal, chat)
    actors.append(ref)
    assert len(ref.ask(QueueState(), timeout=GUARD).entries) == BACKLOG

    state, elapsed = _drained(ref, DRAIN_LIMIT_S * 2)

    assert elapsed < DRAIN_LIMIT_S, f"{BACKLOG} entries drained in {elapsed:.1f} s"
    assert (state.entries, state.delivered) == ((), BACKLOG)
    assert len(chat.messages) == BACKLOG
    assert len({m.idempotency_key for m in chat.messages}) == BACKLOG  # each once


def test_a_drain_whose_outcomes_are_recorded_together_replays_clean(
    lmdb_store: EventStore,
    clock: FakeClock,
    scheduler: Scheduler,
    portal: IoPortal,
    actors: list[pykka.ActorRef[Any]],
) -> None:
    """The outcomes of sends that end together are appended in one batch: every retry
    still has its outcome, a failed one keeps its entry for its next retry, and
    ``stalwart replay --verify`` finds every decision re-derived."""
    _backlog(lmdb_store, clock, 30)
    chat = MemoryChannel("chat")
    chat.fail_next(3)
    ref = _queue(lmdb_store, clock, scheduler, portal, chat)
    actors.append(ref)
    ref.ask(QueueState(), timeout=GUARD)

    ref.tell(Drain("main"))
    deadline = time.monotonic() + GUARD
    while len(ref.ask(QueueState(), timeout=GUARD).entries) > 3:
        assert time.monotonic() < deadline, "the drain did not end"
        time.sleep(0.02)  # real-time: the sends run on the portal's thread
    clock.advance(60)  # the three failed entries' next retry
    while ref.ask(QueueState(), timeout=GUARD).entries:
        assert time.monotonic() < deadline, "the failed entries were not retried"
        time.sleep(0.02)  # real-time: the sends run on the portal's thread

    records = list(lmdb_store.read_stream("deadletter"))
    assert len(of(AnnouncementSendFailed, records)) == 3
    assert len(of(AnnouncementDeadLetterDelivered, records)) == 30
    assert fold_all(records) == ref.ask(QueueState(), timeout=GUARD)
    report = verify_store(lmdb_store, None)
    # the queue's stream: the hand-made recovery has no outage before it (not the point)
    assert [f for f in report.findings if f.stream == "deadletter"] == []
    assert report.checked.get("announcement:dead_letter_retried") == 33


def fold_all(records: list[Any]) -> DeadLetterState:
    """The queue folded one event at a time, through the pure ``apply``."""
    state = DEADLETTER.initial("deadletter")
    for record in records:
        state = apply_deadletter(state, record)
    return state


# -- 2. `stalwart incidents --since` with a long count -------------------------------------------


def _log(store_dir: Path) -> None:
    with store_module.open(store_dir) as opened:  # type: ignore[attr-defined]
        failed = ProviderCallFailed(
            provider="main", model="m1", agent="a", error_class="server_error", status=503
        )
        opened.append("provider:main", [NewEvent(event=failed, ts=1_800_000_000.0)])


@pytest.mark.parametrize("digits", [5_000, 19, 30])
def test_incidents_since_a_count_longer_than_any_log_is_the_whole_log(
    store_dir: Path, digits: int
) -> None:
    """``--since`` counts back from the newest event, and a span longer than the log's
    past starts at its beginning. A count of thousands of digits (a paste gone wrong)
    must read the same way, or fail as bad input: never an internal error."""
    # Was: DEFECT: int() refuses more than 4,300 digits (ValueError), so `--since 999...9m`
    # printed "internal error: ValueError (a bug; ...)" instead of the table.
    _log(store_dir)
    result = CliRunner().invoke(
        cli, ["--store", str(store_dir), "incidents", "--since", "9" * digits + "m"]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "1 call, 1 failed, 0 timeouts across 1 model since 1970-01-01T00:00:00.000Z"
    )


def test_incidents_since_a_count_with_leading_zeros_is_that_count(store_dir: Path) -> None:
    # Was: DEFECT: the same int() limit counted the zeros: `--since 000...05m` crashed too
    _log(store_dir)
    result = CliRunner().invoke(
        cli, ["--store", str(store_dir), "incidents", "--since", "0" * 5_000 + "5m"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].endswith("since 2027-01-15T07:55:00.000Z")
