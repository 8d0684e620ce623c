"""Review of the model caller's deadlines on the runtime's Clock (2e46ff1, 2065ee0).

Real provider (a FakeProvider on 127.0.0.1), real LMDB store, real runtime, a FakeClock.
"""

from __future__ import annotations

from typing import Any

from stalwart.actors import TIMEOUT_TEXT
from stalwart.channels import MemoryChannel
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.events import PromptStarted
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider, Hang
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
