"""``stalwart incidents``: failures, timeouts and fallbacks per provider and model."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import click

from stalwart._text import escaped
from stalwart.errors import ConfigError
from stalwart.events import RecordedEvent
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
#: the records at the log's end whose newest time a --since duration counts back from,
#: checked by the one pass over the log (a record further back may be newer)
_TAIL = 256
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


def parse_span(text: str) -> int | None:
    """The seconds of a ``--since`` duration (``30m``, ``2h``, ``1d``: before the newest
    event in the log, never before "now": the CLI does not read the clock, so a log copied
    from elsewhere reads the same), None for a unix timestamp; ConfigError otherwise."""
    value = text.strip()
    duration = _DURATION.fullmatch(value)
    if duration is not None:
        return _seconds(duration.group(1), duration.group(2))
    if _TIMESTAMP.fullmatch(value):
        return None
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


def _span_start(newest: float, span: float) -> float:
    """The start of the last ``span`` seconds before ``newest``: never before unix 0 (a
    span longer than the log's whole past starts at its beginning)."""
    return max(0.0, newest - min(span, max(newest, 0.0)))


class _Newest:
    """The newest time among the records that went through :meth:`of` (None for none)."""

    def __init__(self) -> None:
        self.ts: float | None = None

    def of(self, records: Iterable[RecordedEvent]) -> Iterator[RecordedEvent]:
        for record in records:
            if self.ts is None or record.ts > self.ts:
                self.ts = record.ts
            yield record


def _fold(
    store: EventStore, head: int, since: str | None, unreadable: Unreadable
) -> IncidentsState:
    """The incidents of the readable log up to ``head``, from ``--since`` on."""
    if since is None:
        return fold_incidents(read_all_readable(store, 1, head, unreadable=unreadable))
    span = parse_span(since)
    if span is None:
        start = float(since.strip())
        return fold_incidents(read_all_readable(store, 1, head, unreadable=unreadable), since=start)
    return _fold_span(store, head, span, unreadable)


def _fold_span(store: EventStore, head: int, span: int, unreadable: Unreadable) -> IncidentsState:
    """The incidents of the last ``span`` seconds before the newest time in the log, in
    one pass: the newest time is taken to be that of the log's last records, which the
    pass checks. A record further back that is newer (workers' clocks differ), or last
    records that cannot be read, cost a second pass from the newest time found."""
    tail = read_all_readable(store, max(1, head - _TAIL + 1), head, unreadable=unreadable)
    guess = max((record.ts for record in tail), default=None)
    newest = _Newest()
    records = newest.of(read_all_readable(store, 1, head, unreadable=unreadable))
    folded = fold_incidents(records, since=None if guess is None else _span_start(guess, span))
    if newest.ts == guess:
        return folded
    start = None if newest.ts is None else _span_start(newest.ts, span)
    return fold_incidents(read_all_readable(store, 1, head, unreadable=unreadable), since=start)


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
        head = store.head()  # what is appended meanwhile is left for the next look
        folded = _fold(store, head, since, unreadable)
    finally:
        store.close()
    state.failed = bool(unreadable.errors)  # exit 1 even if the reader goes away
    shown = rows(folded, provider)
    if as_json:
        for row in shown:
            click.echo(to_json(row))
    elif not shown:
        unfiltered = since is None and provider is None
        click.echo(EMPTY if unfiltered or head == 0 else NO_MATCH)
    else:
        for text in table(folded, shown):
            click.echo(text)
    unreadable.check()
