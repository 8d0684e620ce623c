"""The ``stalwart`` command: thin click commands over the public API."""

from __future__ import annotations

import fnmatch
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import click
from click.core import ParameterSource

from stalwart import __version__
from stalwart._text import escaped
from stalwart.config import Config
from stalwart.errors import StalwartError, StoreError
from stalwart.events import RecordedEvent
from stalwart.state import aggregate_for
from stalwart.store import EventStore, load_state, open_configured
from stalwart.store import open as open_store

from . import _replay
from ._logging import configure_logging
from ._render import event_json, event_line, fmt_ts, state_lines, to_json

DEFAULT_STORE = "./.stalwart"


#: the highest global position a store can hold (an unsigned 64-bit integer)
LAST_POSITION = 2**64 - 1
#: the longest --grace-ms (some 285,000 years): it is added to times, which are floats
MAX_GRACE_MS = 2**53


class Seconds(click.FloatRange):
    """A finite number of seconds, ``min`` or more and at most ``max`` (by default the
    longest a thread can wait): click's ``FloatRange`` lets NaN through (every comparison
    with it is false), and an option that reaches ``Event.wait`` must be a real wait."""

    name = "seconds"

    def __init__(self, min: float, max: float = threading.TIMEOUT_MAX) -> None:
        super().__init__(min=min, max=max)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


def _reader_gone() -> None:
    """The reader of the output went away: what is left to print (and what Python would
    flush at exit) goes nowhere, quietly."""
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115


class _Group(click.Group):
    """Turns every stalwart error into one line on stderr and exit code 1."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except BrokenPipeError:
            # `stalwart --help | head -1` (or --version): the reader had what it wanted;
            # click would exit 1 for it
            _reader_gone()
            ctx.exit(0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StalwartError as exc:
            # its text may quote a config file's names or a log's ids: one line, escaped
            click.echo(f"stalwart: error: {escaped(str(exc))}", err=True)
            ctx.exit(1)
        except BrokenPipeError:
            # the reader went away (``stalwart tail | head``): that is not an error, but a
            # verdict reached before it (``replay --verify`` found the log not clean) stands
            _reader_gone()
            ctx.exit(1 if isinstance(ctx.obj, _State) and ctx.obj.failed else 0)


class _State:
    def __init__(self, location: str | None) -> None:
        self.location = location
        #: the command's verdict is "not clean" (exit 1), whatever happens to its output
        self.failed = False

    def store(self) -> EventStore:
        """The store named by --store, opened read-only: it must exist, and a read
        command writes nothing (no upgrade either), so a read-only mount can be read."""
        return open_store(self.location or DEFAULT_STORE, create=False, read_only=True)

    def store_to_write(self) -> EventStore:
        """The store named by --store, for a command that records something; it must
        exist (an operator's command never creates one)."""
        return open_store(self.location or DEFAULT_STORE, create=False)

    def store_for(self, config: Config, *, create: bool) -> EventStore:
        """--store (or STALWART_STORE) when given, else the config's store location."""
        return open_configured(config.store, self.location, create=create)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    "location",
    envvar="STALWART_STORE",
    default=None,
    help="The event store: a directory (LMDB) or a postgresql:// URL (env STALWART_STORE; "
    "default ./.stalwart, or the config's store.location for commands that take --config).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="warning",
    show_default=True,
    help="Diagnostics on stderr at this level and above.",
)
@click.version_option(__version__, prog_name="stalwart")
@click.pass_context
def cli(ctx: click.Context, location: str | None, log_level: str) -> None:
    """stalwart keeps long-running LLM agents from going quietly stuck.

    Every fact and decision is an event in one durable log; these commands show it.
    """
    configure_logging(log_level)
    ctx.obj = _State(location)


def _matcher(pattern: str | None) -> Callable[[str], bool]:
    if not pattern:
        return lambda _: True
    return re.compile(fnmatch.translate(pattern)).match  # type: ignore[return-value]


def _print_events(
    records: Iterable[RecordedEvent], as_json: bool, keep: Callable[[RecordedEvent], bool]
) -> None:
    render = event_json if as_json else event_line
    for record in records:
        if keep(record):
            click.echo(render(record))
            sys.stdout.flush()


@cli.command()
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events until Ctrl-C.")
@click.option("--stream", "stream_glob", metavar="GLOB", help="Only streams matching GLOB.")
@click.option("--type", "type_glob", metavar="GLOB", help="Only event types matching GLOB.")
@click.option(
    "--since",
    type=click.IntRange(min=0, max=LAST_POSITION - 1),  # positions are u64
    default=0,
    metavar="POSITION",
    help="Only events after POSITION (0: from the start).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def tail(
    state: _State,
    follow: bool,
    stream_glob: str | None,
    type_glob: str | None,
    since: int,
    as_json: bool,
) -> None:
    """Print the event log, optionally following it live."""
    stream_ok, type_ok = _matcher(stream_glob), _matcher(type_glob)

    def keep(record: RecordedEvent) -> bool:
        return bool(stream_ok(record.stream)) and bool(type_ok(record.type))

    store = state.store()
    try:
        if not follow:
            _print_events(store.read_all(since + 1), as_json, keep)
            return
        subscription = store.subscribe(since + 1)
        try:
            _print_events(subscription, as_json, keep)
        except KeyboardInterrupt:
            subscription.close()
    finally:
        store.close()


@cli.command()
@click.argument("stream", required=False)
@click.option(
    "--until",
    type=click.IntRange(min=1, max=LAST_POSITION),
    metavar="POSITION",
    help="The state as it was at global POSITION (time travel); with --verify, verify up to it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the state (or report) as JSON.")
@click.option("--no-snapshots", is_flag=True, help="Fold every event; ignore saved snapshots.")
@click.option(
    "--verify", is_flag=True, help="Re-derive every decision; exit 1 unless the log is clean."
)
@click.option("--all", "every", is_flag=True, help="With --verify: every stream, in log order.")
@click.option(
    "--grace-ms",
    type=click.IntRange(min=0, max=MAX_GRACE_MS),
    default=5_000,
    show_default=True,
    help="With --verify: how late past a deadline an event may come before it proves a miss.",
)
@click.pass_context
def replay(
    ctx: click.Context,
    stream: str | None,
    until: int | None,
    as_json: bool,
    no_snapshots: bool,
    verify: bool,
    every: bool,
    grace_ms: int,
) -> None:
    """Fold STREAM's events and print the resulting state; or, with --verify, check that
    every decision in STREAM (or --all streams) follows from the state just before it."""
    if every and not verify:
        raise click.UsageError("--all goes with --verify")
    if not verify and ctx.get_parameter_source("grace_ms") is not ParameterSource.DEFAULT:
        raise click.UsageError("--grace-ms goes with --verify")
    if verify and no_snapshots:
        raise click.UsageError("--no-snapshots does not go with --verify (it folds every event)")
    if (stream is None) != every:
        raise click.UsageError(
            "give a STREAM or --all" if stream is None else "STREAM or --all, not both"
        )
    state: _State = ctx.obj
    store = state.store()
    try:
        if verify:
            report = _replay.verify_store(store, stream, until=until, grace_ms=grace_ms)
        else:
            assert stream is not None
            if store.stream_version(stream) == 0:
                raise StoreError(f"no stream named {stream!r} in {store.location}")
            first = next(iter(store.read_stream(stream)), None)
            folded = load_state(
                store,
                stream,
                aggregate_for(stream, first.event if first is not None else None),
                until_position=until,
                snapshot_every=0,
                use_snapshots=not no_snapshots,
            )
    finally:
        store.close()
    if verify:
        state.failed = not report.clean
        for line in _replay.render(report, stream or "all streams", as_json):
            click.echo(line)
        ctx.exit(1 if state.failed else 0)
    if as_json:
        click.echo(to_json(folded))
    else:
        for line in state_lines(folded):
            click.echo(line)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per stream.")
@click.pass_obj
def streams(state: _State, as_json: bool) -> None:
    """List the streams with their versions and last event time."""
    store = state.store()
    try:
        infos = store.streams()
    finally:
        store.close()
    if as_json:
        for info in infos:
            click.echo(to_json(info))
        return
    if not infos:
        click.echo("no streams yet")
        return
    # a stream id may hold any character: shown escaped, one row a stream
    names = [escaped(info.stream) for info in infos]
    width = max(len(name) for name in names)
    click.echo(f"{'STREAM':<{width}}  {'VERSION':>7}  {'LAST POS':>8}  LAST EVENT")
    for name, info in zip(names, infos, strict=True):
        click.echo(
            f"{name:<{width}}  {info.version:>7}  {info.last_position:>8}  {fmt_ts(info.last_ts)}"
        )


def message_text(given: str, name: str) -> str:
    """A user message given on the command line (``run``'s PROMPT, ``session send``'s
    TEXT): as given, or standard input's whole UTF-8 text for ``-`` (a text longer than
    one argument may be: Linux passes at most 128 KiB). An empty or blank one is a usage
    error: it would be sent to a model as a turn with nothing to answer (a turn
    Anthropic's API refuses)."""
    text = given
    if given == "-":
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            raise click.UsageError(f"cannot read {name} from standard input as UTF-8") from None
    if not text.strip():
        raise click.UsageError(f"{name} is empty: give the message to send")
    return text


@cli.group()
def session() -> None:
    """One session: its events, and answers to what it waits for (see also `stalwart status`)."""


class _NeverRaised(click.ClickException):
    """Stands in for NoArgsIsHelpError on a click that has none (it prints the help)."""


#: click >= 8.2 raises this for a group called without a command (its message is the help)
_NO_ARGS: type[click.ClickException] = getattr(click.exceptions, "NoArgsIsHelpError", _NeverRaised)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``stalwart`` script: usage errors are one line and exit 1 too."""
    for stream in (sys.stdout, sys.stderr):
        # a character the terminal's encoding lacks (a Latin-1 or ASCII locale) is shown
        # escaped, not an encoding error that stops the output (and `run`'s turn)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    try:
        code = cli.main(args=argv, prog_name="stalwart", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except _NO_ARGS as exc:  # `stalwart`, `stalwart session`: the help, as asked for
        try:
            click.echo(exc.format_message())
        except BrokenPipeError:  # `stalwart | head -1`
            _reader_gone()
        sys.exit(0)
    except click.ClickException as exc:
        click.echo(f"stalwart: error: {escaped(exc.format_message())}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a bug: still one line (its text may hold anything: not shown)
        if os.environ.get("STALWART_TRACEBACK"):
            raise
        click.echo(
            f"stalwart: internal error: {type(exc).__name__} (a bug; set STALWART_TRACEBACK=1 "
            "to see where)",
            err=True,
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
