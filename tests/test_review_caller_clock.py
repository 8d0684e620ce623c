"""Review of the model caller's deadlines on the runtime's Clock (2e46ff1, 2065ee0).

Real provider (a FakeProvider on 127.0.0.1), real LMDB store, real runtime, a FakeClock.
"""

from __future__ import annotations

from typing import Any

from stalwart.actors import TIMEOUT_TEXT
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import PromptRetryScheduled, PromptStarted
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, Fail, FakeProvider, Hang
from tests._runtime_support import (
    agent_settings,
    delivered,
    has,
    log_until,
    runtime_config,
)

#: sessions hung at once: each is one chance for the race below to show
SESSIONS = 4


def _where(report: Any) -> list[tuple[str, str, str]]:
    return [(f.kind, f.tag, f.message) for f in report.findings]


def _prompt_events_after_its_turn(store: EventStore, name: str) -> list[str]:
    """The ``prompt:*`` records of a session's one turn that follow its ``turn:completed``."""
    types = [r.type for r in store.read_stream(f"session:{name}")]
    assert "turn:completed" in types, types
    return [t for t in types[types.index("turn:completed") + 1 :] if t.startswith("prompt:")]


def test_one_advance_past_the_stall_budget_and_the_execution_timeout_leaves_a_log_that_verifies(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """The defaults: a 180 s stall budget and a 600 s execution timeout. Some hung
    calls, and a host that moves its FakeClock 601 s at once to see the turns time out.

    Once: the stall deadline (due at 180 s) and the turn's execution deadline (600 s)
    fire in the same ``advance()``. The execution deadline is a tell to the Agent, which
    appends ``execution:aborted`` and ``turn:completed`` at once; the stall deadline
    goes scheduler -> portal loop -> caller task -> worker thread, so the caller's
    ``execution:prompt_timeout`` (and ``prompt:failed``) lands after its turn has ended.
    Replay verification then reports a mismatch: "no call ... is open".

    Correct: the log verifies clean: a call's timeout, due 420 s before its turn's, is
    recorded while its turn is still open (or the turn's end accounts for it)."""
    fake.set_default(Hang())
    cfg = runtime_config(
        fake.base_url,
        agents={"default": agent_settings(180_000)},
        supervision={"execution_timeout_ms": 600_000},
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        names = [f"s{index}" for index in range(SESSIONS)]
        for name in names:
            rt.session(name, channel="chat").send("hello")
        for name in names:
            log_until(store, f"session:{name}", has(PromptStarted))
        fake.wait_for(lambda requests: len(requests) == SESSIONS)
        clock.advance(601)
        texts = [m.text for m in delivered(rt, chat, SESSIONS)]
        assert texts == [TIMEOUT_TEXT] * SESSIONS
    # the runtime is closed: whatever the callers were still appending has landed
    assert _where(verify_store(store, None)) == []


def test_a_retry_whose_backoff_ends_after_the_turns_execution_timeout_is_never_begun(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Each session's first attempt gets a 503 asking for 10 s, so the caller waits 10 s
    (on the Clock) before its one retry; the turn's execution timeout is 5 s. The host
    moves the clock 15 s at once, later 100 s more, and another session is answered.

    Once: both deadlines pass in the same ``advance()``. The scheduler fires the turn's
    (due at 5 s) first, but that is a tell to the Agent, which appends
    ``execution:aborted`` and only then cancels the call; the backoff's end (due at
    10 s) is a ``call_soon`` straight onto the loop, so the caller goes on to its retry
    and appends its ``prompt:started`` (attempt 2) after the turn has ended. That
    attempt is never ended in the log, and replay verification reports its whole-call
    limit as a missed ``execution:prompt_timeout``. (Before the change the backoff ran on
    the loop's clock and the abort cut it, every time.)

    Correct: a turn aborted before its call's backoff ended makes no retry: nothing of
    the call follows the turn's end, no retry request is sent, and the log verifies."""
    for _ in range(SESSIONS):
        fake.add(Fail(status=503, retry_after="10"))
    fake.set_default(Answer(text="fine"))
    agent = agent_settings(20_000, max_retries=1)
    cfg = runtime_config(
        fake.base_url, agents={"default": agent}, supervision={"execution_timeout_ms": 5_000}
    )
    names = [f"s{index}" for index in range(SESSIONS)]
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        for name in names:
            rt.session(name, channel="chat").send("hello")
        for name in names:
            log_until(store, f"session:{name}", has(PromptRetryScheduled))
        clock.advance(15)  # past the execution timeout (5 s) and the backoff (10 s)
        assert [m.text for m in delivered(rt, chat, SESSIONS)] == [TIMEOUT_TEXT] * SESSIONS
        clock.advance(100)  # past the whole-call limit any retry would have had
        rt.session("later", channel="chat").send("again")
        assert delivered(rt, chat, SESSIONS + 1)[-1].text == "fine"
    assert {name: _prompt_events_after_its_turn(store, name) for name in names} == {
        name: [] for name in names
    }
    assert len(fake.requests) == SESSIONS + 1  # the failed attempts, and the later answer
    assert _where(verify_store(store, None)) == []
