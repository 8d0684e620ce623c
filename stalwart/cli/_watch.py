"""Live views: ``stalwart activations`` (the activation lifecycle across sessions, one
line per event, optionally followed) and ``stalwart watch`` (the orchestrator overview,
redrawn in place).

Both keep one :class:`~stalwart.state.OrchestratorFolder` or one subscription and fold
only what was appended since the last look. ``watch`` overwrites its frame in place with
ANSI cursor-home and erase on a terminal, and prints frames one after another otherwise
(no dependency beyond click is needed for that).
"""

from __future__ import annotations

import shutil
import sys
import threading
import unicodedata
from collections.abc import Iterable
from typing import Any

import click

from stalwart._text import escaped
from stalwart.clock import SystemClock
from stalwart.errors import SessionActionError, StoreUnavailableError
from stalwart.events import (
    ActivationAbandoned,
    ActivationAcked,
    ActivationBlocked,
    ActivationCancelled,
    ActivationLeased,
    ActivationLeaseLost,
    ActivationReady,
    ActivationRequeued,
    LeaseExpired,
    LeaseRenewed,
    RecordedEvent,
)
from stalwart.state import OrchestratorFolder

from ._app import Seconds, _State, cli
from ._render import fmt_ts, to_json
from ._status import overview_lines
from ._views import Unreadable, fold_all, now_for, overview, session_stream

#: dead letters of each kind a frame lists (the newest; the rest are counted)
DEAD_LETTERS_SHOWN = 5
_HOME = "\x1b[H"  # cursor to the top left
_CLEAR_LINE = "\x1b[K"  # the rest of the line
_CLEAR_BELOW = "\x1b[J"  # the rest of the screen

_LIFECYCLE = (
    ActivationReady,
    ActivationLeased,
    LeaseRenewed,
    ActivationAcked,
    ActivationRequeued,
    ActivationBlocked,
    ActivationAbandoned,
    ActivationCancelled,
    ActivationLeaseLost,
    LeaseExpired,
)
LifecycleEvent = (
    ActivationReady
    | ActivationLeased
    | LeaseRenewed
    | ActivationAcked
    | ActivationRequeued
    | ActivationBlocked
    | ActivationAbandoned
    | ActivationCancelled
    | ActivationLeaseLost
    | LeaseExpired
)


def lifecycle(record: RecordedEvent) -> dict[str, Any] | None:
    """One activation lifecycle event as the keys ``activations --json`` prints (None for
    any other event): position, ts, session, activation_id, what, owner, epoch, delay_ms,
    streak, error_class and ``detail`` (what else the event says)."""
    event = record.event
    if not isinstance(event, _LIFECYCLE):
        return None
    row: dict[str, Any] = {
        "position": record.position,
        "ts": record.ts,
        "session": record.stream,
        "activation_id": event.activation_id,
        "what": record.type.split(":", 1)[1] if record.type.startswith("activation:") else "",
        "owner": None,
        "epoch": getattr(event, "epoch", None),
        "delay_ms": None,
        "streak": None,
        "error_class": None,
        "detail": {},
    }
    _describe(event, row)
    return row


def _describe(event: LifecycleEvent, row: dict[str, Any]) -> None:
    detail: dict[str, Any] = row["detail"]
    match event:
        case ActivationReady():
            detail.update(kind=event.kind, wake_at=event.wake_at, dedupe_key=event.dedupe_key)
        case ActivationLeased():
            row["owner"] = event.owner
            detail.update(expires_at=event.expires_at, covers=len(event.covers))
        case LeaseRenewed():
            row.update(what="renewed", owner=event.owner)
            detail.update(expires_at=event.expires_at)
        case ActivationAcked():
            detail.update(outcome=event.outcome)
        case ActivationRequeued():
            row.update(delay_ms=event.delay_ms, streak=event.streak, error_class=event.error_class)
            detail.update(run_at=event.run_at, jitter_ms=event.jitter_ms)
        case ActivationBlocked():
            detail.update(request_id=event.request_id)
        case ActivationAbandoned():
            row.update(streak=event.attempts, error_class=event.error_class)
            detail.update(retryable=event.retryable, max_attempts=event.max_attempts)
        case ActivationCancelled():
            detail.update(reason=event.reason)
        case ActivationLeaseLost():
            row["owner"] = event.owner
            detail.update(current_epoch=event.current_epoch)
        case LeaseExpired():
            row.update(what="lease_expired", owner=event.owner, streak=event.streak)
            row["error_class"] = "lease_expired"
            detail.update(expired_at=event.expired_at)
    row["detail"] = {k: v for k, v in detail.items() if v is not None}


def lifecycle_line(row: dict[str, Any]) -> str:
    """time, session, activation, what, owner#epoch, then delay/streak/error and detail."""
    owner = row["owner"] or ""
    epoch = row["epoch"]
    holder = f"{owner}#{epoch}" if epoch is not None else owner
    parts = [fmt_ts(row["ts"]), row["session"], row["activation_id"], row["what"]]
    parts.append(holder or "-")
    if row["delay_ms"] is not None:
        parts.append(f"delay={row['delay_ms']}ms")
    if row["streak"] is not None:
        parts.append(f"streak={row['streak']}")
    if row["error_class"] is not None:
        parts.append(f"error={row['error_class']}")
    for key, value in row["detail"].items():
        shown = fmt_ts(value) if key.endswith("_at") and isinstance(value, float) else value
        parts.append(f"{key}={shown}")
    # ids and values come from the log (a stream id, a dedupe key may hold anything)
    return "  ".join(escaped(str(p)) for p in parts)


@cli.command()
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C.")
@click.option("--session", "session_id", metavar="SESSION", help="Only this session's.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def activations(state: _State, follow: bool, session_id: str | None, as_json: bool) -> None:
    """The activation lifecycle across sessions (ready, leased, renewed, acked, requeued,
    blocked, abandoned, cancelled, lease lost, lease expired), one line each."""
    wanted = None if session_id is None else session_stream(session_id)
    store = state.store()
    try:
        if wanted is not None and not follow and store.stream_version(wanted) == 0:
            raise SessionActionError(
                f"no session {wanted!r} in {store.location}", reason="no_session", session=wanted
            )
        subscription = None
        try:  # Ctrl-C ends it normally
            if wanted is None:
                if not follow:
                    _print_lifecycle(store.read_all(), None, as_json)
                    return
                subscription = store.subscribe(1)
                _print_lifecycle(subscription, None, as_json)
                return
            # one session's: its own stream (not the whole log), then what comes
            head = store.head()
            history = (r for r in store.read_stream(wanted) if r.position <= head)
            _print_lifecycle(history, wanted, as_json)
            if follow:
                subscription = store.subscribe(head + 1)
                _print_lifecycle(subscription, wanted, as_json)
        except KeyboardInterrupt:
            pass
        finally:
            if subscription is not None:
                subscription.close()
    finally:
        store.close()


def _print_lifecycle(records: Iterable[RecordedEvent], wanted: str | None, as_json: bool) -> None:
    for record in records:
        row = lifecycle(record)
        if row is None or (wanted is not None and row["session"] != wanted):
            continue
        click.echo(to_json(row) if as_json else lifecycle_line(row))
        sys.stdout.flush()


def frame(
    folder: OrchestratorFolder,
    location: str,
    rows: int | None,
    height: int | None = None,
    lost_at: float | None = None,
) -> list[str]:
    """One frame of ``watch``: a header and the ``status`` overview, with at most ``rows``
    sessions (all when None). With a ``height`` (a terminal redrawn in place), at most
    that many lines: at most the sessions that leave room for the rest of the frame (at
    least three, ``rows`` or fewer), and a frame still too tall (a tiny terminal, many
    providers) loses its bottom lines rather than scroll the terminal on every redraw.
    ``lost_at``: the store has not answered since then (the frame is what was read
    before)."""
    state = folder.state()
    now = now_for(state)
    # no more rows are made than a frame can show (a store may hold 20,000 sessions)
    view = overview(state, now, min((n for n in (rows, height) if n is not None), default=None))
    header = f"stalwart watch  {location}  {fmt_ts(now)}  position {state.position}"
    # on a line of its own: a narrow terminal cuts the header's end (a long location)
    lost = "" if lost_at is None else f"STORE UNREACHABLE since {fmt_ts(lost_at)}: retrying"
    head = [header, lost]
    lines = head + overview_lines(view, rows, DEAD_LETTERS_SHOWN)
    if height is None or len(lines) <= height:
        return lines
    listed, sessions = len(view["sessions"]), sum(view["counts"].values())
    more = 1 if listed == sessions else 0  # the line "... and N more" comes in
    fits = listed - (len(lines) - height) - more
    lines = head + overview_lines(view, max(min(3, sessions), fits), DEAD_LETTERS_SHOWN)
    return lines[:height]


@cli.command()
@click.option(
    "--interval",
    type=Seconds(min=0.1, max=86_400.0),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Time between redraws.",
)
@click.option("--once", is_flag=True, help="Draw one frame and exit.")
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="At most N sessions (default: what fits the terminal).",
)
@click.pass_obj
def watch(state: _State, interval: float, once: bool, rows: int | None) -> None:
    """A live view of the orchestrator: sessions, leases, backlog, dead letters and
    provider health, redrawn in place until Ctrl-C."""
    store = state.store()
    live = sys.stdout.isatty() and not once
    stop = threading.Event()
    unreadable = Unreadable()  # records passed over: said once the view stops
    lost_at: float | None = None  # the store stopped answering then (an outage)
    try:
        folder = fold_all(store, unreadable=unreadable)
        while True:
            size = shutil.get_terminal_size() if live else None
            height = None if size is None else max(1, size.lines - 1)  # the cursor ends below
            lines = frame(folder, store.location, rows, height, lost_at)
            state.failed = bool(unreadable.errors)  # exit 1 even if the reader goes away
            if size is not None:  # overwrite in place, line by line: no flicker of a clear
                lines = [clipped(line, size.columns, _more()) for line in lines]
                click.echo(_HOME + "".join(f"{line}{_CLEAR_LINE}\n" for line in lines), nl=False)
                click.echo(_CLEAR_BELOW, nl=False)
            else:
                click.echo("\n".join(lines) + ("" if once else "\n"))
            sys.stdout.flush()
            if once or stop.wait(interval):
                break
            try:  # the records read before a failure are folded: the next read goes on
                fold_all(store, folder, unreadable)
                lost_at = None
            except StoreUnavailableError:  # an outage is waited out, as tail --follow does
                lost_at = lost_at if lost_at is not None else _REAL_TIME.now()
    except KeyboardInterrupt:
        pass
    finally:
        store.close()
    unreadable.check()


_REAL_TIME = SystemClock()  # when an outage began, shown as it is waited out


def clipped(line: str, columns: int, more: str = "…") -> str:
    """``line`` cut to fit a terminal ``columns`` wide with one column to spare, ending in
    ``more`` (one column) when cut: a line that wrapped would take two of the frame's
    lines, and a frame taller than the terminal scrolls it on every redraw. A wide
    character (CJK) takes two columns, a combining one none."""
    room = max(1, columns - 1)
    widths = [_width(char) for char in line]
    if sum(widths) <= room:
        return line
    used = 0
    for at, width in enumerate(widths):
        if used + width > room - 1:  # the rest, and ``more``, would not fit
            return line[:at] + more
        used += width
    return line


def _more() -> str:
    """``…``, or ``~`` on a terminal whose encoding has no ``…`` (it would be written as
    the six characters ``\\u2026``, and wrap the line it ends)."""
    try:
        "…".encode(sys.stdout.encoding or "ascii")
    except (LookupError, UnicodeEncodeError):
        return "~"
    return "…"


def _width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
