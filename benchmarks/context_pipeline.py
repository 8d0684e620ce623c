"""The pipeline context engine's cache fence: what a prompt cache can serve, and what it costs.

The pipeline engine assembles before every assistant message of a long session (as an
agent calls its provider) on a caching profile, twice in the same run: with the cache
fence (the default, ``cache_fence_turns`` 5) and without it (``cache_fence_turns`` 0,
the engine as it was before the fence, and as it runs for a non-caching provider).
Sessions: the synthetic one of the ``context`` benchmark (10,000 messages, 600 with
``--quick``) and, when the file is there, the tau-bench airline trajectories as one
session; budgets 8k (compaction at work) and 32k (the history window binds first:
larger budgets give the same figures).

A prompt cache serves a request's longest prefix that an earlier request sent (the
request marks its last message ``cache_control``, so the whole previous request was
written). Per call, the *cached* tokens are those of the longest run of leading messages
equal to the previous call's. The cost is in Anthropic's list-price units: a cache read
0.1, a cache write (everything not read) 1.25, an uncached input token 1.0. Figures:

- ``cached_share``: cached tokens over all tokens sent;
- ``cost_vs_no_fence``: the fence's cost over the cost without it (goal <= 0.5 at 32k,
  where the window binds; at 8k, where the threshold does, reported only);
- ``cost_vs_ideal``: the fence's cost over the *ideal* for the same request sizes, where
  every request extends the previous one (the physical limit of a prefix cache; 1.0);
- ``tokens_vs_no_fence``: the tokens the fence sends over those sent without it (what
  holding the messages behind it costs in window: it keeps up to 5 more turns);
- ``prefix_stable``: calls where the prefix before the previous call's fence came through
  unchanged (the rest are recorded cache breaks);
- ``max_vs_limit``: the largest request over the budget, or over the largest request
  without the fence when that was already over it (a newest turn bigger than the
  budget): the fence never makes a request bigger than that (<= 1); provider-validity
  violations (0); p50 per call.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks._machine import quiet_logs
from benchmarks._registry import Result, benchmark
from benchmarks.context import synthetic, tau_path, tau_session
from stalwart.clock import FakeClock
from stalwart.context import ContextMessage, ExtractiveSummarizer, ModelProfile, TokenEstimator
from stalwart.context._simulate import simulate
from stalwart.context.pipeline import PipelineConfig

BUDGETS = (8_000, 32_000)
READ, WRITE = 0.1, 1.25


@dataclass
class Run:
    calls: int = 0
    tokens: int = 0
    cached: int = 0
    cost: float = 0.0
    ideal: float = 0.0
    checked: int = 0
    stable: int = 0
    breaks: int = 0
    violations: int = 0
    max_tokens: int = 0
    times_ms: list[float] = field(default_factory=list)


def _common(previous: Sequence[ContextMessage], current: Sequence[ContextMessage]) -> int:
    count = 0
    for old, new in zip(previous, current, strict=False):
        if old != new:
            break
        count += 1
    return count


def drive(messages: list[ContextMessage], budget: int, fence_turns: int) -> Run:
    """One engine over the session, call by call; what a prefix cache would serve."""
    estimator = TokenEstimator("anthropic")  # the engine's own, never calibrated here
    run = Run()
    previous: tuple[ContextMessage, ...] = ()
    previous_tokens = 0
    # id(message) -> (message, tokens); holding the message keeps its id from being reused
    sizes: dict[int, tuple[ContextMessage, int]] = {}

    def size(message: ContextMessage) -> int:
        found = sizes.get(id(message))
        if found is None:
            found = sizes[id(message)] = (message, estimator.message(message))
        return found[1]

    for report in simulate(
        messages,
        budget,
        summarizer=ExtractiveSummarizer(),
        clock=FakeClock(1_800_000_000.0),
        engine="pipeline",
        profile=ModelProfile(provider="anthropic", caching=True),
        timer=time.perf_counter,
        pipeline=PipelineConfig(cache_fence_turns=fence_turns),
        every=True,
    ):
        current = report.assembled
        total = sum(size(m) for m in current)
        cached = sum(size(m) for m in current[: _common(previous, current)])
        run.calls += 1
        run.times_ms.append(report.elapsed_ms)
        run.tokens += total
        run.cached += cached
        run.cost += READ * cached + WRITE * (total - cached)
        shared = min(previous_tokens, total)
        run.ideal += READ * shared + WRITE * (total - shared)
        if report.prefix_unchanged is not None:
            run.checked += 1
            run.stable += report.prefix_unchanged
        run.breaks += report.cache_break is not None and report.call > 0
        run.violations += len(report.violations)
        run.max_tokens = max(run.max_tokens, report.tokens)
        previous, previous_tokens = current, total
        if len(sizes) > 200_000:
            sizes = {id(m): (m, size(m)) for m in current}
    return run


def measure(result: Result, label: str, messages: list[ContextMessage]) -> None:
    for budget in BUDGETS:
        name = f"{label}_{budget // 1000}k"
        fenced = drive(messages, budget, PipelineConfig().cache_fence_turns)
        plain = drive(messages, budget, 0)
        result.figures[f"{name}_calls"] = fenced.calls
        result.figures[f"{name}_cache_breaks"] = fenced.breaks
        result.figures[f"{name}_p50_ms"] = statistics.median(fenced.times_ms)
        result.figures[f"{name}_no_fence_p50_ms"] = statistics.median(plain.times_ms)
        result.figures[f"{name}_violations"] = fenced.violations
        result.ratios[f"{name}_cached_share"] = fenced.cached / fenced.tokens
        result.ratios[f"{name}_no_fence_cached_share"] = plain.cached / plain.tokens
        result.ratios[f"{name}_cost_vs_no_fence"] = fenced.cost / plain.cost
        result.ratios[f"{name}_cost_vs_ideal"] = fenced.cost / fenced.ideal
        result.ratios[f"{name}_tokens_vs_no_fence"] = fenced.tokens / plain.tokens
        result.ratios[f"{name}_prefix_stable"] = (
            fenced.stable / fenced.checked if fenced.checked else 1.0
        )
        result.ratios[f"{name}_max_vs_limit"] = fenced.max_tokens / max(budget, plain.max_tokens)
        if budget >= 32_000:
            result.goal(f"{name}_cost_vs_no_fence", "<=", 0.5)
        result.goal(f"{name}_max_vs_limit", "<=", 1.0)
        result.goal(f"{name}_violations", "<=", 0)


@benchmark("context_pipeline")
def run(quick: bool) -> Result:
    with quiet_logs():
        result = Result("context_pipeline")
        messages, _ = synthetic(600 if quick else 10_000)
        result.figures["synthetic_messages"] = len(messages)
        measure(result, "synthetic", messages)
        path = tau_path()
        if path is None:
            print(
                "context_pipeline: tau-bench trajectories not found (set STALWART_TAU_BENCH);"
                " skipped",
                file=sys.stderr,
            )
        elif not quick:
            tau, _ = tau_session(path, facts=0)
            result.figures["tau_messages"] = len(tau)
            measure(result, "tau", tau)
        return result
