"""Defects a review found in the sub-agent layer (watchdog, failure notice, ghost sweep,
recovery). Each test failed on the code before its fix for the reason its docstring
names ("Harm"). Real parts only: an LMDB store in tmp_path, the fake provider over
loopback, MemoryChannels, a ``FakeClock`` driving every deadline. Waits are bounded by
the log, the channel or an ``ask``; the few that wait for something that should come at
once give up after ``SETTLE_S``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import lmdb
import pytest

from stalwart import store as store_module
from stalwart.actors import (
    FAILED_SENTENCE,
    GAVE_UP_TEXT,
    SWEPT_SENTENCE,
    TIMED_OUT_SENTENCE,
    RunReport,
)
from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import Config
from stalwart.errors import SpawnRefusedError
from stalwart.events import (
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    AnnouncementQueued,
    SubagentProgress,
    SubagentRecoveryDecided,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    SupervisorGaveUp,
    SupervisorRestarted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Fail, FakeProvider
from tests._runtime_support import (
    GUARD,
    advance_until,
    agent_settings,
    has,
    log_until,
    of,
    runtime_config,
)

#: how long a test waits for a message that should come at once before calling it lost
SETTLE_S = 2.0


def config(base_url: str, **extra: Any) -> Config:
    agents = {"default": agent_settings(subagents=True), "plain": agent_settings()}
    return runtime_config(base_url, agents=agents, **extra)


def messages_until(
    rt: Runtime,
    channel: MemoryChannel,
    check: Callable[[list[OutboundMessage]], bool],
    wait: float = SETTLE_S,
) -> list[OutboundMessage]:
    """The channel's delivered messages once ``check`` holds, or when ``wait`` ran out."""

    async def watch() -> list[OutboundMessage]:
        with anyio.move_on_after(wait):
            count = 1
            while True:
                seen = await channel.wait_for(count)
                if check(seen):
                    return seen
                count = len(seen) + 1
        return list(channel.messages)

    return rt.portal.submit(watch).result(wait + 2)


def orphan(task: str, timeout_ms: int = 1_000) -> SubagentSpawned:
    """The spawn of a run a dead process left ``running`` (no actor fires its watchdog)."""
    return SubagentSpawned(
        parent="alice",
        task=task,
        task_class="custom",
        timeout_ms=timeout_ms,
        timeout_reason="test",
        channel="chat",
        conversation="alice",
    )


async def hang(report: RunReport) -> str:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


# -- 1. a model-driven run's own Agent hijacks the run's failure notice ----------------------


def test_a_model_driven_run_that_fails_gets_the_sub_agent_failure_notice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: a model-driven sub-agent (``rt.spawn`` without ``work``, and every run of the
    ``spawn_subagent`` tool) whose model call fails never gets its failure notice. Its
    sub-session Agent writes its own ``announcement:queued`` (kind ``failure_notice``,
    FAILED_TEXT, meant for the private ``subagent:<id>`` sink) into the run's stream, and
    the supervisor's notice fold (``next_notice``) takes it for the run's notice: the
    sub-agent notice is never queued. Depending on a race the user gets nothing, or the
    sub-session's internal "Sorry, the model did not answer ... Please try again" re-sent
    on the user's channel as if it were the parent's answer.
    Correct: exactly one static notice, ``Sub-agent task "<task>": <FAILED_SENTENCE> ...``,
    on the run's channel."""
    cfg = config(fake.base_url, subagents={"recovery_max_attempts": 1})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        fake.set_default(Fail(status=400))
        handle = rt.spawn(
            "p1", "summarise the quarterly report", task_class="research", channel="chat"
        )
        assert handle.result(GUARD).outcome == "failed"
        log_until(store, handle.stream, has(SubagentRecoveryDecided))
        seen = messages_until(rt, chat, lambda ms: any(FAILED_SENTENCE in m.text for m in ms))
        notices = [m for m in seen if FAILED_SENTENCE in m.text]
        assert len(notices) == 1, [m.text for m in seen]
        assert "summarise the quarterly report" in notices[0].text
        assert [m.text for m in seen] == [notices[0].text]


# -- 2. one corrupt record in one run's stream silences the supervisor for good --------------


def _corrupt(directory: Path, position: int) -> None:
    env = lmdb.open(str(directory), max_dbs=8)
    try:
        log_db = env.open_db(b"log")
        with env.begin(write=True) as txn:
            txn.put(position.to_bytes(8, "big"), b"\xc1garbage", db=log_db)
    finally:
        env.close()


def _swept(task: str, message: OutboundMessage) -> bool:
    return task in message.text and SWEPT_SENTENCE in message.text


def test_one_corrupt_run_record_does_not_stop_the_ghost_sweep_of_other_runs(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: a single undecodable record in one run's stream (the design's own example of
    bad input that must lose nothing) disables the whole supervisor, silently: its first
    sweep in ``on_start`` raises CorruptRecordError out of ``_refresh``/``_catch_up``,
    pykka stops an actor whose ``on_start`` raises without calling ``on_failure``, so no
    ``Crashed`` is reported, nothing restarts it and nothing is logged in the ``runtime``
    stream. From then on no run is ever ghost-swept, no failure notice is sent, no
    recovery is decided and no crashed agent is restarted. Here an unrelated run left
    ``running`` by a dead process stays ``running`` for ever and its user hears nothing.
    Correct: the damaged stream is reported and skipped; every other run is still swept
    at its limit + ghost_grace_ms with one static notice."""
    directory = tmp_path / "store"
    with store_module.open(directory, clock=clock) as first:  # type: ignore[attr-defined]
        _, damaged = first.append(
            "session:damaged", [orphan("index the archive"), SubagentProgress(tokens=5, step=1)]
        )
        first.append("session:ghost", [orphan("reconcile invoices")])
    _corrupt(directory, damaged.position)
    with (
        store_module.open(directory, clock=clock) as store,  # type: ignore[attr-defined]
        Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt,
    ):
        settings = rt.config.subagents
        due_s = (1_000 + settings.ghost_grace_ms + settings.ghost_sweep_interval_ms) / 1000
        for _ in range(round(due_s / 60) + 1):
            clock.advance(60)
        seen = messages_until(rt, chat, lambda ms: any(_swept("reconcile invoices", m) for m in ms))
        assert [m for m in seen if _swept("reconcile invoices", m)], (
            [r.type for r in store.read_stream("session:ghost")],
            [r.type for r in store.read_stream("runtime")],
        )


# -- 4. a spawn whose step budget is zero is accepted and killed at once ---------------------


@pytest.mark.parametrize("max_steps", [0, -3])
def test_a_spawn_with_no_step_budget_is_not_force_failed_at_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel, max_steps: int
) -> None:
    """Harm: ``max_steps`` is not validated (``rt.spawn`` and the ``spawn_subagent`` tool,
    whose value comes from the model). With 0 (a model's usual "no limit") or a negative
    number the watchdog limit is ``max_steps x per_step_timeout_ms`` <= 0, so the run is
    force-failed the moment it starts: the user reads "did not complete in time and was
    stopped (ran 0s)" for a task that never got to run, and the recovery respawns it with
    the same budget, to be killed again. The seed promises no spawn goes without a valid
    timeout (``SpawnRefusedError`` for anything else).
    Correct: refuse it with SpawnRefusedError (field ``max_steps``) before anything is
    appended, or ignore a non-positive budget; never a 0-ms watchdog."""
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        refused: SpawnRefusedError | None = None
        try:
            handle = rt.spawn(
                "p1", "format the table", task_class="formatting", channel="chat",
                work=hang, max_steps=max_steps,
            )  # fmt: skip
        except SpawnRefusedError as exc:
            refused = exc
        if refused is not None:
            assert refused.field == "max_steps"
            return
        handle.status()  # the watchdog is armed
        clock.advance(0)  # a deadline already due fires now
        state = handle.status()
        assert state.status == "running", of(
            SubagentWatchdogTimeout, list(store.read_stream(handle.stream))
        )


# -- 5. a run whose actor was given up on -----------------------------------------------------


def test_a_run_whose_actor_is_given_up_on_is_settled_with_one_sub_agent_notice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: when a run's SubAgentActor keeps crashing and supervision gives up
    (``supervisor:gave_up``), the parent's user is sent GAVE_UP_TEXT, "this
    conversation's agent had to be stopped", which is false (the conversation's agent is
    fine, a sub-agent died). The run itself is left ``running`` with its watchdog timer
    cancelled (``on_failure`` -> ``_release``): nothing settles it until the ghost sweep
    at its limit + 120 s, which then sends a second notice for the same failure (replay
    reports the watchdog as missed). The run's handle never resolves, so a
    ``spawn_subagent`` tool call waiting on it hangs the parent's turn.
    Correct: a given-up run is force-failed at once: one static sub-agent failure notice
    naming the task, no GAVE_UP_TEXT for a sub-agent, and the handle resolves."""
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn(
            "p1", "format the table", task_class="formatting", channel="chat", work=hang
        )
        handle.status()
        for crash, backoff_ms in enumerate([100, 200, 400], 1):
            dying = handle.ref
            assert dying is not None
            dying.tell(object())  # the run's actor does not understand it: it crashes
            log_until(store, "runtime", has(SupervisorRestarted, crash))
            rt.runs()  # the supervisor has armed the restart
            clock.advance(backoff_ms / 1000 + 0.001)
            give_up = time.monotonic() + GUARD
            while handle.ref is dying:
                assert time.monotonic() < give_up, "the run's actor was never restarted"
                time.sleep(0.01)  # real-time: the restart runs on the scheduler thread
            handle.status()
        last = handle.ref
        assert last is not None
        last.tell(object())
        log_until(store, "runtime", has(SupervisorGaveUp))
        seen = messages_until(rt, chat, lambda ms: any("format the table" in m.text for m in ms))
        assert GAVE_UP_TEXT not in [m.text for m in seen]
        assert [m.text for m in seen if "format the table" in m.text], [m.text for m in seen]
        assert handle.result(SETTLE_S).outcome != "succeeded"


def test_a_run_swept_as_a_ghost_here_resolves_its_handle_with_the_notice(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: a run of this process swept as a ghost (its actor stopped without ending it,
    so no watchdog fires) got its notice, but its handle never resolved: nothing but the
    run's own actor ever told the runtime how a run ended, so a ``spawn_subagent`` call
    waiting on it hung the parent's turn. Correct: the sweep that ends the run hands it
    to the runtime, and the handle resolves ``swept`` with the same static notice."""
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn(
            "p1", "format the table", task_class="formatting", channel="chat", work=hang
        )
        handle.status()
        actor = handle.ref
        assert actor is not None
        actor.stop()  # no crash, no watchdog: only the ghost sweep can end the run now
        settings = rt.config.subagents
        limit_ms = settings.class_timeouts_ms.formatting
        swept_at_ms = limit_ms + settings.ghost_grace_ms + settings.ghost_sweep_interval_ms
        clock.advance(swept_at_ms / 1000)
        ended = handle.result(GUARD)
        assert ended.outcome == "swept"
        assert SWEPT_SENTENCE in ended.notice
        seen = messages_until(rt, chat, lambda ms: any(SWEPT_SENTENCE in m.text for m in ms))
        assert [m.text for m in seen] == [ended.notice]


# -- 6. the announce timeout and the runtime's clock --------------------------------------------


def test_the_announce_timeout_falls_back_on_the_runtime_clock(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Harm: the notice's 30 s announce timeout (seed 000's batcher timeout) is measured by
    ``send_within`` with ``anyio.move_on_after``, the event loop's own clock, not the
    runtime's Clock, against the design's rule that no module reads the wall clock. Under
    a FakeClock the fallback never fires when the 30 s pass (a host's deterministic test
    of its failure path hangs 30 real seconds), and the log records
    ``announcement:fallback_direct`` (``timeout_ms`` 30 000) at the same ``ts`` as the
    ``announcement:queued`` it timed out, so replay cannot show the wait that happened.
    Correct: the announce deadline is a Clock deadline (the scheduler), so advancing the
    clock by 30 s falls back to the direct send at once."""
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        handle = rt.spawn(
            "p1", "format the table", task_class="formatting", channel="chat", work=hang
        )
        handle.status()
        chat.hang_next(1)  # the announce send of the notice never answers
        clock.advance(rt.config.subagents.class_timeouts_ms.formatting / 1000)
        assert handle.result(GUARD).outcome == "timed_out"
        log_until(store, handle.stream, has(AnnouncementQueued))
        # the send's Clock deadline is armed when it starts, a moment after its
        # announcement:queued: step past it until this run's direct send is delivered
        # (not until any message: the steps also time out the run's recovery attempt,
        # whose own notice may come first on a slow machine)
        advance_until(
            clock,
            lambda: of(AnnouncementDelivered, list(store.read_stream(handle.stream))),
            rt.config.dead_letters.announce_timeout_ms / 4000,
        )
        seen = messages_until(rt, chat, lambda ms: any(TIMED_OUT_SENTENCE in m.text for m in ms))
        records = list(store.read_stream(handle.stream))
        assert [m for m in seen if TIMED_OUT_SENTENCE in m.text], [r.type for r in records]
        [queued] = [r for r in records if isinstance(r.event, AnnouncementQueued)]
        [fallback] = [r for r in records if isinstance(r.event, AnnouncementFallbackDirect)]
        assert fallback.ts - queued.ts >= 30.0
        assert of(AnnouncementDelivered, records)
