"""``stalwart incidents``: failures, timeouts and fallbacks per provider and model."""

from __future__ import annotations

import re
from typing import Any

import click

from stalwart._text import escaped
from stalwart.errors import ConfigError
from stalwart.state import (
    IncidentsState,
    ModelIncidents,
    ProviderIncidents,
    latency_percentile,
)
from stalwart.state import incidents as fold_incidents
from stalwart.store import EventStore, read_all_readable

from ._app import _State, cli
from ._render import counted, fmt_ts, to_json
from ._views import Unreadable

EMPTY = "no provider calls in the log"
NO_MATCH = "no provider calls match the filters"
_DURATION = re.compile(r"(\d+)([smhd])")
_TIMESTAMP = re.compile(r"\d+(\.\d+)?")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: digits of a --since count past which it is longer ago than any log (unix 0)
_LONGEST_COUNT = 19
_COLUMNS = (
    "PROVIDER",
    "MODEL",
    "CALLS",
    "FAILURES",
    "RATE",
    "TIMEOUTS",
    "FALLBACKS AWAY",
    "LAST SEEN",
)


def parse_since(text: str, newest: float | None) -> float | None:
    """``30m``, ``2h``, ``1d`` before the newest event in the log, or a unix timestamp.

    The CLI never reads the clock: a relative ``--since`` counts back from the log's own
    newest event, so a log copied from elsewhere reads the same. None for an empty log.
    """
    value = text.strip()
    duration = _DURATION.fullmatch(value)
    if duration is not None:
        seconds = _seconds(duration.group(1), duration.group(2))
        # a span longer than the log's whole past starts at its beginning (unix 0)
        return None if newest is None else max(0.0, newest - min(seconds, max(newest, 0.0)))
    if _TIMESTAMP.fullmatch(value):
        return float(value)
    raise ConfigError(
        f"--since: expected a duration (30m, 2h, 1d) or a unix timestamp, got {text!r}",
        key="--since",
    )


def _seconds(digits: str, unit: str) -> int:
    """How many seconds ``digits`` ``unit`` is. A count of more digits than Python reads
    as a number (4,300) reaches back further than any log, as one of 19 digits already
    does: it is taken as that."""
    digits = digits.lstrip("0") or "0"
    count = int(digits) if len(digits) < _LONGEST_COUNT else 10**_LONGEST_COUNT
    return count * _UNIT_SECONDS[unit]


def _newest_ts(store: EventStore, unreadable: Unreadable) -> float | None:
    """The newest time of a readable record (None for none): a pass over the whole log,
    since log order is not time order across writers (two workers' clocks differ), and
    the record at the head may be one that cannot be read."""
    newest: float | None = None
    for record in read_all_readable(store, unreadable=unreadable):
        if newest is None or record.ts > newest:
            newest = record.ts
    return newest


def _row(model: ModelIncidents, provider: ProviderIncidents | None) -> dict[str, Any]:
    return {
        "provider": model.provider,
        "model": model.model,
        "calls": model.calls,
        "succeeded": model.succeeded,
        "failed": model.failed,
        "failure_rate": round(model.failure_rate, 4),
        "failures_by_class": model.failures,
        "retried": model.retried,
        "timeouts": model.timeout_count,
        "timeouts_by_limit": model.timeouts,
        "fallbacks_away": model.fallbacks_away,
        "fallbacks_to": model.fallbacks_to,
        "fallbacks_exhausted": model.fallbacks_exhausted,
        "breaker_openings": provider.breaker_openings if provider else 0,
        "degraded_episodes": provider.degraded_episodes if provider else 0,
        "first_seen": model.first_seen,
        "last_seen": model.last_seen,
        "latency_p50_ms": latency_percentile(model, 50),
        "latency_p99_ms": latency_percentile(model, 99),
    }


def _worst_first(row: dict[str, Any]) -> tuple[float, int, str, str]:
    rate = row["failed"] / row["calls"] if row["calls"] else 0.0  # unrounded
    return (-rate, -row["failed"], row["provider"], row["model"] or "")


def rows(state: IncidentsState, provider: str | None = None) -> list[dict[str, Any]]:
    """One dict per (provider, model), worst failure rate first, then most failures.

    A provider whose breaker opened or that was degraded, with no model seen in range,
    gets a row of its own with model None.
    """
    providers = {p.provider: p for p in state.providers}
    found = [_row(m, providers.get(m.provider)) for m in state.models]
    with_models = {m.provider for m in state.models}
    found += [
        _row(
            ModelIncidents(
                provider=p.provider, model="", first_seen=p.first_seen, last_seen=p.last_seen
            ),
            p,
        )
        | {"model": None}
        for p in state.providers
        if p.provider not in with_models
    ]
    if provider is not None:
        found = [row for row in found if row["provider"] == provider]
    found.sort(key=_worst_first)
    return found


def _header(state: IncidentsState, shown: list[dict[str, Any]]) -> str:
    calls = sum(r["calls"] for r in shown)
    failed = sum(r["failed"] for r in shown)
    retried = sum(r["retried"] for r in shown)
    timeouts = sum(r["timeouts"] for r in shown)
    models = sum(1 for r in shown if r["model"] is not None)
    text = f"{counted(calls, 'call')}, {failed} failed"
    if retried:
        text += f" ({counted(retried, 'failed attempt')} retried)"
    text += f", {counted(timeouts, 'timeout')} across {counted(models, 'model')}"
    if state.since is not None:
        text += f" since {fmt_ts(state.since)}"
    if state.unmatched_timeouts:
        text += f" ({counted(state.unmatched_timeouts, 'timeout')} not matched to a call)"
    return text


def table(state: IncidentsState, shown: list[dict[str, Any]]) -> list[str]:
    """The header line, the column names and one aligned line per row."""
    cells = [
        (
            escaped(r["provider"]),
            "-" if r["model"] is None else escaped(r["model"]),
            str(r["calls"]),
            str(r["failed"]),
            f"{r['failure_rate'] * 100:.1f}%",
            str(r["timeouts"]),
            str(r["fallbacks_away"]),
            "-" if r["last_seen"] is None else fmt_ts(r["last_seen"]),
        )
        for r in shown
    ]
    widths = [max(len(c[i]) for c in [_COLUMNS, *cells]) for i in range(len(_COLUMNS))]
    left = {0, 1, 7}  # text columns; numbers align right

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(
            v.ljust(w) if i in left else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    return [_header(state, shown), line(_COLUMNS), *(line(c) for c in cells)]


@cli.command()
@click.option(
    "--since",
    metavar="DURATION|TIMESTAMP",
    help="Only what happened in the last 30m, 2h, 1d before the newest event in the log, "
    "or since a unix timestamp.",
)
@click.option("--provider", metavar="NAME", help="Only this provider's models.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per (provider, model).")
@click.pass_obj
def incidents(state: _State, since: str | None, provider: str | None, as_json: bool) -> None:
    """Failures, timeouts and fallbacks per provider and model, worst first."""
    store = state.store()
    unreadable = Unreadable()  # records passed over: said after the table
    try:
        empty = store.head() == 0
        start = None
        if since is not None:  # a duration counts back from the newest time in the log
            relative = _DURATION.fullmatch(since.strip()) is not None
            start = parse_since(since, _newest_ts(store, unreadable) if relative else None)
        folded = fold_incidents(read_all_readable(store, unreadable=unreadable), since=start)
    finally:
        store.close()
    shown = rows(folded, provider)
    if as_json:
        for row in shown:
            click.echo(to_json(row))
    elif not shown:
        unfiltered = since is None and provider is None
        click.echo(EMPTY if unfiltered or empty else NO_MATCH)
    else:
        for text in table(folded, shown):
            click.echo(text)
    unreadable.check()
