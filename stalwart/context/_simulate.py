"""Running a transcript through an engine call by call, as an agent would.

Before every assistant message of the transcript (a provider call) the engine assembles
the messages so far; the last call sees the whole transcript. A :class:`FakeClock` is
moved to each message's timestamp, so the summarizer's rolling spend windows pass as
they would have. Each call is reported with
what an operator wants to see: tokens against the budget, provider-validity violations
(OpenAI and Anthropic), whether the prefix before the previous call's cache fence came
through unchanged, the layers that fired and the summaries made. Used by ``stalwart
context simulate`` and the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import msgspec

from stalwart.clock import Clock, FakeClock, SystemClock

from ._engine import DagEngine, ModelProfile
from ._repair import validity_violations
from ._types import ContextMessage, Summarizer
from .pipeline import PipelineConfig, PipelineEngine

__all__ = ["MODEL_PROFILES", "CallReport", "call_points", "simulate"]

_WALL = SystemClock()

MODEL_PROFILES: dict[str, ModelProfile] = {
    "caching": ModelProfile(provider="anthropic", caching=True),
    "non-caching": ModelProfile(provider="openai", caching=False),
    "small": ModelProfile(provider="openai", caching=False, small=True),
}


class CallReport(msgspec.Struct, frozen=True, kw_only=True):
    """One provider call of a simulation. ``prefix_unchanged`` is None on the first call
    (and without a fence: a non-caching profile in pipeline mode); ``cache_break`` why
    the pipeline engine shaped again what was behind its fence."""

    call: int
    messages_in: int
    messages_out: int
    tokens: int
    budget: int
    violations: tuple[str, ...]
    prefix_unchanged: bool | None
    fence: int | None
    layers_fired: tuple[str, ...]
    summaries_made: int
    degraded: tuple[str, ...]
    elapsed_ms: float
    assembled: tuple[ContextMessage, ...] = ()
    cache_break: str | None = None


def call_points(messages: Sequence[ContextMessage]) -> list[int]:
    """How many messages each call sees: one call before every assistant message, and
    a last one over the whole transcript."""
    points = [index for index, message in enumerate(messages) if message.role == "assistant"]
    if not points or points[-1] != len(messages):
        points.append(len(messages))
    return [point for point in points if point > 0]


def simulate(
    messages: Sequence[ContextMessage],
    budget: int,
    *,
    summarizer: Summarizer,
    clock: Clock,
    engine: Literal["dag", "pipeline"] = "dag",
    profile: ModelProfile | None = None,
    session_id: str = "simulation",
    dag: DagEngine | None = None,
    timer: Callable[[], float] = _WALL.monotonic,
    pipeline: PipelineConfig | None = None,
    every: bool = False,
) -> Iterator[CallReport]:
    """Reports of every call, in order; the last carries the assembled messages (every
    one does with ``every``). ``timer`` measures each assembly (a real monotonic clock
    by default); ``pipeline`` is the pipeline engine's config (its defaults when None)."""
    profile = profile or MODEL_PROFILES["caching"]
    points = call_points(messages)
    last = len(points) - 1
    if engine == "pipeline":
        runner = PipelineEngine(pipeline or PipelineConfig(), summarizer=summarizer, clock=clock)
        yield from _pipeline(runner, messages, points, budget, clock, profile, timer, every)
        return
    dag = dag or DagEngine(summarizer=summarizer, clock=clock)
    previous: tuple[ContextMessage, ...] | None = None
    previous_fence = 0
    for call, point in enumerate(points):
        _follow(clock, messages[point - 1].ts)
        started = timer()
        result = dag.assemble(session_id, messages[:point], budget, profile=profile)
        elapsed = (timer() - started) * 1000
        unchanged = None
        if previous is not None:
            unchanged = result.messages[:previous_fence] == previous[:previous_fence]
        yield CallReport(
            call=call,
            messages_in=point,
            messages_out=len(result.messages),
            tokens=result.tokens,
            budget=budget,
            violations=tuple(validity_violations(result.messages)),
            prefix_unchanged=unchanged,
            fence=result.fence,
            layers_fired=result.layers_fired,
            summaries_made=len(result.summaries_made),
            degraded=result.degraded,
            elapsed_ms=round(elapsed, 3),
            assembled=result.messages if every or call == last else (),
        )
        previous, previous_fence = result.messages, result.fence


def _follow(clock: Clock, ts: float) -> None:
    """A fake clock keeps up with the transcript's own timestamps (spend windows roll)."""
    if isinstance(clock, FakeClock) and ts > clock.now():
        clock.advance(ts - clock.now())


def _pipeline(
    pipeline: PipelineEngine,
    messages: Sequence[ContextMessage],
    points: list[int],
    budget: int,
    clock: Clock,
    profile: ModelProfile,
    timer: Callable[[], float],
    every: bool,
) -> Iterator[CallReport]:
    previous: tuple[tuple[ContextMessage, ...], int] | None = None  # (messages, fence)
    for call, point in enumerate(points):
        _follow(clock, messages[point - 1].ts)
        started = timer()
        result = pipeline.assemble(
            messages[:point], budget, provider=profile.provider, caching=profile.caching
        )
        elapsed = (timer() - started) * 1000
        unchanged = None
        if previous is not None and profile.caching:
            unchanged = result.messages[: previous[1]] == previous[0][: previous[1]]
        previous = (result.messages, result.fence)
        yield CallReport(
            call=call,
            messages_in=point,
            messages_out=len(result.messages),
            tokens=result.tokens_out,
            budget=budget,
            violations=tuple(validity_violations(result.messages)),
            prefix_unchanged=unchanged,
            fence=result.fence if profile.caching else None,
            layers_fired=result.layers_fired,
            summaries_made=1 if result.compacted else 0,
            degraded=(),
            elapsed_ms=round(elapsed, 3),
            assembled=result.messages if every or call == len(points) - 1 else (),
            cache_break=result.cache_break,
        )
