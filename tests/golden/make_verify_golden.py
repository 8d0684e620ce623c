"""Writes the replay-verification golden logs, and loads one into a store to try the CLI on.

    python tests/golden/make_verify_golden.py             # write both logs (once)
    python tests/golden/make_verify_golden.py load verify-doctored.log /tmp/doctored

Each log is a session with one chat turn, two sub-agent runs and a stalled model call,
written to a real LMDB store on a FakeClock: every decision is the pure policy's answer
at the clock's ``now``, appended at that ``now``, as the actors do.

* ``verify-clean.log``: run A hangs and its watchdog fires at its deadline; the recovery
  protocol respawns it with its continuation context (run B, which succeeds); a model
  call that stalls is aborted by its stall limit; a provider failing three times in a
  row is degraded and recovers at the next success. ``replay --verify`` finds nothing.
* ``verify-doctored.log``: the same session, doctored twice: run A's watchdog fired 50 s
  before its deadline (its recovery then follows from that), and run B hangs with no
  watchdog at all while the session goes on past its deadline: one decision that does
  not follow, one missed deadline.

Like ``make_golden.py``: run once when a log is added; never to "fix" a test.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import msgspec

from stalwart import store as store_module
from stalwart.clock import FakeClock
from stalwart.config import Config, parse_config
from stalwart.events import (
    DEFAULT_CODEC,
    Event,
    MessageAppended,
    PromptActivity,
    PromptCompleted,
    PromptStarted,
    ProviderCallFailed,
    ProviderCallSucceeded,
    RecordedEvent,
    RuntimeStarted,
    RuntimeStopped,
    SessionCreated,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    SubagentWatchdogTimeout,
    TurnCompleted,
    TurnStarted,
)
from stalwart.state import (
    HEALTH,
    RUN,
    decide_health,
    decide_prompt_timeout,
    decide_recovery,
    decide_watchdog,
    fold,
    window_started,
    window_touched,
)
from stalwart.store import EventStore, NewEvent

HERE = Path(__file__).parent
START = 1_790_000_000.0
CHAT = "session:chat-1"
RUN_A = "session:run-a"
RUN_B = "session:run-b"
PROVIDER = "provider:main"
CONFIG: Config = parse_config(
    {
        "providers": {"main": {"kind": "openai", "base_url": "https://api.example/v1"}},
        "agents": {"default": {"provider": "main", "model": "m1", "prompt_timeout_ms": 30_000}},
        "subagents": {"class_timeouts_ms": {"formatting": 120_000}},
    }
)
SUB = CONFIG.subagents


class _Log:
    """Appends at the fake clock's now; decisions come from the pure policies."""

    def __init__(self, store: EventStore, clock: FakeClock) -> None:
        self.store, self.clock = store, clock

    def at(self, seconds: float) -> _Log:
        self.clock.set(START + seconds)
        return self

    def add(self, stream: str, *events: Event) -> None:
        self.store.append(stream, [NewEvent(event=e, ts=self.clock.now()) for e in events])

    def run(self, stream: str) -> object:
        return fold(RUN, stream, self.store.read_stream(stream))


def _chat_turn(log: _Log) -> None:
    log.at(1).add(CHAT, SessionCreated(agent="default", channel="chat"))
    log.at(2).add(CHAT, TurnStarted(turn_id="t1"))
    log.add(CHAT, MessageAppended(message_id="m1", role="user", content="format the report"))
    started = PromptStarted(
        call_id="c1", provider="main", model="m1", timeout_ms=30_000, makespan_ms=300_000
    )
    log.at(3).add(CHAT, started)
    log.at(4).add(CHAT, PromptActivity(call_id="c1", tokens=12))
    log.at(5).add(CHAT, PromptCompleted(call_id="c1", output_tokens=40))
    log.add(CHAT, MessageAppended(message_id="m2", role="assistant", content="On it."))
    log.add(CHAT, TurnCompleted(turn_id="t1", steps=1))


def _spawn(log: _Log, stream: str, task: str, attempt: int = 1) -> None:
    spawned = SubagentSpawned(
        parent="chat-1",
        task=task,
        task_class="formatting",
        timeout_ms=120_000,
        max_steps=5,
        attempt=attempt,
        timeout_knob="class_timeouts_ms.formatting",
        channel="chat",
        conversation="chat-1",
    )
    log.add(stream, spawned)


def _watchdog(log: _Log, stream: str) -> None:
    state = log.run(stream)
    log.add(stream, *decide_watchdog(state, log.clock.now(), per_step_timeout_ms=60_000))  # type: ignore[arg-type]


def _recover(log: _Log, stream: str) -> None:
    decided = decide_recovery(log.run(stream), max_attempts=SUB.recovery_max_attempts)  # type: ignore[arg-type]
    log.add(stream, *decided)


def _stalled_call(log: _Log) -> None:
    log.at(400).add(CHAT, TurnStarted(turn_id="t2"))
    started = PromptStarted(
        call_id="c2", provider="main", model="m1", timeout_ms=30_000, makespan_ms=300_000
    )
    log.at(401).add(CHAT, started)
    window = window_started(started, log.clock.now())
    log.at(410).add(CHAT, PromptActivity(call_id="c2", tokens=3))
    window = window_touched(window, log.clock.now())
    log.at(440)
    timeout = decide_prompt_timeout(window, log.clock.now())
    assert timeout is not None
    log.add(CHAT, timeout)
    log.add(CHAT, TurnCompleted(turn_id="t2", outcome="failed", reason="all_models_failed"))


def _provider(log: _Log) -> None:
    health = CONFIG.health
    for second in (441, 442, 443):
        failed = ProviderCallFailed(
            provider="main", model="m1", agent="default", error_class="server_error", status=503
        )
        log.at(second).add(PROVIDER, failed)
    state = fold(HEALTH, PROVIDER, log.store.read_stream(PROVIDER))
    knobs = {
        "window_ms": health.window_ms,
        "min_agents": health.min_agents,
        "consecutive": health.consecutive_failures,
    }
    log.add(PROVIDER, *decide_health(state, log.clock.now(), **knobs))
    log.at(450).add(PROVIDER, ProviderCallSucceeded(provider="main", model="m1", agent="default"))
    state = fold(HEALTH, PROVIDER, log.store.read_stream(PROVIDER))
    log.add(PROVIDER, *decide_health(state, log.clock.now(), **knobs))


def write(store: EventStore, clock: FakeClock, *, doctored: bool) -> None:
    log = _Log(store, clock)
    log.at(0).add("runtime", RuntimeStarted(config=CONFIG.to_record(), stalwart_version="golden"))
    _chat_turn(log)
    log.at(10)
    _spawn(log, RUN_A, "format the report as a table")
    log.at(40).add(RUN_A, SubagentProgress(tokens=200, step=1))
    log.at(70).add(RUN_A, SubagentProgress(tokens=410, step=2))
    if doctored:  # the watchdog fires 50 s early (at 80 s, its deadline is 130 s)
        state = log.run(RUN_A)
        [due] = decide_watchdog(state, START + 130, per_step_timeout_ms=60_000)  # type: ignore[arg-type]
        assert isinstance(due, SubagentWatchdogTimeout)
        log.at(80).add(RUN_A, msgspec.structs.replace(due, elapsed_ms=70_000))
    else:
        log.at(130)
        _watchdog(log, RUN_A)
    _recover(log, RUN_A)
    log.at(131)
    _spawn(log, RUN_B, "format the report as a table (continue)", attempt=2)
    log.at(160).add(RUN_B, SubagentProgress(tokens=90, step=3))
    if not doctored:
        log.at(200).add(RUN_B, SubagentProgress(tokens=300, step=5))
        log.at(210).add(RUN_B, SubagentCompleted(result="| a | b |"))
    _stalled_call(log)  # in the doctored log, run B's deadline (251 s) passes meanwhile
    _provider(log)
    if doctored:
        log.at(460).add(RUN_B, SubagentCompleted(result="| a | b |"))
    log.at(500).add("runtime", RuntimeStopped())


def _write_log(name: str, *, doctored: bool) -> None:
    clock = FakeClock(start=START)
    with tempfile.TemporaryDirectory() as scratch:
        store = store_module.open(Path(scratch) / "store", clock=clock)
        try:
            write(store, clock, doctored=doctored)
            encoded = [DEFAULT_CODEC.encode(record) for record in store.read_all()]
        finally:
            store.close()
    (HERE / name).write_bytes(msgspec.msgpack.encode(encoded))


def copy_record(store: EventStore, record: RecordedEvent) -> RecordedEvent:
    """Append ``record`` to ``store`` as it was (event, time, ids); the record written.
    Into an empty store, in order, positions and versions come out the same."""
    new = NewEvent(
        event=record.event,
        ts=record.ts,
        id=record.id,
        causation_id=record.causation_id,
        correlation_id=record.correlation_id,
    )
    [written] = store.append(record.stream, [new])
    return written


def load(name: str, where: str | Path) -> EventStore:
    """A new LMDB store at ``where`` holding the golden log ``name`` (same positions)."""
    raw: list[bytes] = msgspec.msgpack.decode((HERE / name).read_bytes())
    store = store_module.open(where)
    for data in raw:
        record = DEFAULT_CODEC.decode(data)
        written = copy_record(store, record)
        assert written.position == record.position, "load into an empty store"
    return store


def main(argv: list[str]) -> int:
    if argv[:1] == ["load"] and len(argv) == 3:
        load(argv[1], argv[2]).close()
        return 0
    _write_log("verify-clean.log", doctored=False)
    _write_log("verify-doctored.log", doctored=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
