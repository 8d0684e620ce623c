"""Runtime: the configured parts on one log, end to end.

A real LMDB store in tmp_path, the fake provider over loopback, MemoryChannels passed in.
The runtime runs on a ``FakeClock``: its scheduler fires timers (the health window, the
dead-letter retries) only when the test moves the clock, and every decision's timestamp
is the fake time. HTTP is real, so the model caller's own budgets are real seconds (a few,
never reached here). Tests wait on the log (``store.wait_for``), on the channel (on the
runtime's I/O loop) and on the fake's record, never on a sleep.
"""

from __future__ import annotations

import os
import runpy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog.testing

from stalwart import store as store_module
from stalwart.actors import ABANDONED_TEXT, DEGRADED_TEXT, FAILED_TEXT, MAX_STEPS_TEXT
from stalwart.channels import ConsoleChannel, Delivery, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.errors import ConfigError, SessionActionError
from stalwart.events import (
    AnnouncementDeadLetterDelivered,
    AnnouncementDeadLettered,
    AnnouncementDelivered,
    BreakerOpened,
    ContextAssembled,
    ProviderCallFailed,
    ProviderDegraded,
    ProviderRecovered,
    RuntimeStarted,
    RuntimeStopped,
    TurnCompleted,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import Answer, Fail, FakeProvider, FakeToolCall, Hang
from tests._raced import RacedOnce
from tests._runtime_support import (
    GUARD,
    delivered,
    delivered_by_clock,
    has,
    log_until,
    of,
    until,
)

ROOT = Path(__file__).resolve().parent.parent
AGENT: dict[str, Any] = {
    "provider": "main",
    "model": "m1",
    "prompt_timeout_ms": 5_000,
    "retry_prompt_timeout_ms": 5_000,
    "max_retries": 0,
    "retry_base_ms": 10,
    "retry_cap_ms": 50,
}


def config(base_url: str, **extra: Any) -> Config:
    data: dict[str, Any] = {
        "providers": {
            "main": {"kind": "openai", "base_url": base_url, "breaker_failure_threshold": 50}
        },
        "agents": {"default": dict(AGENT), "other": dict(AGENT)},
        # a retry only after the health window: what delivers a dead letter is the drain
        "dead_letters": {"retry_base_ms": 120_000},
    }
    return parse_config(data | extra)


@pytest.fixture
def rt(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> Iterator[Runtime]:
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        yield rt


# -- lifecycle ------------------------------------------------------------------------------


def test_start_and_stop_are_recorded_with_the_config_in_force_and_no_secret(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    token = "T0KEN-in-the-path-9f8e7d"
    secret_url = fake.base_url.replace("http://", "http://user:pw@")
    cfg = config(
        fake.base_url,
        channels={"hook": {"kind": "webhook", "url": f"https://hooks.example/s/{token}"}},
    )
    cfg = msgspec.structs.replace(
        cfg, providers={"main": msgspec.structs.replace(cfg.providers["main"], base_url=secret_url)}
    )
    rt = Runtime(cfg, store=store, clock=clock)
    with rt:
        assert set(rt.channels) == {"hook"}  # the config names a channel: no console
        assert set(rt.health()) == {"main"}
    rt.close()  # a second close: nothing more happens
    records = list(store.read_stream("runtime"))
    assert [r.type for r in records] == ["runtime:started", "runtime:stopped"]
    started, stopped = records[0].event, records[1].event
    assert isinstance(started, RuntimeStarted)
    assert isinstance(stopped, RuntimeStopped)
    expected = msgspec.json.decode(msgspec.json.encode(cfg.to_record()))
    expected["store"]["location"] = store.location  # the store in use, not the config's default
    assert started.config == expected
    assert parse_config(started.config).agent("other") == cfg.agent("other")  # replayable
    assert started.pid == os.getpid()
    assert stopped.reason == "shutdown"
    text = msgspec.json.encode(started.config).decode()
    assert token not in text
    assert "user:pw" not in text
    assert records[0].ts == clock.now()
    assert store.stream_version("runtime") == 2  # the host's store stays open


def test_a_provider_key_variable_that_is_not_set_is_said_at_start(
    store: EventStore, clock: FakeClock, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call went out without a key and came back 401; nothing said why."""
    monkeypatch.delenv("STALWART_TEST_NO_SUCH_KEY", raising=False)
    monkeypatch.setenv("STALWART_TEST_SET_KEY", "sk-test-secret-value")
    providers = {
        "main": {
            "kind": "openai",
            "base_url": fake.base_url,
            "api_key_env": "STALWART_TEST_NO_SUCH_KEY",
        },
        "spare": {
            "kind": "openai",
            "base_url": fake.base_url,
            "api_key_env": "STALWART_TEST_SET_KEY",
        },
    }
    with (
        structlog.testing.capture_logs() as logs,
        Runtime(config(fake.base_url, providers=providers), store=store, clock=clock),
    ):
        pass
    missing = [e for e in logs if e["event"] == "provider.api_key_missing"]
    assert [(e["provider"], e["env"], e["log_level"]) for e in missing] == [
        ("main", "STALWART_TEST_NO_SUCH_KEY", "warning")
    ]
    assert "sk-test-secret-value" not in repr(logs)


def test_a_postgresql_store_url_is_recorded_without_its_password() -> None:
    """``store.location`` went into every ``runtime:started`` verbatim, password and all."""
    cfg = parse_config({"store": {"location": "postgresql://app:hunter2@db.internal:5433/agents"}})
    assert cfg.to_record()["store"]["location"] == "postgresql://db.internal:5433/agents"
    assert cfg.store.location.endswith("hunter2@db.internal:5433/agents")  # the config keeps it


def test_a_store_path_is_created_and_closed_with_the_runtime(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider
) -> None:
    where = tmp_path / "fresh" / "log"
    with Runtime(config(fake.base_url), store=str(where), clock=clock) as rt:
        assert "console" in rt.channels  # the config names no channel
        assert isinstance(rt.channels["console"], ConsoleChannel)
    assert where.exists()
    reopened = store_module.open(where, create=False)
    try:
        assert [r.type for r in reopened.read_stream("runtime")] == [
            "runtime:started",
            "runtime:stopped",
        ]
    finally:
        reopened.close()
    with pytest.raises(RuntimeError, match="closed"):
        rt.start()


def test_an_unknown_agent_or_channel_is_a_config_error(rt: Runtime) -> None:
    with pytest.raises(ConfigError, match="no agent named 'nobody'"):
        rt.session(agent="nobody", channel="chat")
    with pytest.raises(ConfigError, match=r"no channel named 'pager' \(available: \['chat'"):
        rt.session(channel="pager")


@pytest.mark.parametrize("bad", ["a b", "new\nline", "x" * 129, "session:s1", "context:s1"])
def test_a_session_id_no_session_can_have_is_refused_at_once(rt: Runtime, bad: str) -> None:
    """It used to start an Agent whose every turn the context engine refused: the user got
    the static failure text, the host no error."""
    with pytest.raises(SessionActionError, match="not a session id") as refused:
        rt.session(bad, channel="chat")
    assert refused.value.reason == "invalid_session"
    assert bad not in str(refused.value)


# -- sessions -------------------------------------------------------------------------------


def test_a_session_turn_runs_end_to_end(
    rt: Runtime, chat: MemoryChannel, fake: FakeProvider, store: EventStore
) -> None:
    fake.add(Answer(text="hello there"))
    session = rt.session("s1", channel="chat", conversation="c1", thread="t1")
    assert rt.session("s1") is session  # the running one
    session.send("hi")
    [reply] = delivered(rt, chat, 1)
    assert (reply.text, reply.conversation, reply.thread) == ("hello there", "c1", "t1")
    records = log_until(store, "session:s1", has(TurnCompleted))
    [completed] = [r.event for r in records if isinstance(r.event, TurnCompleted)]
    assert completed.outcome == "answered"
    report = session.status(timeout=GUARD)
    assert report.idle
    [request] = fake.requests
    assert request.body["model"] == "m1"


def test_a_registered_tool_is_offered_and_its_result_goes_back_to_the_model(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    agents = {"default": AGENT | {"system_prompt": "Be brief."}}
    cfg = config(fake.base_url, agents=agents)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:

        @rt.tool(timeout_ms=5_000)
        def lookup(order: int) -> str:
            """Where an order is."""
            return f"order {order} ships tomorrow"

        call = FakeToolCall(id="c1", name="lookup", arguments={"order": 1234})
        fake.add(Answer(text="", tool_calls=(call,)), Answer(text="It ships tomorrow."))
        rt.session("s1", channel="chat").send("where is order 1234?")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == "It ships tomorrow."
    first, second = fake.requests
    names = [t["function"]["name"] for t in first.body["tools"]]
    assert names == ["lookup", "ctx_search", "ctx_inspect", "ctx_expand"]  # dag mode's own
    system = first.body["messages"][0]
    assert system["role"] == "system"
    assert system["content"].startswith("Be brief.\n\n")  # then the dag engine's clause
    last = second.body["messages"][-1]
    assert (last["role"], last["tool_call_id"]) == ("tool", "c1")
    assert last["content"] == "order 1234 ships tomorrow"


def test_the_loop_limits_come_from_the_config(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = config(fake.base_url, agents={"default": AGENT | {"max_steps": 1}})
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.tool(lambda: "nothing", name="noop", description="Does nothing.")
        fake.set_default(Answer(text="", tool_calls=(FakeToolCall(id="n", name="noop"),)))
        rt.session("s1", channel="chat").send("loop")
        [reply] = delivered(rt, chat, 1)
    assert reply.text == MAX_STEPS_TEXT
    assert len(fake.requests) == 1


# -- degradation and recovery ---------------------------------------------------------------


def test_a_degraded_provider_answers_at_once_and_recovery_drains_the_dead_letter(
    rt: Runtime, chat: MemoryChannel, fake: FakeProvider, store: EventStore, clock: FakeClock
) -> None:
    fake.set_default(Fail(status=503))
    first = rt.session("a", channel="chat")
    second = rt.session("b", agent="other", channel="chat")
    first.send("one")
    assert delivered(rt, chat, 1)[0].text == FAILED_TEXT
    second.send("two")
    assert delivered(rt, chat, 2)[1].text == FAILED_TEXT
    # failures from two agents within the window: degraded
    log_until(store, "provider:main", has(ProviderDegraded))
    assert rt.health()["main"].degraded
    calls = len(fake.requests)

    chat.fail_next(1)  # the static text cannot be delivered: it is dead-lettered
    began = time.monotonic()
    first.send("three")
    attempt = delivered(rt, chat, 3, attempted=True)[2]
    assert time.monotonic() - began < 2.0
    assert attempt.text == DEGRADED_TEXT
    assert len(fake.requests) == calls  # no request to a degraded provider
    log_until(store, "deadletter", has(AnnouncementDeadLettered))
    [entry] = rt.dead_letters().entries
    assert entry.text == DEGRADED_TEXT

    clock.advance(rt.config.health.window_ms / 1000 + 1)  # a quiet window: recovered
    log_until(store, "provider:main", has(ProviderRecovered))
    records = log_until(store, "deadletter", has(AnnouncementDeadLetterDelivered))
    assert [m.text for m in delivered(rt, chat, 3)][2] == DEGRADED_TEXT
    assert not rt.health()["main"].degraded
    queue = rt.dead_letters()
    assert (queue.entries, queue.delivered) == ((), 1)
    [done] = [r for r in records if isinstance(r.event, AnnouncementDeadLetterDelivered)]
    assert done.ts == clock.now() < entry.enqueued_at + 120  # at recovery, before any retry


def test_a_call_whose_retries_all_fail_is_one_failure_for_the_health_monitor(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Seed 000's "3 consecutive failures from any single agent" counts calls, its SDK
    retries being inside one: a turn whose three attempts (``max_retries`` 2) all fail
    does not degrade the provider for every agent. Three such turns do, and with the
    default breaker (5 failed calls) the provider is degraded before its breaker opens."""
    fake.set_default(Fail(status=503))
    retrying = AGENT | {"max_retries": 2, "retry_base_ms": 1, "retry_cap_ms": 2}
    cfg = config(
        fake.base_url,
        providers={"main": {"kind": "openai", "base_url": fake.base_url}},
        agents={"default": retrying},
    )
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as rt:
        session = rt.session("a", channel="chat")
        session.send("one")  # each attempt's backoff on the Clock
        assert delivered_by_clock(clock, chat, 1)[0].text == FAILED_TEXT
        failed = [
            r.event
            for r in store.read_stream("provider:main")
            if isinstance(r.event, ProviderCallFailed)
        ]
        assert [bool(e.retry_of) for e in failed] == [False, True, True]  # one call
        head = store.stream_version("provider:main")
        # the health actor folds on its own thread: its report once it has folded them
        report = until(lambda: (now := rt.health()["main"]).version >= head and now)
        assert not report.degraded
        for count, text in ((2, "two"), (3, "three")):
            session.send(text)
            assert delivered_by_clock(clock, chat, count)[-1].text == FAILED_TEXT
        records = log_until(store, "provider:main", has(ProviderDegraded))
    assert not [r for r in records if isinstance(r.event, BreakerOpened)]
    assert len(fake.requests) == 9


class ContextRaced(RacedOnce):
    """Every append to ``context:s1`` loses the race to another writer: the ContextStore
    cannot record its assembly, so the model call never starts (not the model's doing)."""

    def append(self, stream: str, events: Any, expected_version: Any = None, **kw: Any) -> Any:
        self.armed = True
        return super().append(stream, events, expected_version, **kw)


def test_a_turn_the_machinery_broke_does_not_blame_the_models(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """A turn that failed on our side (here the context stream's append conflicting on
    every attempt: ``internal``) is retried by the wake and, once it gives up, ends with
    ABANDONED_TEXT. FAILED_TEXT says every configured model failed, which no model did:
    the provider got no request at all."""
    raced = ContextRaced(store, "context:s1", ContextAssembled(tokens_in=0, tokens_out=0, budget=0))
    cfg = config(fake.base_url, activations={"max_attempts": 2, "backoff_base_ms": 1_000})
    with Runtime(cfg, store=raced, clock=clock, channels={"chat": chat}) as rt:  # type: ignore[arg-type]
        rt.session("s1", channel="chat").send("hello")
        [reply] = delivered_by_clock(clock, chat, 1, step_s=0.5)
    assert (reply.text, reply.kind) == (ABANDONED_TEXT, "failure_notice")
    assert fake.requests == []
    turns = of(TurnCompleted, list(store.read_stream("session:s1")))
    ended = [(t.outcome, t.reason) for t in turns]
    assert ended == [("failed", "internal"), ("failed", "internal")], ended


# -- stopping -------------------------------------------------------------------------------


def test_close_while_a_call_hangs_returns_promptly_and_closes_the_request(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    cfg = config(fake.base_url, agents={"default": AGENT | {"prompt_timeout_ms": 60_000}})
    rt = Runtime(cfg, store=store, clock=clock, channels={"chat": chat}).start()
    fake.add(Hang())
    session = rt.session("s1", channel="chat")
    session.send("hello?")
    fake.wait_for(lambda requests: len(requests) == 1, GUARD)
    began = time.monotonic()
    rt.close()
    assert time.monotonic() - began < 5.0
    assert fake.wait_finished(0, GUARD).outcome == "client_closed"
    assert [r.type for r in store.read_stream("runtime")] == [
        "runtime:started",
        "runtime:stopped",
    ]
    rt.close()
    assert store.stream_version("runtime") == 2
    assert not chat.attempted  # no reply after the stop
    with pytest.raises(RuntimeError, match="'s1' is stopped"):
        session.send("still there?")
    with pytest.raises(RuntimeError, match="closed"):
        rt.health()


class SlowChannel:
    """A host channel whose receiver takes ``delay_s`` (real time) to answer, or never
    answers (``delay_s=None``), until the send is cancelled."""

    def __init__(self, name: str, delay_s: float | None) -> None:
        self.name = name
        self.delay_s = delay_s
        self.started = threading.Event()
        self.delivered: list[OutboundMessage] = []

    async def send(self, message: OutboundMessage) -> Delivery:
        self.started.set()
        if self.delay_s is None:
            await anyio.sleep_forever()
        await anyio.sleep(self.delay_s)
        self.delivered.append(message)
        return Delivery(channel=self.name)

    async def aclose(self) -> None:
        return None


def test_close_lets_an_answer_being_sent_end_and_records_it(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    """A close while the answer is on its way to a slow receiver waits for it (up to
    ``dead_letters.close_grace_ms``): the user has it, and the log says so, so the next
    runtime sends nothing again."""
    chat = SlowChannel("chat", 0.3)
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("hello")
        assert chat.started.wait(GUARD)
    assert [m.text for m in chat.delivered] == ["default answer"]
    records = list(store.read_stream("session:s1"))
    assert [type(r.event) for r in records].count(AnnouncementDelivered) == 1


def test_close_cuts_a_send_short_once_its_grace_is_spent(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    chat = SlowChannel("chat", None)  # a receiver that never answers
    cfg = config(fake.base_url, dead_letters={"close_grace_ms": 300})
    rt = Runtime(cfg, store=store, clock=clock, channels={"chat": chat}).start()
    rt.session("s1", channel="chat").send("hello")
    assert chat.started.wait(GUARD)
    began = time.monotonic()
    with structlog.testing.capture_logs() as captured:
        rt.close()
    took = time.monotonic() - began
    assert 0.3 <= took < 3.0  # the grace, then the stop (generous: a loaded machine)
    assert [e["sessions"] for e in captured if e["event"] == "runtime.sends_cut_short"] == [1]
    assert store.stream_version("runtime") == 2  # started, stopped


# -- config ---------------------------------------------------------------------------------


def test_the_agent_loop_knobs_are_config_with_defaults() -> None:
    agent = parse_config(
        {
            "providers": {"p": {"kind": "openai", "base_url": "http://x/v1"}},
            "agents": {"default": {"provider": "p", "model": "m"}},
        }
    ).agent()
    assert (agent.max_steps, agent.tool_limit, agent.system_prompt) == (10, 4, None)
    with pytest.raises(ConfigError, match=r"agents\.default\.max_step"):
        parse_config(
            {
                "providers": {"p": {"kind": "openai", "base_url": "http://x/v1"}},
                "agents": {"default": {"provider": "p", "model": "m", "max_step": 3}},
            }
        )


# -- the documented example -----------------------------------------------------------------


def test_the_embedding_example_runs(
    tmp_path: Path,
    fake: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake.add(
        Answer(
            text="",
            tool_calls=(
                FakeToolCall(id="c1", name="order_status", arguments={"order_id": "1234"}),
            ),
        ),
        Answer(text="Order 1234 ships tomorrow."),
    )
    monkeypatch.setenv("STALWART_BASE_URL", fake.base_url)
    monkeypatch.setenv("STALWART_STORE", str(tmp_path / "store"))
    runpy.run_path(str(ROOT / "docs" / "examples" / "embed.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Order 1234 ships tomorrow." in out
    assert "runtime:stopped" in out


def test_a_channel_the_config_cannot_build_fails_the_start_before_anything_runs(
    store: EventStore, clock: FakeClock, fake: FakeProvider
) -> None:
    hook = {
        "kind": "webhook",
        "url": "https://hooks.example/in",
        "secret_header": "X-Token",
        "secret_env": "STALWART_TEST_UNSET_SECRET",
    }
    rt = Runtime(config(fake.base_url, channels={"hook": hook}), store=store, clock=clock)
    with pytest.raises(ConfigError, match="STALWART_TEST_UNSET_SECRET"):
        rt.start()
    assert store.stream_version("runtime") == 0  # nothing recorded, nothing left running
    assert not rt.running


def test_close_survives_a_store_the_host_closed_first(
    tmp_path: Path, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    host_store = store_module.open(tmp_path / "store", clock=clock)
    rt = Runtime(config(fake.base_url), store=host_store, clock=clock, channels={"chat": chat})
    rt.start()
    rt.session("s1", channel="chat").send("hi")
    delivered(rt, chat, 1)
    portal = rt.portal
    host_store.close()  # the host closed its store first: runtime:stopped cannot be recorded
    rt.close()  # logged, not raised
    assert not portal.running
    assert not rt.running


def test_the_embedding_page_shows_the_example_as_it_is() -> None:
    page = (ROOT / "docs" / "embedding.md").read_text()
    marker = "<!-- example: docs/examples/embed.py -->\n```python\n"
    shown = page.split(marker, 1)[1].split("```\n", 1)[0]
    assert shown == (ROOT / "docs" / "examples" / "embed.py").read_text()


def test_a_new_runtime_on_the_same_log_carries_the_session_on(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    fake.add(Answer(text="first answer"), Answer(text="second answer"))
    with Runtime(config(fake.base_url), store=store, clock=clock, channels={"chat": chat}) as rt:
        rt.session("s1", channel="chat").send("first")
        delivered(rt, chat, 1)
        # the channel has it; the close must not cut the Agent's record of it short (a
        # reply whose delivery is not in the log is sent again by the next runtime)
        log_until(store, "session:s1", has(AnnouncementDelivered))

    def second_run() -> None:
        cfg = config(fake.base_url)
        with Runtime(cfg, store=store, clock=clock, channels={"chat": chat}) as again:
            again.session("s1", channel="chat").send("second")
            assert delivered(again, chat, 2)[1].text == "second answer"
            raise ValueError("host broke")

    with pytest.raises(ValueError, match="host broke"):
        second_run()
    later = fake.requests[1].body["messages"]
    assert later[0]["role"] == "system"  # the context engine's note on summaries
    assert [(m["role"], m["content"]) for m in later[1:]] == [
        ("user", "first"),
        ("assistant", "first answer"),
        ("user", "second"),
    ]
    stops = [r.event for r in store.read_stream("runtime") if isinstance(r.event, RuntimeStopped)]
    assert [s.reason for s in stops] == ["shutdown", "error"]
