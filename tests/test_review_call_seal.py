"""Review of the turn's seal on its model call (7f6551f) and the late-delta cut (569ec24).

Real provider (a FakeProvider on 127.0.0.1), real LMDB store, a real caller on a real I/O
portal and scheduler (as a Runtime wires them), a FakeClock.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial

from stalwart.actors import IoPortal, Scheduler, clock_timer
from stalwart.clock import FakeClock
from stalwart.errors import CallSealedError, PromptTimeoutError
from stalwart.events import PromptStarted, ProviderCallFailed
from stalwart.providers import CallSeal, Message, ModelCaller, ProviderRequest
from stalwart.runtime import ProviderLayer
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang
from tests._runtime_support import GUARD, agent_settings, has, log_until, of, runtime_config

SESSION = "session:s1"
REQUEST = ProviderRequest(messages=(Message(role="user", content="hi"),))


@contextmanager
def _caller(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> Iterator[tuple[IoPortal, ModelCaller]]:
    """The runtime's caller: its deadlines on ``clock`` through a scheduler timer."""
    cfg = runtime_config(fake.base_url, agents={"default": agent_settings(180_000)})
    with IoPortal() as portal, Scheduler(clock) as scheduler:
        layer = ProviderLayer(cfg, store, clock=clock)
        try:
            yield portal, layer.caller(timer=partial(clock_timer, portal, scheduler, clock))
        finally:
            portal.submit(layer.aclose).result(GUARD)


def _ended(future: Future[object]) -> BaseException | None:
    """How the call ended (its exception), once it has (real-time guard)."""
    return future.exception(GUARD)


def test_a_stall_cut_after_the_turn_sealed_its_call_still_counts_for_the_provider(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """A hung call (180 s stall budget) whose turn ends as the clock passes both the
    turn's execution timeout and the call's stall budget (one jump of the clock, a
    process frozen past both): the Agent seals the call before it appends the turn's end,
    and the stall timer fired by the same clock move reaches the caller on the I/O loop
    just after (in a Runtime this is what happens most of the time: the Agent seals, and
    its cancel of the call comes after the timer's cut).

    Once: the caller's ``execution:prompt_timeout`` is refused by the seal in ``_run``
    (``_caller.py``, the ``await self._emit(stream, timeout, at)`` before ``raise
    PromptTimeoutError``), so the call ends with CallSealedError before ``_settle``:
    nothing reaches ``provider:main``. The stall is never a ``provider:call_failed``,
    so neither the breaker nor the health monitor counts it (a fleet of hung calls whose
    turns end with them never degrades the provider), although ``_settle`` and
    ``_provider_outcome`` were changed precisely so that "what the provider did is
    recorded even when the call is cancelled or sealed".

    Correct: the session stream gets nothing after the seal, and the provider stream
    records the attempt's failure (``timeout_stall``), as for a refused ``prompt:failed``."""
    fake.set_default(Hang())
    seal = CallSeal(not_after=clock.now() + 600)
    with _caller(store, clock, fake) as (portal, caller):
        future = portal.submit(partial(caller.call, seal=seal), SESSION, REQUEST)
        (started,) = of(PromptStarted, log_until(store, SESSION, has(PromptStarted)))
        fake.wait_for(lambda requests: len(requests) == 1)
        assert seal.seal(GUARD)  # the turn ends (the Agent's _finish)
        clock.advance(601)  # the same move passes the stall budget: its cut comes now
        # it ends (refused: the turn is over), having recorded what it still may
        assert isinstance(_ended(future), CallSealedError | PromptTimeoutError)
    assert [r.type for r in store.read_stream(SESSION)] == ["prompt:started"]
    failed = of(ProviderCallFailed, list(store.read_stream("provider:main")))
    assert [(f.call_id, f.error_class) for f in failed] == [(started.call_id, "timeout_stall")]
