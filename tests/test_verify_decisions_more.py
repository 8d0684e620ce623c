"""The model chain, a failure notice's fallback and a session's pause, re-derived by replay.

A real Runtime on a real LMDB store and the fake clock, the fake provider over loopback
HTTP, a chat MemoryChannel: each decision it records verifies clean. A doctored copy of
the same stream (the decision with one wrong field) is a mismatch, and a copy with the
decision's recorded inputs blanked, as records written before them were, is not checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner

from stalwart import store as store_module
from stalwart.actors import RunReport
from stalwart.channels import MemoryChannel
from stalwart.cli import cli
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.config import parse_config
from stalwart.events import (
    ActivationAcked,
    ActivationBlocked,
    AnnouncementDelivered,
    AnnouncementFallbackDirect,
    Event,
    ModelFallbackAttempt,
    ModelFallbackExhausted,
    PromptFailed,
    SessionRequiresAction,
    TurnCompleted,
)
from stalwart.runtime import Runtime
from stalwart.state import VerifyReport
from stalwart.store import EventStore, NewEvent
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall
from tests._runtime_support import GUARD, delivered, has, log_until, of

AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
    "fallback_models": ["main:m2"],
}

Tamper = Callable[[Event], Event]


def _runtime(
    fake: FakeProvider, store: EventStore, clock: FakeClock, chat: MemoryChannel
) -> Runtime:
    config = parse_config(
        {
            "providers": {"main": {"kind": "openai", "base_url": fake.base_url}},
            "agents": {"default": AGENT},
            "subagents": {"class_timeouts_ms": {"formatting": 30_000}},
        }
    )
    return Runtime(config, store=store, clock=clock, channels={"chat": chat})


def _copy(store: EventStore, source: str, target: str, kind: type[Event], tamper: Tamper) -> None:
    """``source`` appended again as ``target`` with its first ``kind`` event tampered with
    (a session's activations stay behind: the copy is no worker's)."""
    records = [
        r for r in store.read_stream(source) if not r.type.startswith(("activation:", "lease:"))
    ]
    first = next(r for r in records if isinstance(r.event, kind))
    store.append(
        target,
        [NewEvent(event=tamper(r.event) if r is first else r.event, ts=r.ts) for r in records],
    )


def _verify(store: EventStore, stream: str | None) -> VerifyReport:
    return verify_store(store, stream)


def _replace(**fields: Any) -> Tamper:
    return lambda event: msgspec.structs.replace(event, **fields)


# -- the model chain ------------------------------------------------------------------------


@pytest.fixture
def chained(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> EventStore:
    """r1: m1 refuses the request, m2 answers. r2: both refuse (the chain is spent)."""
    with _runtime(fake, store, clock, chat) as rt:
        fake.add(Fail(status=400))
        rt.session("r1", channel="chat").send("hello")
        log_until(store, "session:r1", has(ActivationAcked))
        fake.add(Fail(status=400), Fail(status=400))
        rt.session("r2", channel="chat").send("hello again")
        log_until(store, "session:r2", has(ActivationAcked))
    return store


def test_a_fallback_and_a_spent_chain_the_runtime_recorded_verify_clean(
    chained: EventStore,
) -> None:
    [attempt] = of(ModelFallbackAttempt, list(chained.read_stream("session:r1")))
    [failed] = of(PromptFailed, list(chained.read_stream("session:r1")))
    assert (attempt.from_model, attempt.to_model, attempt.attempt) == ("main:m1", "main:m2", 1)
    assert (attempt.agent, attempt.vision, attempt.call_id) == ("default", False, failed.call_id)
    spent = list(chained.read_stream("session:r2"))
    [exhausted] = of(ModelFallbackExhausted, spent)
    assert exhausted.models == ("main:m1", "main:m2")
    assert exhausted.call_id == of(PromptFailed, spent)[-1].call_id
    report = _verify(chained, None)
    assert report.findings == ()
    assert report.checked["model:fallback_attempt"] == 2
    assert report.checked["model:fallback_exhausted"] == 1
    assert "model:fallback_attempt" not in report.unchecked


@pytest.mark.parametrize(
    ("source", "kind", "tamper", "words"),
    [
        ("r1", ModelFallbackAttempt, _replace(to_model="main:m9"), "main:m1 -> main:m2"),
        ("r1", ModelFallbackAttempt, _replace(reason="rate_limited"), "failed with bad_request"),
        ("r2", ModelFallbackExhausted, _replace(models=("main:m1",)), "main:m1 -> main:m2"),
        # the chain spent after its first model: m2 was still to try
        (
            "r2",
            ModelFallbackAttempt,
            lambda e: ModelFallbackExhausted(
                models=("main:m1", "main:m2"),
                reason="bad_request",
                agent="default",
                call_id=e.call_id if isinstance(e, ModelFallbackAttempt) else None,
            ),
            "of main:m1 failed",
        ),
    ],
)
def test_a_doctored_fallback_is_a_mismatch(
    chained: EventStore, source: str, kind: type[Event], tamper: Tamper, words: str
) -> None:
    _copy(chained, f"session:{source}", "session:doctored", kind, tamper)
    report = _verify(chained, "session:doctored")
    [finding] = report.findings
    assert finding.kind == "mismatch"
    assert finding.tag.startswith("model:fallback_")
    assert words in finding.message


def test_a_fallback_recorded_without_its_inputs_is_not_checked(chained: EventStore) -> None:
    old = _replace(agent=None, vision=False, call_id=None)
    _copy(chained, "session:r1", "session:old1", ModelFallbackAttempt, old)
    _copy(chained, "session:r2", "session:old2", ModelFallbackExhausted, old)
    report = _verify(chained, None)
    assert report.findings == ()
    assert report.unchecked["model:fallback_attempt"] == 1
    assert report.unchecked["model:fallback_exhausted"] == 1
    assert report.checked["model:fallback_attempt"] == 3  # r1, r2, and r2's copy


# -- a failure notice's fallback to a direct send -------------------------------------------


async def _hang(report: RunReport) -> str:
    report.progress(3, step=1)
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@pytest.fixture
def notified(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[tuple[EventStore, str]]:
    """A run that times out; its notice's announce send fails, the direct one is delivered."""
    store = store_module.open(tmp_path / "store", clock=clock)
    try:
        with _runtime(fake, store, clock, chat) as rt:
            rt.session("s1", channel="chat").send("hi")
            delivered(rt, chat, 1)
            log_until(store, "session:s1", has(TurnCompleted))
            chat.fail_next(1, kind="timeout")  # the announce send
            handle = rt.spawn("s1", "format the table", task_class="formatting", work=_hang)
            handle.status()
            for _ in range(3):
                clock.advance(10)
            assert handle.result(GUARD).outcome == "timed_out"
            log_until(store, handle.stream, has(AnnouncementDelivered))
        yield store, handle.stream
    finally:
        store.close()


def test_a_notice_that_fell_back_to_a_direct_send_verifies_clean(
    notified: tuple[EventStore, str],
) -> None:
    store, run = notified
    records = list(store.read_stream(run))
    [fallback] = of(AnnouncementFallbackDirect, records)
    [done] = of(AnnouncementDelivered, records)
    assert (fallback.announcement_id, done.path) == (done.announcement_id, "direct")
    assert fallback.error_class is not None
    report = _verify(store, None)
    assert report.findings == ()
    assert report.checked["announcement:fallback_direct"] == 1


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        (_replace(timeout_ms=1), "announce_timeout_ms (30000)"),
        (_replace(announcement_id="another"), "not 'another'"),
    ],
)
def test_a_doctored_fallback_direct_is_a_mismatch(
    notified: tuple[EventStore, str], tamper: Tamper, words: str
) -> None:
    store, run = notified
    _copy(store, run, "session:doctored", AnnouncementFallbackDirect, tamper)
    [finding] = _verify(store, "session:doctored").findings
    assert (finding.kind, finding.tag) == ("mismatch", "announcement:fallback_direct")
    assert words in finding.message


def test_a_second_fallback_of_one_notice_is_a_mismatch(
    notified: tuple[EventStore, str], clock: FakeClock
) -> None:
    store, run = notified
    [fallback] = of(AnnouncementFallbackDirect, list(store.read_stream(run)))
    store.append(run, [NewEvent(event=fallback, ts=clock.now())])
    [finding] = _verify(store, run).findings
    assert finding.tag == "announcement:fallback_direct"
    assert "the notice is delivered" in finding.message


def test_a_fallback_direct_without_its_send_failure_is_not_checked(
    notified: tuple[EventStore, str],
) -> None:
    store, run = notified
    _copy(store, run, "session:old", AnnouncementFallbackDirect, _replace(error_class=None))
    report = _verify(store, "session:old")
    assert report.findings == ()
    assert report.unchecked.get("announcement:fallback_direct") == 1
    assert "announcement:fallback_direct" not in report.checked


# -- a session stopped for a human ----------------------------------------------------------


@pytest.fixture
def paused(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> EventStore:
    """A call of a tool that needs confirmation stops the session until the user answers."""
    with _runtime(fake, store, clock, chat) as rt:

        @rt.tool(needs_confirmation=True)
        def refund(order: int, amount: float) -> str:
            """Refund an order."""
            return f"refunded {amount} on {order}"

        call = FakeToolCall(id="c1", name="refund", arguments={"order": 7, "amount": 12.5})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="Refund done."))
        rt.session("s1", channel="chat").send("refund order 7")
        [request] = of(
            SessionRequiresAction, log_until(store, "session:s1", has(ActivationBlocked))
        )
        rt.confirm("s1", request.request_id, allow=True)
        log_until(store, "session:s1", has(ActivationAcked))
    return store


def test_a_pause_the_runtime_recorded_verifies_clean(paused: EventStore, tmp_path: Path) -> None:
    report = _verify(paused, None)
    assert report.findings == ()
    assert report.checked["session:requires_action"] == 1
    where = str(tmp_path / "store")
    result = CliRunner().invoke(cli, ["--store", where, "replay", "--all", "--verify"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        (_replace(arguments='{"order":7,"amount":1250}'), "the request names refund with"),
        (_replace(tool="delete_account"), "the request names delete_account"),
        (_replace(turn_id="another"), "in turn 'another'"),
        (_replace(call_id="c9"), "no unanswered call 'c9'"),
    ],
)
def test_a_doctored_pause_is_a_mismatch(paused: EventStore, tamper: Tamper, words: str) -> None:
    _copy(paused, "session:s1", "session:doctored", SessionRequiresAction, tamper)
    [finding] = _verify(paused, "session:doctored").findings
    assert (finding.kind, finding.tag) == ("mismatch", "session:requires_action")
    assert words in finding.message


def test_a_pause_that_names_no_call_is_not_checked(paused: EventStore) -> None:
    _copy(paused, "session:s1", "session:old", SessionRequiresAction, _replace(call_id=None))
    report = _verify(paused, "session:old")
    assert report.findings == ()
    assert report.unchecked.get("session:requires_action") == 1
