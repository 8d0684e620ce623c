"""The benchmark registry and the result every benchmark returns.

Adding an area (for example ``benchmarks/providers.py``) takes two steps:

1. In the new module, register one function per benchmark::

       from benchmarks._registry import Result, benchmark

       @benchmark("providers")
       def run(quick: bool) -> Result:
           result = Result("providers")
           result.figures["stream_chunks_per_s"] = ...      # what was measured
           result.figures["peer_chunks_per_s"] = ...        # the limit or peer, same run
           result.ratios["vs_peer"] = ...                   # ours / theirs
           result.goal("vs_peer", ">=", 0.8)                # a goal on a ratio or figure
           return result

2. Add the module's import path to :data:`MODULES` below (the one line to change).

``run`` gets ``quick=True`` for the test suite's smoke run: shrink sizes so every
benchmark together finishes in well under a minute. The runner fills ``machine``.
Scratch files belong in :func:`benchmarks._machine.scratch` (a real disk, not tmpfs).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

#: Every module that registers benchmarks, in the order the runner runs them.
MODULES: tuple[str, ...] = (
    "benchmarks.store",
    "benchmarks.providers",
    "benchmarks.supervision",
    "benchmarks.activations",
    "benchmarks.postgres",
    "benchmarks.workers",
    "benchmarks.context",
    "benchmarks.context_pipeline",
    "benchmarks.context_store",
    "benchmarks.long_session",
    "benchmarks.ledger",
    "benchmarks.verify",
    "benchmarks.watch",
    "benchmarks.tools",
)

Op = Literal[">=", "<="]
Runner = Callable[[bool], "Result"]

_REGISTRY: dict[str, Runner] = {}


@dataclass(frozen=True)
class Goal:
    """A target on one of the result's ratios or figures, e.g. ``vs_raw_lmdb_n8 >= 0.6``."""

    op: Op
    target: float
    value: float

    @property
    def met(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.target if self.op == ">=" else self.value <= self.target

    def to_json(self) -> dict[str, Any]:
        value = None if math.isnan(self.value) else self.value
        return {"op": self.op, "target": self.target, "value": value, "met": self.met}


@dataclass
class Result:
    """What one benchmark measured: ``figures`` (rates, latencies, sizes; the key names the
    unit: ``_per_s``, ``_ms``, ``_bytes``), ``ratios`` against the limit or a peer measured
    in the same run, ``goals`` on those, and the ``machine`` it ran on."""

    name: str
    figures: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    goals: dict[str, Goal] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def goal(self, key: str, op: Op, target: float) -> Goal:
        """Set a goal on the ratio (or, failing that, the figure) named ``key``."""
        value = self.ratios.get(key, self.figures.get(key, math.nan))
        made = Goal(op, target, value)
        self.goals[key] = made
        return made

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "figures": _finite(self.figures),
            "ratios": _finite(self.ratios),
            "goals": {key: goal.to_json() for key, goal in self.goals.items()},
            "machine": self.machine,
        }


def _finite(table: dict[str, float]) -> dict[str, float | None]:
    """NaN (nothing measured) as JSON null."""
    return {key: None if math.isnan(value) else value for key, value in table.items()}


def benchmark(name: str) -> Callable[[Runner], Runner]:
    """Register ``run(quick: bool) -> Result`` under ``name`` (unique across modules)."""

    def register(run: Runner) -> Runner:
        if name in _REGISTRY and _REGISTRY[name] is not run:
            raise ValueError(f"benchmark {name!r} is registered twice")
        _REGISTRY[name] = run
        return run

    return register


def registered() -> dict[str, Runner]:
    """Every benchmark of every module in :data:`MODULES`, in registration order."""
    for module in MODULES:
        importlib.import_module(module)
    return dict(_REGISTRY)


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``, NaN when the peer measured nothing."""
    return ours / theirs if theirs > 0 else math.nan
