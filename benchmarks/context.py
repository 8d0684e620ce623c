"""The lossless DAG context engine (issue 6), with no LLM: a deterministic stand-in summarizer.

Two sessions, each fed call by call (one assembly before every assistant message, as an
agent calls its provider) at budgets of 8k, 32k and 128k tokens on a caching profile:

- **synthetic**: 10,000 messages (2,000 with ``--quick``), 40% of them tool calls and
  results (some parallel), with 40 planted facts (unique codes in user messages and tool
  results at random places);
- **tau-bench**: the 200 GPT-4o airline trajectories of tau-bench (MIT) concatenated into
  one ~5,300-message session, tool-call ids namespaced per run, with 20 planted facts.
  The file is looked up at ``$STALWART_TAU_BENCH``, ``benchmarks/data/tau-bench/`` and
  ``../shared/data/tau-bench/`` (relative to the repository); the part is skipped, with
  a line saying so, when it is not there.

Measured per session and budget: the largest assembled size over the budget (must be
<= 1), provider-validity violations (OpenAI and Anthropic rules, must be 0), planted
facts recovered byte for byte by ``search`` + ``expand`` (must be 1.0), the share of
consecutive calls whose prefix before the cache fence is unchanged (>= 0.95), per-call
assembly p50 (< 5 ms), and growth: the p50 of the last tenth of calls over the first
tenth (a full re-read per call would grow with the session; incremental stays ~1).
"""

from __future__ import annotations

import json
import lzma
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._machine import quiet_logs
from benchmarks._registry import Result, benchmark
from stalwart.clock import FakeClock
from stalwart.context import (
    ContextMessage,
    DagEngine,
    ExtractiveSummarizer,
    ModelProfile,
    parse_transcript,
)
from stalwart.context._simulate import simulate
from stalwart.events import ToolCall

BUDGETS = (8_000, 32_000, 128_000)
PROFILE = ModelProfile(provider="anthropic", caching=True)
_TEXT = (
    "order refund flight seat booking invoice cancel baggage status customer policy delay "
    "upgrade payment card receipt schedule gate airport itinerary passenger loyalty points "
    "weather hotel transfer address shipment warehouse tracking inventory account"
)
_WORDS = _TEXT.split()


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def synthetic(count: int, seed: int = 6) -> tuple[list[ContextMessage], dict[str, str]]:
    """A session of ``count`` messages, ~40% tool calls and results, and its planted
    facts (message id -> the fact's unique key)."""
    rng = random.Random(seed)
    messages: list[ContextMessage] = [
        ContextMessage(message_id="sys", seq=0, role="system", content="You are a careful agent.")
    ]
    facts: dict[str, str] = {}
    plant_every = max(10, count // 40)
    ts = 1_800_000_000.0
    turn = 0

    def add(role: str, content: str = "", **extra: Any) -> ContextMessage:
        nonlocal ts
        ts += rng.uniform(1, 30)
        message = ContextMessage(
            message_id=f"m{len(messages)}",
            seq=len(messages),
            role=role,  # type: ignore[arg-type]
            content=content,
            turn=turn,
            ts=ts,
            **extra,
        )
        if len(messages) % plant_every == 0 and role in ("user", "tool"):
            key = f"FACT{len(facts):03d}X{rng.randrange(10**8):08d}"
            message = ContextMessage(
                **{
                    **_fields(message),
                    "content": f"{content} The code {key} unlocks locker {len(facts)}.",
                }
            )
            facts[message.message_id] = key
        messages.append(message)
        return message

    while len(messages) < count:
        turn += 1
        add("user", _sentence(rng, rng.randint(8, 40)))
        if rng.random() < 0.66:  # a tool step: one or two calls, their results
            calls = tuple(
                ToolCall(
                    id=f"c{len(messages)}_{n}",
                    name=rng.choice(("get_order", "search", "refund")),
                    arguments=json.dumps({"id": rng.randrange(10**6)}),
                )
                for n in range(1 if rng.random() < 0.8 else 2)
            )
            add("assistant", "", tool_calls=calls)
            for call in calls:
                add("tool", _sentence(rng, rng.randint(20, 160)), tool_call_id=call.id)
        add("assistant", _sentence(rng, rng.randint(10, 60)))
    return messages, facts


def _fields(message: ContextMessage) -> dict[str, Any]:
    return {name: getattr(message, name) for name in message.__struct_fields__}


def tau_path() -> Path | None:
    """Where the tau-bench trajectories are, if anywhere."""
    root = Path(__file__).resolve().parent.parent
    candidates: list[str | Path] = [
        os.environ.get("STALWART_TAU_BENCH", ""),
        root / "benchmarks" / "data" / "tau-bench" / "gpt-4o-airline.json",
        root.parent / "shared" / "data" / "tau-bench" / "gpt-4o-airline.json",
        # the copy the tests read (MIT, compressed; tests/data/tau-bench/README.md)
        root / "tests" / "data" / "tau-bench" / "gpt-4o-airline.json.xz",
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def tau_session(
    path: Path, facts: int = 20, seed: int = 6
) -> tuple[list[ContextMessage], dict[str, str]]:
    """One long session from the trajectories, with ``facts`` planted in user messages."""
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    runs = json.loads(raw)
    runs.sort(key=lambda run: (run.get("task_id", 0), run.get("trial", 0)))
    items: list[dict[str, Any]] = []
    for number, run in enumerate(runs):
        for item in run.get("traj", ()):
            entry = dict(item)
            if number and entry.get("role") == "system":
                entry["role"] = "user"  # a later run's instructions, as the user's words
            if entry.get("tool_calls"):
                entry["tool_calls"] = [
                    {**call, "id": f"r{number}.{call['id']}"} for call in entry["tool_calls"]
                ]
            if entry.get("tool_call_id"):
                entry["tool_call_id"] = f"r{number}.{entry['tool_call_id']}"
            items.append(entry)
    for number, entry in enumerate(items):
        entry["ts"] = 1_800_000_000.0 + 20.0 * number  # the file has none: 20 s apart
    messages = parse_transcript(items, source=str(path))
    rng = random.Random(seed)
    users = [
        index for index, message in enumerate(messages) if message.role == "user" and index > 0
    ]
    planted: dict[str, str] = {}
    for n, index in enumerate(sorted(rng.sample(users, min(facts, len(users))))):
        key = f"TAUFACT{n:03d}X{rng.randrange(10**8):08d}"
        message = messages[index]
        messages[index] = ContextMessage(
            **{**_fields(message), "content": f"{message.content} (reference {key})"}
        )
        planted[message.message_id] = key
    return messages, planted


def recovered(
    engine: DagEngine, session: str, messages: Sequence[ContextMessage], facts: dict[str, str]
) -> int:
    """Planted facts found by search and expanded back to the exact stored message."""
    stored = {message.message_id: message for message in messages}
    found = 0
    for message_id, key in facts.items():
        hits = engine.search(session, key, limit=3)
        hit = next((h for h in hits if h.kind == "message" and h.id == message_id), None)
        if hit is None:
            continue
        pieces = expand_all(engine, session, hit.summary_id or hit.id)
        if pieces.get(message_id) == stored[message_id].content:
            found += 1
    return found


def expand_all(engine: DagEngine, session: str, target: str) -> dict[str, str]:
    """Every message under ``target``, put together from grant-sized expansions."""
    pieces: dict[str, str] = {}
    after: str | None = None
    offset = 0
    for _ in range(100_000):
        part = engine.expand(session, target, max_tokens=2_000, after=after, offset=offset)
        for index, piece in enumerate(part.messages):
            if index == 0 and part.offset:
                pieces[piece.message_id] += piece.content
            else:
                pieces[piece.message_id] = piece.content
        if part.next_after is None:
            break
        after, offset = part.next_after, part.next_offset
    return pieces


def measure(
    result: Result, label: str, messages: list[ContextMessage], facts: dict[str, str]
) -> None:
    for budget in BUDGETS:
        engine = DagEngine(summarizer=ExtractiveSummarizer(), clock=FakeClock(1_800_000_000.0))
        reports = list(
            simulate(
                messages,
                budget,
                summarizer=engine.summarizer,
                clock=engine.clock,
                profile=PROFILE,
                session_id=label,
                dag=engine,
                timer=time.perf_counter,
            )
        )
        times = [report.elapsed_ms for report in reports]
        tenth = max(1, len(times) // 10)
        stable = [r.prefix_unchanged for r in reports if r.prefix_unchanged is not None]
        name = f"{label}_{budget // 1000}k"
        result.figures[f"{name}_calls"] = len(reports)
        result.figures[f"{name}_max_tokens"] = max(r.tokens for r in reports)
        result.figures[f"{name}_violations"] = sum(len(r.violations) for r in reports)
        result.figures[f"{name}_summaries"] = sum(r.summaries_made for r in reports)
        result.figures[f"{name}_p50_ms"] = statistics.median(times)
        result.figures[f"{name}_p99_ms"] = sorted(times)[int(len(times) * 0.99)]
        result.ratios[f"{name}_max_over_budget"] = max(r.tokens for r in reports) / budget
        result.ratios[f"{name}_prefix_stable"] = sum(stable) / len(stable) if stable else 1.0
        result.ratios[f"{name}_facts_recovered"] = (
            recovered(engine, label, messages, facts) / len(facts) if facts else 1.0
        )
        sizes = [report.messages_in for report in reports]
        time_growth = statistics.median(times[-tenth:]) / max(
            1e-6, statistics.median(times[:tenth])
        )
        size_growth = statistics.mean(sizes[-tenth:]) / max(1.0, statistics.mean(sizes[:tenth]))
        result.ratios[f"{name}_growth_vs_linear"] = time_growth / size_growth
        result.goal(f"{name}_max_over_budget", "<=", 1.0)
        result.goal(f"{name}_violations", "<=", 0)
        result.goal(f"{name}_facts_recovered", ">=", 1.0)
        result.goal(f"{name}_prefix_stable", ">=", 0.95)
        result.goal(f"{name}_p50_ms", "<=", 5.0)
        result.goal(f"{name}_growth_vs_linear", "<=", 1.0)


@benchmark("context")
def run(quick: bool) -> Result:
    with quiet_logs():
        return _run(quick)


def _run(quick: bool) -> Result:
    result = Result("context")
    messages, facts = synthetic(2_000 if quick else 10_000)
    result.figures["synthetic_messages"] = len(messages)
    result.figures["synthetic_tool_share"] = sum(
        1 for m in messages if m.role == "tool" or m.tool_calls
    ) / len(messages)
    measure(result, "synthetic", messages, facts)
    path = tau_path()
    if path is None:
        print(
            "context: tau-bench trajectories not found (set STALWART_TAU_BENCH); skipped",
            file=sys.stderr,
        )
    elif not quick:
        tau, planted = tau_session(path)
        result.figures["tau_messages"] = len(tau)
        measure(result, "tau", tau, planted)
    return result
