"""Second review of 07fc5a8 (``send_by_clock`` cut by a cancel scope, ``IoPortal.call_soon``)
and 8996469 (``retry_of``: a call's failure counted once, from its first failed attempt).

Real parts only: a real LMDB store, the loopback FakeProvider, MemoryChannel, the real
IoPortal and Scheduler on a FakeClock. The review found two defects, both fixed: their
tests say what each was ("Once") and check the fix; the others cover risky corners that
held.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import msgspec
import pytest

from stalwart.actors import IoPortal
from stalwart.actors._health import _WatchAggregate
from stalwart.actors._scheduler import Scheduler
from stalwart.actors._send import TIMEOUT, send_by_clock
from stalwart.channels import MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import (
    Event,
    ProviderCallFailed,
    ProviderCallSucceeded,
    ProviderDegraded,
    RecordedEvent,
)
from stalwart.providers import Message, ProviderRequest
from stalwart.runtime import ProviderLayer
from stalwart.state import BREAKER, HEALTH, HealthAggregate, decide_health
from stalwart.state._health import apply_health
from stalwart.store import EventStore, NewEvent, load_state
from stalwart.testing import Answer, Fail, FakeProvider
from tests._runtime_support import RETRYING, agent_settings, until

STREAM = "provider:main"
SESSION = "session:s1"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))
KNOBS: dict[str, int] = {"window_ms": 60_000, "min_agents": 2, "consecutive": 3}
GUARD = 4.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _failed(agent: str, call_id: str, retry_of: str = "") -> ProviderCallFailed:
    return ProviderCallFailed(
        provider="main",
        model="m1",
        agent=agent,
        error_class="server_error",
        status=500,
        call_id=call_id,
        retry_of=retry_of,
    )


def _succeeded(agent: str, retry_of: str = "") -> ProviderCallSucceeded:
    return ProviderCallSucceeded(provider="main", model="m1", agent=agent, retry_of=retry_of)


def _append(store: EventStore, clock: FakeClock, *events: Event) -> None:
    """Each event on its own, one second apart on the Clock (as callers append them)."""
    for event in events:
        clock.advance(1)
        store.append(STREAM, [NewEvent(event=event, ts=clock.now())])


# -- 8996469: the health fold -------------------------------------------------------------


def test_a_retried_failure_keeps_its_first_attempts_place_in_a_streak(
    store: EventStore, clock: FakeClock
) -> None:
    """Agent ``a``: call c1's first attempt fails; then a's call c2 succeeds; then c1's
    retry fails (retry_of c1); then calls c3 and c4 fail. Since a's last success, only
    two calls began to fail (c3, c4): c1's failure counts "from its first failed
    attempt", which came before the success. The breaker, over the same stream, sees
    exactly that (2 in a row: the retry is not counted again).

    Once: the health fold replaced c1's mark with one at the retry's version, after the
    success, so ``_streak`` gave 3 and the monitor degraded the provider for every agent
    ("3 consecutive failures") on two failed calls in a row; the monitor and the
    breaker, documented as counting calls "the same way", disagreed on the same log.

    Correct: the mark that stands for a retried call keeps the first failed attempt's
    version (and ts) for the streak; the provider is not degraded."""
    _append(
        store,
        clock,
        _failed("a", "c1"),
        _succeeded("a"),
        _failed("a", "c1b", retry_of="c1"),
        _failed("a", "c3"),
        _failed("a", "c4"),
    )
    breaker = load_state(store, STREAM, BREAKER, use_snapshots=False)
    assert breaker.consecutive_failures == 2  # the breaker: two failed calls in a row
    health = load_state(store, STREAM, HEALTH, use_snapshots=False)
    assert decide_health(health, clock.now(), **KNOBS) == []


def test_a_success_of_one_call_and_a_retry_of_another_call_interleaved(
    store: EventStore, clock: FakeClock
) -> None:
    """Coverage (one agent's calls interleaving): c1 and c2 fail their first attempts,
    c1's retry succeeds (taking c1 back, and a success of the agent), c2's retry fails
    (retry_of c2: its mark moves, one failure still), then c3 fails. Two failed calls
    since the success, one agent: not degraded; the breaker agrees (c2's retry is not
    counted again, c3 is: 1). Then a second agent fails: 'agents' fires with exactly the
    three failed calls in the window (c2, c3, and b's), not the five attempts."""
    _append(
        store,
        clock,
        _failed("a", "c1"),
        _failed("a", "c2"),
        _succeeded("a", retry_of="c1"),
        _failed("a", "c2b", retry_of="c2"),
        _failed("a", "c3"),
    )
    health = load_state(store, STREAM, HEALTH, use_snapshots=False)
    assert [m.call for m in health.failures] == ["c2b", "c3"]
    assert decide_health(health, clock.now(), **KNOBS) == []
    assert load_state(store, STREAM, BREAKER, use_snapshots=False).consecutive_failures == 1
    _append(store, clock, _failed("b", "d1"))
    health = load_state(store, STREAM, HEALTH, use_snapshots=False)
    [degraded] = decide_health(health, clock.now(), **KNOBS)
    assert isinstance(degraded, ProviderDegraded)
    assert (degraded.rule, degraded.agents, degraded.failures) == ("agents", ("a", "b"), 3)


class _PreBumpHealth(HealthAggregate):
    """The health fold as a process of the previous release folds the same records: it
    knows no ``retry_of`` (msgspec drops the unknown field), so each attempt is a
    failure. Its own name and version were ``provider_health@v2``."""

    version = 2

    def apply(self, state: Any, record: RecordedEvent) -> Any:
        event = record.event
        if isinstance(event, ProviderCallFailed | ProviderCallSucceeded) and event.retry_of:
            event = msgspec.structs.replace(event, retry_of="")
            record = msgspec.structs.replace(record, event=event)
        return apply_health(state, record)

    def folder(self, state: Any) -> Any:
        from stalwart.state import ApplyFolder

        return ApplyFolder(self.apply, state)


def test_the_health_actor_does_not_read_a_snapshot_of_the_old_counting(
    store: EventStore, clock: FakeClock
) -> None:
    """One agent, one call: three attempts fail (each a retry of the one before). A
    process of the previous release (on the same log, or before the upgrade) folded the
    stream in the health actor and saved its snapshot (``provider_health_watch@v1``):
    three failures in a row.

    Once: the changelog said the bump to HEALTH 3 means "snapshots of the old counting
    are not read", but the ProviderHealthActor loads through ``_WatchAggregate``, whose
    snapshot name did not change: it started from the old state, three failures, and
    degraded the provider for every agent over one failed call, a decision
    ``replay --verify`` (which refolds HEALTH 3) cannot re-derive.

    Correct: the watch fold's version follows the health fold's (e.g. ``version =
    HEALTH.version`` or a name carrying it), so the old snapshot is ignored and the
    actor refolds: one failed call, not degraded."""
    _append(
        store,
        clock,
        _failed("a", "c1"),
        _failed("a", "c2", retry_of="c1"),
        _failed("a", "c3", retry_of="c2"),
    )
    old = _WatchAggregate(_PreBumpHealth())
    written = load_state(store, STREAM, old, snapshot_every=1)  # the old actor's snapshot
    assert decide_health(written.health, clock.now(), **KNOBS) != []  # old: degraded
    # the new actor's load (as ProviderHealthActor._load does it)
    loaded = load_state(store, STREAM, _WatchAggregate(HealthAggregate()), skip_unreadable=True)
    assert len(loaded.health.failures) == 1
    assert decide_health(loaded.health, clock.now(), **KNOBS) == []


# -- 8996469: the caller, a fallback on the same provider ----------------------------------


@pytest.mark.anyio
async def test_a_fallback_to_another_model_of_the_same_provider_starts_a_new_call(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """Coverage: ``main:m1`` fails its three attempts (500), the chain falls back to
    ``main:m2`` on the same provider stream, whose first attempt fails and whose retry
    succeeds. ``retry_of`` resets per model: m2's first failure names no attempt of m1;
    each retry names the attempt before it on its own model; the success takes m2's
    failure back, leaving m1's one failed call in the health fold."""
    fake.add(Fail(status=500, model="m1", times=3), Fail(status=500, model="m2"))
    fake.set_default(Answer(text="from m2"))
    agent = agent_settings(2_000, **RETRYING, fallback_models=("main:m2",))
    main = {"kind": "openai", "base_url": fake.base_url, "connect_timeout_ms": 1000}
    cfg = parse_config({"providers": {"main": main}, "agents": {"default": agent}})
    layer = ProviderLayer(cfg, store, clock=clock, rng=random.Random(7))
    try:
        with anyio.fail_after(GUARD):
            response = await layer.caller().call(SESSION, REQUEST)
    finally:
        await layer.aclose()
    assert response.text == "from m2"
    events = [r.event for r in store.read_stream(STREAM)]
    failed = [e for e in events if isinstance(e, ProviderCallFailed)]
    [success] = [e for e in events if isinstance(e, ProviderCallSucceeded)]
    assert [e.model for e in failed] == ["m1", "m1", "m1", "m2"]
    ids = [e.call_id for e in failed]
    assert [e.retry_of for e in failed] == ["", ids[0], ids[1], ""]
    assert success.retry_of == ids[3]
    health = load_state(store, STREAM, HEALTH, use_snapshots=False)
    assert [m.call for m in health.failures] == [ids[2]]
    breaker = load_state(store, STREAM, BREAKER, use_snapshots=False)
    assert breaker.consecutive_failures == 0


# -- 07fc5a8: the send cut on the Clock ------------------------------------------------------


def _message(text: str) -> OutboundMessage:
    return OutboundMessage(conversation="c", text=text, idempotency_key=text)


def test_a_hanging_send_is_cut_on_the_clock_and_call_soon_follows_a_restarted_portal(
    clock: FakeClock,
) -> None:
    """Coverage: a send that hangs is cut when its deadline passes on the FakeClock
    (``timeout``), the next send on the same portal delivers (the cut scope is the
    send's own); ``call_soon`` is refused while the portal is stopped and reaches the
    new loop once it starts again (no stale loop); a callback that raises does not stop
    the loop. A send whose portal stops while it hangs ends cancelled, and its deadline
    passing afterwards touches nothing."""
    chat = MemoryChannel("chat")
    portal = IoPortal()
    with Scheduler(clock) as scheduler:
        with portal:
            chat.hang_next(1)
            hung = send_by_clock(portal, scheduler, clock, chat, _message("one"), 1.0)
            until(lambda: len(chat.attempted) >= 1)
            assert not hung.done()
            clock.advance(1.5)
            assert hung.result(GUARD) == TIMEOUT
            sent = send_by_clock(portal, scheduler, clock, chat, _message("two"), 1.0)
            assert sent.result(GUARD) is None
            assert [m.text for m in chat.messages] == ["two"]

            def boom() -> None:
                raise RuntimeError("a timer callback that fails")

            assert portal.call_soon(boom)
            ran: list[str] = []
            assert portal.call_soon(lambda: ran.append("after"))
            until(lambda: ran)
            chat.hang_next(1)
            stopped = send_by_clock(portal, scheduler, clock, chat, _message("three"), 1.0)
            until(lambda: len(chat.attempted) >= 3)
        assert stopped.cancelled()
        assert not portal.call_soon(lambda: ran.append("stopped"))
        clock.advance(2)  # the stopped send's deadline: nothing to cut, nothing raised
        with portal:
            assert portal.call_soon(lambda: ran.append("restarted"))
            until(lambda: "restarted" in ran)
    assert ran == ["after", "restarted"]
