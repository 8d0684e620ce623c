"""Third review of the channels, their sends and the completion announcer: defects, each
proven by a test that failed on the code before its fix for the reason its comment gives.

Real parts only: real LMDB stores in tmp_path (damaged on disk with the lmdb module where
a test needs a record that cannot be read), the real Announcer with its Scheduler and
IoPortal, MemoryChannels, and a ``FakeClock`` for every deadline. Waits are on a channel,
the log or an actor's mailbox, each bounded by ``GUARD``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import lmdb
import pykka
import pytest
import structlog.testing

from stalwart import store as store_module
from stalwart.actors import Announcer, GetBatches, IoPortal, RunEnded, Scheduler, Track
from stalwart.channels import Delivery, MemoryChannel, OutboundMessage, channel_from_settings
from stalwart.clock import FakeClock
from stalwart.config import ChannelSettings
from stalwart.errors import ConfigError
from stalwart.events import AnnouncementDelivered, AnnouncementQueued
from stalwart.store import EventStore
from tests._relay import CuttingRelay, reachable
from tests._runtime_support import GUARD, advance_until, attempted_on, has, log_until, of, until
from tests.test_supervisor import succeeded

DEBOUNCE_S = 0.5  # the announcer's default debounce


@pytest.fixture
def stopped_actors() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all(timeout=GUARD)


def damage_last_record(directory: Path, stream: str, clock: FakeClock) -> None:
    """Bit rot in the newest record of ``stream`` (the store closed meanwhile)."""
    opened = store_module.open(directory, clock=clock)
    try:
        position = list(opened.read_stream(stream))[-1].position
    finally:
        opened.close()
    env = lmdb.open(str(directory), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), b"\xc1garbage", db=env.open_db(b"log", txn=txn))
    finally:
        env.close()


def track(run_id: str) -> Track:
    return Track(run_id=run_id, parent="p1", channel="chat", conversation="conv-1")


# -- the announcer and a damaged run stream ---------------------------------------------------


# Was: DEFECT: the announcer crashed on a run stream with a record it could not read
# (`Announcer._send` read each run's stream and let the CorruptRecordError out): the whole
# batch, the intact runs' completions with it, died with the actor and waited for the
# supervisor's sweep (35 s and more); the restarted announcer crashed again on the next
# batch naming that run.
def test_a_damaged_run_stream_is_left_out_and_the_batchs_other_runs_are_announced(
    tmp_path: Path, clock: FakeClock, stopped_actors: None
) -> None:
    directory = tmp_path / "store"
    writer = store_module.open(directory, clock=clock)
    try:
        succeeded(writer, "r1", announce=True, result="the damaged run's result")
        succeeded(writer, "r2", announce=True, result="the intact run's result")
    finally:
        writer.close()
    damage_last_record(directory, "session:r1", clock)
    crashes: list[str] = []
    chat = MemoryChannel("chat")
    store = store_module.open(directory, clock=clock)
    try:
        with (
            Scheduler(clock) as scheduler,
            IoPortal() as portal,
            structlog.testing.capture_logs() as captured,
        ):
            announcer = Announcer.start(
                store=store,
                clock=clock,
                scheduler=scheduler,
                portal=portal,
                channels={"chat": chat},
                on_crash=crashes.append,
            )
            for run_id in ("r1", "r2"):
                announcer.tell(track(run_id))
                announcer.tell(RunEnded(run_id=run_id, outcome="succeeded", result=run_id))
            announcer.ask(GetBatches(), timeout=GUARD)
            clock.advance(DEBOUNCE_S)
            attempted_on(portal, chat, 1)
            records = log_until(store, "session:r2", has(AnnouncementDelivered))
            assert announcer.ask(GetBatches(), timeout=GUARD) == {}  # alive, not restarted
        [message] = chat.attempted
        assert message.text == "Sub-agent task completed:\nr2"
        [queued] = of(AnnouncementQueued, records)
        assert queued.announcement_id == message.idempotency_key
        assert crashes == []
        unreadable = [e for e in captured if e["event"] == "announcer.stream_unreadable"]
        assert [e["stream"] for e in unreadable] == ["session:r1"]
    finally:
        store.close()


# -- a run's end told to an announcer that crashes -------------------------------------------


# Was: DEFECT: a run's end waiting in the announcer's mailbox when the announcer crashed was
# dropped with it (pykka drops a dead actor's mail): neither the supervisor nor the host's
# `on_ended` ever heard of it, so the run's handle never resolved (`RunHandle.result()`
# waited for ever, the runtime kept the run and its actor) although the run's stream said
# it had succeeded.
def test_a_runs_end_waiting_in_a_crashing_announcers_mailbox_still_reaches_on_ended(
    lmdb_store: EventStore, clock: FakeClock, stopped_actors: None
) -> None:
    busy, release = threading.Event(), threading.Event()
    ended: list[RunEnded] = []
    crashes: list[str] = []

    def on_ended(run: RunEnded) -> None:
        if run.run_id == "r0":  # holds the announcer while the next messages queue up
            busy.set()
            release.wait(GUARD)
        ended.append(run)

    with Scheduler(clock) as scheduler, IoPortal() as portal:
        announcer = Announcer.start(
            store=lmdb_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": MemoryChannel("chat")},
            on_ended=on_ended,
            on_crash=crashes.append,
        )
        announcer.tell(RunEnded(run_id="r0", outcome="failed", notice="n"))
        assert busy.wait(GUARD)
        announcer.tell(object())  # a message it does not understand: it crashes on it
        announcer.tell(track("r1"))
        announcer.tell(RunEnded(run_id="r1", outcome="succeeded", result="the answer"))
        release.set()
        until(lambda: len(ended) == 2, what="the second run's end reached on_ended")
    assert [(e.run_id, e.outcome) for e in ended] == [("r0", "failed"), ("r1", "succeeded")]
    assert ended[1].result == "the answer"
    assert crashes == ["TypeError"]


# -- the channel factory ----------------------------------------------------------------------


# Was: DEFECT: `channel_from_settings` given settings of a kind it does not know (made in
# code: a `ChannelSettings` built by hand is not checked as a config file is) returned
# None, not a channel: the runtime kept None as the channel and every send on it was
# recorded as `unknown_channel`, with nothing said at start.
def test_a_channel_of_a_kind_no_channel_has_is_a_config_error_naming_the_key() -> None:
    settings = ChannelSettings(kind="slack")  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        channel_from_settings("ops", settings)
    assert info.value.key == "channels.ops.kind"


# -- a batch's outcome while the store is away ------------------------------------------------


class GatedChannel:
    """A host's channel whose sends wait (off the loop) until the test lets them through."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = threading.Event()
        self.gate = threading.Event()
        self.delivered: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> Delivery:
        self.started.set()
        await anyio.to_thread.run_sync(self.gate.wait, GUARD)
        self.delivered.append(message)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        """Nothing to release."""


# Was: DEFECT: a batch delivered while the database was away for a moment (a failover, a
# network blip) crashed the announcer as it appended the outcome (`Announcer._record` let
# the StoreError out): the outcome was lost, the runs' completion stayed queued with no
# outcome, and the supervisor's sweep sent the delivered batch again (the user was told
# twice); the crash also dropped the announcer's batches.
def test_a_batchs_outcome_the_store_refused_for_a_moment_is_recorded_once_it_is_back(
    relayed_store: EventStore,
    pg_store: EventStore,
    relay: CuttingRelay,
    clock: FakeClock,
    stopped_actors: None,
) -> None:
    succeeded(pg_store, "r1", announce=True, result="42 invoices")
    chat = GatedChannel("chat")
    crashes: list[str] = []
    with (
        Scheduler(clock) as scheduler,
        IoPortal() as portal,
        structlog.testing.capture_logs() as captured,
    ):
        announcer = Announcer.start(
            store=relayed_store,
            clock=clock,
            scheduler=scheduler,
            portal=portal,
            channels={"chat": chat},
            on_crash=crashes.append,
        )
        announcer.tell(track("r1"))
        announcer.tell(RunEnded(run_id="r1", outcome="succeeded", result="42 invoices"))
        announcer.ask(GetBatches(), timeout=GUARD)
        clock.advance(DEBOUNCE_S)
        assert chat.started.wait(GUARD)  # queued, and with the channel
        relay.cut_now()  # the database goes away while the batch is delivered
        chat.gate.set()
        until(
            lambda: (
                not announcer.is_alive()
                or any(e["event"] == "announcer.record_deferred" for e in captured)
            ),
            what="the outcome met the outage",
        )
        relay.restore()
        until(lambda: reachable(relayed_store), what="the database back")
        records = advance_until(
            clock,
            lambda: (
                (rs := list(pg_store.read_stream("session:r1")))
                and of(AnnouncementDelivered, rs)
                and rs
            ),
            step_s=0.5,
        )
        assert announcer.is_alive()
    [queued] = of(AnnouncementQueued, records)
    [outcome] = of(AnnouncementDelivered, records)
    assert outcome.announcement_id == queued.announcement_id
    assert [m.idempotency_key for m in chat.delivered] == [queued.announcement_id]
    assert crashes == []
