"""``replay --verify`` throughput against plain replay (the fold alone), in one run.

The log: chat sessions running side by side (turns with a model call streaming activity,
a tool call, a second model call; every fourth turn a call that stalls and is aborted by
its stall limit), a sub-agent run every other turn (progress, completion; every fifth
run hangs, its watchdog fires at its deadline and the recovery protocol decides), and a
flaky provider degraded and recovered every 30 s. Every decision is the pure policy's
answer at its ``ts``, so the log verifies clean (the benchmark checks that it does).

Both sides walk the same records: plain replay folds every stream with its replay fold
(``fold_streams(records, aggregate_for)``, what ``stalwart replay`` folds per stream);
verify is :func:`~stalwart.state.verify` with the CLI's registry. Each is measured from
decoded records and from the stored bytes (``Codec.decode_batch`` first). Best of 5 in
CPU time of the process, the four runs taking turns (the figures hold on a busy machine).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from typing import Any

from stalwart.cli._replay import REGISTRY, default_knobs
from stalwart.config import Config
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
    SessionCreated,
    SubagentCompleted,
    SubagentProgress,
    SubagentSpawned,
    ToolCall,
    ToolCompleted,
    ToolStarted,
    TurnCompleted,
    TurnStarted,
)
from stalwart.state import (
    HEALTH,
    RUN,
    aggregate_for,
    decide_health,
    decide_prompt_timeout,
    decide_recovery,
    decide_watchdog,
    fold_streams,
    verify,
    window_started,
    window_touched,
)
from stalwart.testing import recorded

from ._registry import Result, benchmark, ratio

T0 = 1_800_000_000.0
Timed = tuple[float, int, str, Event]  # (ts, tie-break, stream, event)
_ORDER = iter(range(1 << 62))


def _at(ts: float, stream: str, event: Event) -> Timed:
    return (ts, next(_ORDER), stream, event)


def _run(name: str, start: float, hangs: bool) -> Iterator[Timed]:
    stream = f"session:{name}"
    spawned = SubagentSpawned(
        parent="chat", task="format", task_class="formatting", timeout_ms=120_000
    )
    records = [_record(stream, 1, start, spawned)]
    yield _at(start, stream, spawned)
    for step in range(1, 3 if hangs else 6):
        progress = SubagentProgress(tokens=step * 100, step=step)
        records.append(_record(stream, len(records) + 1, start + step * 2, progress))
        yield _at(start + step * 2, stream, progress)
    if not hangs:
        yield _at(start + 12, stream, SubagentCompleted(result="done"))
        return
    state = RUN.initial(stream)
    for record in records:
        state = RUN.apply(state, record)
    at = start + 120
    [timeout] = decide_watchdog(state, at, per_step_timeout_ms=60_000)
    yield _at(at, stream, timeout)
    state = RUN.apply(state, _record(stream, len(records) + 1, at, timeout))
    for decided in decide_recovery(state, max_attempts=2):
        yield _at(at, stream, decided)


def _record(stream: str, version: int, ts: float, event: Event) -> RecordedEvent:
    return recorded(event, stream=stream, version=version, ts=ts)


def _call(stream: str, call: str, at: float, *, stalls: bool) -> Iterator[Timed]:
    started = PromptStarted(
        call_id=call, provider="main", model="m", timeout_ms=30_000, makespan_ms=300_000
    )
    yield _at(at, stream, started)
    window = window_started(started, at)
    for second in (1, 2) if stalls else (1, 2, 3):
        window = window_touched(window, at + second)
        yield _at(at + second, stream, PromptActivity(call_id=call, tokens=second * 8))
    if stalls:
        timeout = decide_prompt_timeout(window, at + 32)
        assert timeout is not None
        yield _at(at + 32, stream, timeout)
    else:
        yield _at(at + 4, stream, PromptCompleted(call_id=call, output_tokens=30))
        yield _at(at + 4, "provider:main", ProviderCallSucceeded(provider="main", model="m",
                                                                  agent="chat"))  # fmt: skip


def _session(index: int, turns: int) -> Iterator[Timed]:
    stream = f"session:chat-{index}"
    t = T0 + index * 20.0
    yield _at(t, stream, SessionCreated(agent="default", channel="chat"))
    for turn in range(turns):
        at = t + 1 + turn * 40
        turn_id = f"t{index}-{turn}"
        yield _at(at, stream, TurnStarted(turn_id=turn_id))
        yield _at(at, stream, MessageAppended(message_id=f"u{turn}", role="user", content="go"))
        if turn % 4 == 3:
            yield from _call(stream, f"c{index}-{turn}", at, stalls=True)
            yield _at(at + 32, stream, TurnCompleted(turn_id=turn_id, outcome="failed"))
            continue
        yield from _call(stream, f"c{index}-{turn}a", at, stalls=False)
        tool = ToolCall(id=f"k{turn}", name="lookup", arguments="{}")
        yield _at(at + 4, stream, MessageAppended(message_id=f"a{turn}", role="assistant",
                                                  tool_calls=(tool,)))  # fmt: skip
        yield _at(at + 4, stream, ToolStarted(call_id=tool.id, tool="lookup", arguments="{}"))
        yield _at(at + 5, stream, ToolCompleted(call_id=tool.id, tool="lookup", output="ok"))
        yield from _call(stream, f"c{index}-{turn}b", at + 5, stalls=False)
        yield _at(at + 9, stream, TurnCompleted(turn_id=turn_id))
        if turn % 2 == 0:
            yield from _run(f"run-{index}-{turn}", at + 2, hangs=turn % 10 == 0)


def _flaky(until: float) -> Iterator[Timed]:
    stream = "provider:flaky"
    health = Config().health
    knobs = {
        "window_ms": health.window_ms,
        "min_agents": health.min_agents,
        "consecutive": health.consecutive_failures,
    }
    state = HEALTH.initial(stream)
    version = 0
    at = T0
    while at < until:
        for event, ts in (
            (ProviderCallFailed(provider="flaky", model="m", agent="a", error_class="server"), 0),
            (ProviderCallFailed(provider="flaky", model="m", agent="a", error_class="server"), 1),
            (ProviderCallFailed(provider="flaky", model="m", agent="a", error_class="server"), 2),
            (ProviderCallSucceeded(provider="flaky", model="m", agent="a"), 10),
        ):
            version += 1
            state = HEALTH.apply(state, _record(stream, version, at + ts, event))
            yield _at(at + ts, stream, event)
            for decided in decide_health(state, at + ts, **knobs):
                version += 1
                state = HEALTH.apply(state, _record(stream, version, at + ts, decided))
                yield _at(at + ts, stream, decided)
        at += 30


def generate(count: int) -> list[RecordedEvent]:
    """About ``count`` records in log order (global positions, stream versions)."""
    per_session = 20
    sessions = max(1, count // 376 + 1)  # ~376 records a session with its runs
    # a session's runs interleave with its turns: each source sorted by time first
    sources = [sorted(_session(i, per_session)) for i in range(sessions)]
    end = T0 + sessions * 20 + per_session * 40 + 200
    started = _at(T0 - 1, "runtime", RuntimeStarted(config=Config().to_record(),
                                                     stalwart_version="bench"))  # fmt: skip
    merged = heapq.merge([started], _flaky(end), *sources)
    versions: dict[str, int] = {}
    out: list[RecordedEvent] = []
    for ts, _, stream, event in merged:
        version = versions[stream] = versions.get(stream, 0) + 1
        out.append(recorded(event, stream=stream, version=version, ts=ts, position=len(out) + 1))
    return out


def _best_rates(count: int, runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Events/s of each run, best of ``repeats`` in CPU time of this process, the runs
    taking turns so that a busy machine slows each side alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, go in runs.items():
            started = time.process_time()
            go()
            best[name] = min(best[name], time.process_time() - started)
    return {name: count / seconds for name, seconds in best.items()}


@benchmark("verify")
def run(quick: bool) -> Result:
    result = Result("verify")
    records = generate(40_000 if quick else 200_000)
    count = len(records)
    defaults = default_knobs()
    report = verify(records, REGISTRY, defaults=defaults)
    if not report.clean:  # the figure means nothing on a log that does not verify
        raise AssertionError(f"the generated log does not verify: {report.findings[:3]}")
    stored = [DEFAULT_CODEC.encode(r) for r in records]

    def from_bytes(then: Callable[[list[RecordedEvent]], Any]) -> Callable[[], Any]:
        def go() -> Any:
            decoded: list[RecordedEvent] = []
            DEFAULT_CODEC.decode_batch(stored, decoded)
            return then(decoded)

        return go

    def fold(rs: list[RecordedEvent]) -> Any:
        return fold_streams(rs, aggregate_for)

    def check(rs: list[RecordedEvent]) -> Any:
        return verify(rs, REGISTRY, defaults=defaults)

    figures = result.figures
    figures["events"] = count
    figures["decisions_checked"] = sum(report.checked.values())
    figures["streams"] = report.streams
    figures.update(
        _best_rates(
            count,
            {
                "fold_events_per_s": lambda: fold(records),
                "verify_events_per_s": lambda: check(records),
                "decode_fold_events_per_s": from_bytes(fold),
                "decode_verify_events_per_s": from_bytes(check),
            },
            repeats=3 if quick else 5,
        )
    )
    result.ratios["verify_vs_fold"] = ratio(
        figures["verify_events_per_s"], figures["fold_events_per_s"]
    )
    result.ratios["decode_verify_vs_decode_fold"] = ratio(
        figures["decode_verify_events_per_s"], figures["decode_fold_events_per_s"]
    )
    result.goal("decode_verify_vs_decode_fold", ">=", 0.15)
    return result
