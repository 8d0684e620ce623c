"""``stalwart db init``: create or upgrade the store's schema before workers start;
``stalwart db check``: does every way of reading the store agree with its log?"""

from __future__ import annotations

import click

from stalwart._text import escaped
from stalwart.store import check_store
from stalwart.store import open as open_store

from ._app import DEFAULT_STORE, _State, cli
from ._render import to_json


@cli.group()
def db() -> None:
    """The store's database: create or upgrade its schema, check it."""


#: ``db init --store PATH`` and ``db check --store PATH``: the form a store's own error
#: names ("create it with `stalwart db init --store URL`"), as ``stalwart --store`` does
store_option = click.option(
    "--store",
    "location",
    metavar="PATH",
    default=None,
    help="The store, as `stalwart --store PATH` names it (given here, this one is used).",
)


@db.command()
@store_option
@click.pass_obj
def init(state: _State, location: str | None) -> None:
    """Create the store (or upgrade its schema) at --store, then exit.

    Safe to run while workers use the store and from several hosts at once: the
    schema is changed in one transaction under a lock, and a current schema is left
    as it is. For a directory this creates an empty LMDB store.
    """
    location = location or state.location or DEFAULT_STORE
    store = open_store(location, create=True)
    try:
        migrated = getattr(store, "migrated_from", None)
        version = getattr(store, "schema_version", None)
        where = store.location
    finally:
        store.close()
    if version is None:
        click.echo(f"the store at {where} is ready")
    elif migrated is None:
        click.echo(f"the store at {where} is up to date (schema version {version})")
    elif migrated == 0:
        click.echo(f"created the store at {where} (schema version {version})")
    else:
        click.echo(f"upgraded the store at {where} from schema version {migrated} to {version}")


@db.command()
@store_option
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@click.pass_context
def check(ctx: click.Context, location: str | None, as_json: bool) -> None:
    """Walk the whole log, read every stream back, and report where they disagree.

    Each problem is one line: a record that cannot be read, a gap, a version out of
    order, a stream whose own read or row says something else than the log, an LMDB
    index that stopped behind a damaged record. Reads only: safe beside running
    workers. Exit 0 when the store is consistent, 1 when a problem was found.
    """
    state: _State = ctx.obj
    if location is not None:
        state.location = location
    store = state.store()
    try:
        report = check_store(store)
    finally:
        store.close()
    state.failed = not report.ok
    if as_json:
        click.echo(to_json(report))
    else:
        click.echo(
            f"checked {report.location}: {report.records:,} records in {report.streams:,} "
            f"streams, head {report.head:,}"
        )
        details = report.details
        if "indexed" in details:
            behind = report.head - int(details["indexed"])
            click.echo(
                f"  format {details['format']}, index to position {int(details['indexed']):,} "
                f"({behind:,} records after it)"
            )
        for problem in report.problems:
            where = " ".join(
                part
                for part in (
                    f"position {problem.position}" if problem.position is not None else "",
                    escaped(problem.stream or ""),  # a damaged stream's id may hold anything
                )
                if part
            )
            click.echo(f"  problem  {where}: {escaped(problem.what)}")
        count = len(report.problems)
        click.echo("consistent" if report.ok else f"{count} problem{'s' * (count != 1)}")
    ctx.exit(0 if report.ok else 1)
