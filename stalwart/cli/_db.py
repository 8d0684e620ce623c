"""``stalwart db init``: create or upgrade the store's schema before workers start."""

from __future__ import annotations

import click

from stalwart.store import open as open_store

from ._app import DEFAULT_STORE, _State, cli


@cli.group()
def db() -> None:
    """The store's database: create or upgrade its schema."""


@db.command()
@click.pass_obj
def init(state: _State) -> None:
    """Create the store (or upgrade its schema) at --store, then exit.

    Safe to run while workers use the store and from several hosts at once: the
    schema is changed in one transaction under a lock, and a current schema is left
    as it is. For a directory this creates an empty LMDB store.
    """
    location = state.location or DEFAULT_STORE
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
