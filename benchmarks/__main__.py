"""``python -m benchmarks [NAME ...] [--json] [--quick]``: run benchmarks, print results."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from ._machine import machine
from ._registry import Result, registered


def _number(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"


def render(result: Result) -> str:
    """A readable table of one result."""
    lines = [f"== {result.name}"]
    width = max(
        [len(key) for key in (*result.figures, *result.ratios)]
        + [len(f"{key} {goal.op} {goal.target:g}") for key, goal in result.goals.items()]
        + [10]
    )
    for title, table in (("figures", result.figures), ("ratios", result.ratios)):
        if table:
            lines.append(f"  {title}")
            lines.extend(f"    {key:<{width}}  {_number(v):>12}" for key, v in table.items())
    if result.goals:
        lines.append("  goals")
        for key, goal in result.goals.items():
            label = f"{key} {goal.op} {goal.target:g}"
            verdict = "met" if goal.met else "NOT MET"
            lines.append(f"    {label:<{width}}  {_number(goal.value):>12}  {verdict}")
    described = ", ".join(f"{key}={value}" for key, value in result.machine.items())
    lines.append(f"  machine: {described}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    benchmarks = registered()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure stalwart against the physical limit and peers, in one run.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: all): {', '.join(benchmarks)}",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(benchmarks))
        return 0
    unknown = [name for name in args.names if name not in benchmarks]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(benchmarks)}")
    info = machine(quick=args.quick)
    for name in args.names or list(benchmarks):
        result = benchmarks[name](args.quick)
        result.machine = {**info, **result.machine}
        if args.json:
            print(json.dumps(result.to_json(), allow_nan=False, default=str), flush=True)
        else:
            print(render(result), end="\n\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
