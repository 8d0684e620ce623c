"""``stalwart status``: sessions by state, their leases, retries, pending requests and
backlog, the dead-letter backlog and provider health; or one session in full.

The text is rendered from the views of :mod:`._views` (the ``--json`` output), so both
always say the same thing. ``stalwart watch`` renders the same overview frame by frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from stalwart._text import escaped
from stalwart.errors import SessionActionError

from ._app import _State, cli
from ._render import fmt_ts, to_json
from ._views import (
    Unreadable,
    fmt_rel,
    fold_all,
    fold_session,
    now_for,
    overview,
    session_detail,
    session_stream,
)

OVERVIEW_COLUMNS = (
    "SESSION",
    "STATUS",
    "QUEUED",
    "LEASE",
    "EXPIRES",
    "RETRY",
    "NEXT RUN",
    "LAST ERROR",
    "OUTCOME",
    "PENDING",
)


# -- text -------------------------------------------------------------------------------------


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Aligned columns, two spaces apart; each cell escaped before it is measured (a
    session id's ESC is shown as the six characters ``\\u001b``, and pushes its column
    as far)."""
    cells = [[escaped(value) for value in row] for row in [columns, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return [
        indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
        for r in cells
    ]


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _lease_cells(lease: dict[str, Any] | None, now: float) -> tuple[str, str]:
    if lease is None:
        return "-", "-"
    expiry = fmt_rel(lease["expires_at"], now)
    return f"{lease['owner']}#{lease['epoch']}", ("expired " if lease["expired"] else "") + expiry


def _pending_cell(pending: dict[str, Any] | None) -> str:
    if pending is None:
        return "-"
    return f"{pending['kind']} {pending['tool']} ({pending['request_id']})"


def _row_cells(row: dict[str, Any], now: float) -> tuple[str, ...]:
    retry, outcome = row["retry"], row["last_outcome"]
    owner, expires = _lease_cells(row["lease"], now)
    return (
        row["session"],
        row["status"],
        str(row["queued"]),
        owner,
        expires,
        "-" if retry["attempt"] is None else f"{retry['attempt']}/{retry['streak']}",
        fmt_rel(retry["next_run_at"], now) if row["queued"] else "-",
        _dash(retry["last_error"]),
        "-" if outcome is None else outcome["status"],
        _pending_cell(row["pending"]),
    )


def sessions_lines(view: dict[str, Any], limit: int | None = None) -> list[str]:
    """The counts line and the sessions table of an overview."""
    now, rows = view["now"], view["sessions"]
    total = sum(view["counts"].values())  # every session (``rows`` may be the first few)
    counts = ", ".join(f"{n} {status}" for status, n in view["counts"].items() if n)
    lines = [f"{total} session{'' if total == 1 else 's'}" + (f": {counts}" if counts else "")]
    if not rows:
        return lines
    shown = rows if limit is None else rows[:limit]
    lines += table(OVERVIEW_COLUMNS, [_row_cells(r, now) for r in shown])
    if len(shown) < total:
        lines.append(f"... and {total - len(shown)} more")
    return lines


def dead_letter_lines(dead: dict[str, Any], now: float, limit: int | None = None) -> list[str]:
    """The dead-letter backlog: a summary line, then each entry (the newest ``limit`` of
    each kind when given)."""
    entries, abandoned = dead["announcements"], dead["activations"]
    total = dead["activations_total"]
    lines = [
        f"dead letters: {len(entries)} undelivered announcement{'' if len(entries) == 1 else 's'}"
        f", {total} abandoned activation{'' if total == 1 else 's'}"
    ]
    shown_entries = entries if limit is None else entries[-limit:]
    lines += [
        f"  announcement {e['entry_id']}  channel {e['channel']}  attempts {e['attempts']}  "
        f"last error {_dash(e['last_error'])}  queued {fmt_rel(e['enqueued_at'], now)}"
        for e in shown_entries
    ]
    shown_abandoned = abandoned if limit is None else abandoned[-limit:]
    lines += [
        f"  activation {a['activation_id']}  {a['session']}  {_dash(a['kind'])}  "
        f"attempts {a['attempts']}  error {a['error_class']}  {fmt_rel(a['at'], now)}"
        for a in shown_abandoned
    ]
    hidden = len(entries) - len(shown_entries) + total - len(shown_abandoned)
    if hidden:
        lines.append(f"  ... and {hidden} older")
    return lines


def provider_lines(providers: list[dict[str, Any]], now: float) -> list[str]:
    if not providers:
        return ["providers: none seen in the log"]
    rows = [
        (
            p["provider"],
            p["health"] + (f" {fmt_rel(p['degraded_at'], now)}" if p["degraded_at"] else ""),
            p["breaker"],
            fmt_rel(p["last_failure_at"], now),
        )
        for p in providers
    ]
    return ["providers:", *table(("PROVIDER", "HEALTH", "BREAKER", "LAST FAILURE"), rows, "  ")]


def overview_lines(
    view: dict[str, Any], limit: int | None = None, dead_limit: int | None = None
) -> list[str]:
    """The overview: at most ``limit`` sessions and ``dead_limit`` dead letters of each
    kind (all when None)."""
    now = view["now"]
    lines = [
        *sessions_lines(view, limit),
        "",
        *dead_letter_lines(view["dead_letters"], now, dead_limit),
        "",
        *provider_lines(view["providers"], now),
    ]
    return [escaped(line) for line in lines]  # recorded values cannot forge a line


def _when(at: float | None, now: float) -> str:
    return "-" if at is None else f"{fmt_rel(at, now)} ({fmt_ts(at)})"


def _under_way_cell(call: dict[str, Any], now: float) -> str:
    attempt = f" attempt {call['attempt']}" if call["attempt"] else ""
    since = _when(call["since"], now)
    return f"{call['kind']} {call['name']}{attempt} (call {call['call_id']}) since {since}"


def detail_lines(view: dict[str, Any]) -> list[str]:
    """One session in full, as text."""
    now = view["now"]
    lines = [
        f"{view['session']}  {view['status']}  agent {view['agent']}  turns {view['turns']}  "
        f"messages {view['messages']}  updated {_when(view['updated_at'], now)}"
    ]
    pending = view["pending"]
    lines.append(
        "pending       -"
        if pending is None
        else f"pending       {pending['kind']} request {pending['request_id']}  "
        f"tool {pending['tool']}  input {pending['input']}"
    )
    calls = [_under_way_cell(call, now) for call in view["under_way"]]
    lines.append("under way     " + ("; ".join(calls) or "-"))
    retry = view["retry"]
    if retry["attempt"] is None:
        lines.append(f"retry         nothing queued  last error {_dash(retry['last_error'])}")
    else:
        lines.append(
            f"retry         attempt {retry['attempt']}  streak {retry['streak']}  "
            f"next run {_when(retry['next_run_at'], now)}  last error {_dash(retry['last_error'])}"
        )
    lease = view["lease"]
    if lease is None:
        lines.append(f"lease         none  (epoch {view['epoch']})")
    else:
        state = "EXPIRED" if lease["expired"] else "live"
        lines.append(
            f"lease         {state}  owner {lease['owner']}  epoch {lease['epoch']}  "
            f"activation {lease['activation_id']}  expires {_when(lease['expires_at'], now)}"
        )
    outcome = view["last_outcome"]
    lines.append(
        "last outcome  -"
        if outcome is None
        else f"last outcome  {outcome['status']}  activation {outcome['activation_id']}  "
        f"{_when(outcome['at'], now)}"
        + (f"  error {outcome['error_class']}" if outcome["error_class"] else "")
    )
    counters = view["counters"]
    lines.append("counters      " + "  ".join(f"{k} {v}" for k, v in counters.items()))
    lines.append("")
    lines += _backlog_lines(view["backlog"], now)
    lines.append("")
    lines += _history_lines(view["history"], now)
    lines.append("")
    lines += _draft_lines(view["drafts"], now)
    lines.append("")
    lines += dead_letter_lines(view["dead_letters"], now)
    return [escaped(line) for line in lines]  # tool input, titles: one line each


def _draft_lines(drafts: list[dict[str, Any]], now: float) -> list[str]:
    if not drafts:
        return ["drafts: none"]
    rows = [
        (
            d["path"],
            d["status"],
            str(d["revision"]),
            str(d["size"]),
            d["content_hash"][:12],
            _when(d["updated_at"], now),
        )
        for d in drafts
    ]
    staged = sum(d["status"] == "staged" for d in drafts)
    return [
        f"drafts: {staged} staged, not committed",
        *table(("PATH", "STATUS", "REV", "BYTES", "SHA256", "UPDATED"), rows, "  "),
    ]


def _backlog_lines(backlog: list[dict[str, Any]], now: float) -> list[str]:
    if not backlog:
        return ["backlog: empty"]
    rows = [
        (
            a["activation_id"],
            a["kind"],
            _when(a["run_at"], now),
            str(a["streak"]),
            _dash(a["last_error"]),
        )
        for a in backlog
    ]
    return [
        f"backlog: {len(backlog)} queued",
        *table(("ACTIVATION", "KIND", "RUN AT", "STREAK", "LAST ERROR"), rows, "  "),
    ]


def _history_lines(history: list[dict[str, Any]], now: float) -> list[str]:
    if not history:
        return ["claims: none"]
    rows = [
        (fmt_ts(c["at"]), c["activation_id"], c["owner"], str(c["epoch"]), c["ended"])
        for c in history
    ]
    return ["claims:", *table(("AT", "ACTIVATION", "OWNER", "EPOCH", "ENDED"), rows, "  ")]


@cli.command()
@click.argument("session", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def status(state: _State, session: str | None, as_json: bool) -> None:
    """Sessions by state with their leases, retries, pending requests and backlog, the
    dead-letter backlog and provider health; or SESSION in full."""
    store = state.store()
    unreadable = Unreadable()  # records passed over: said after the output
    try:
        if session is None:
            folded = fold_all(store, unreadable=unreadable).state()
        else:
            stream = session_stream(session)
            if store.stream_version(stream) == 0:
                raise SessionActionError(
                    f"no session {stream!r} in {store.location}",
                    reason="no_session",
                    session=stream,
                )
            folded, calls = fold_session(store, stream, unreadable)
    finally:
        store.close()
    now = now_for(folded)
    if session is None:
        data = overview(folded, now)
        lines = overview_lines(data)
    else:
        found = folded.find(session_stream(session))
        if found is None:  # every record of the stream was passed over: nothing to show
            unreadable.check()
            raise SessionActionError(
                f"no session {session_stream(session)!r} could be read in {store.location}",
                reason="no_session",
                session=session_stream(session),
            )
        data = session_detail(folded, found, now, calls)
        lines = detail_lines(data)
    state.failed = bool(unreadable.errors)  # exit 1 even if the reader goes away
    if as_json:
        click.echo(to_json(data))
    else:
        for line in lines:
            click.echo(line)
    unreadable.check()
