"""``stalwart.store.open``: a store from a location string."""

from __future__ import annotations

import os

from stalwart.clock import Clock
from stalwart.errors import StoreError
from stalwart.events import DEFAULT_CODEC, Codec

from ._lmdb import LmdbEventStore
from ._protocol import EventStore

_POSTGRES_SCHEMES = ("postgresql", "postgres")


def open(
    location: str | os.PathLike[str],
    *,
    create: bool = True,
    codec: Codec = DEFAULT_CODEC,
    clock: Clock | None = None,
    read_only: bool = False,
) -> EventStore:
    """Open the store at ``location``: a directory path (LMDB) or a ``postgresql://`` URL.

    ``create=False`` raises StoreNotFoundError instead of creating an empty store, which
    is what read-only tools (the CLI's tail, replay, streams) want; ``read_only=True``
    also writes nothing at all (no format or schema upgrade; every write raises
    StoreReadOnlyError), so a store on a read-only mount or behind a read-only database
    role can be read. A PostgreSQL store needs the ``stalwart[postgres]`` extra.
    """
    text = os.fspath(location)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme in _POSTGRES_SCHEMES:
            return _open_postgres(
                text, create=create, codec=codec, clock=clock, read_only=read_only
            )
        raise StoreError(
            f"store URL scheme {scheme!r} is not supported by this version; give a "
            "directory path for the embedded LMDB store or a postgresql:// URL"
        )
    return LmdbEventStore(text, create=create, codec=codec, clock=clock, read_only=read_only)


def _open_postgres(
    url: str, *, create: bool, codec: Codec, clock: Clock | None, read_only: bool
) -> EventStore:
    try:
        from ._postgres import PostgresEventStore  # noqa: PLC0415 (an optional extra)
    except ImportError as exc:
        raise StoreError("a postgresql:// store needs psycopg: install stalwart[postgres]") from exc
    return PostgresEventStore(url, create=create, codec=codec, clock=clock, read_only=read_only)
