"""``stalwart.store.open``: a store from a location string."""

from __future__ import annotations

import os
from typing import Any

from stalwart.clock import Clock
from stalwart.config import StoreSettings
from stalwart.errors import StoreError
from stalwart.events import DEFAULT_CODEC, Codec

from ._lmdb import LmdbEventStore
from ._protocol import DEFAULT_SNAPSHOT_EVERY, EventStore

_POSTGRES_SCHEMES = ("postgresql", "postgres")


def open(
    location: str | os.PathLike[str],
    *,
    create: bool = True,
    codec: Codec = DEFAULT_CODEC,
    clock: Clock | None = None,
    read_only: bool = False,
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
    poll_interval: float | None = None,
) -> EventStore:
    """Open the store at ``location``: a directory path (LMDB) or a ``postgresql://`` URL.

    ``create=False`` raises StoreNotFoundError instead of creating an empty store, which
    is what read-only tools (the CLI's tail, replay, streams) want; ``read_only=True``
    also writes nothing at all (no format or schema upgrade; every write raises
    StoreReadOnlyError), so a store on a read-only mount or behind a read-only database
    role can be read. ``snapshot_every`` is how far a fold goes past its newest snapshot
    before it saves a new one (0: never); ``poll_interval`` (seconds) how often a tailing
    reader looks for another process's appends (None: the backend's own, 10 ms for LMDB,
    50 ms for PostgreSQL, whose LISTEN/NOTIFY usually rings first). A PostgreSQL store
    needs the ``stalwart[postgres]`` extra.
    """
    options: dict[str, Any] = {"snapshot_every": snapshot_every}
    if poll_interval is not None:
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        options["poll_interval"] = poll_interval
    text = os.fspath(location)
    if "://" in text:
        scheme = text.split("://", 1)[0].lower()
        if scheme in _POSTGRES_SCHEMES:
            return _open_postgres(
                text, create=create, codec=codec, clock=clock, read_only=read_only, **options
            )
        raise StoreError(
            f"store URL scheme {scheme!r} is not supported by this version; give a "
            "directory path for the embedded LMDB store or a postgresql:// URL"
        )
    return LmdbEventStore(
        text, create=create, codec=codec, clock=clock, read_only=read_only, **options
    )


def _open_postgres(
    url: str, *, create: bool, codec: Codec, clock: Clock | None, read_only: bool, **options: Any
) -> EventStore:
    try:
        from ._postgres import PostgresEventStore  # noqa: PLC0415 (an optional extra)
    except ImportError as exc:
        raise StoreError("a postgresql:// store needs psycopg: install stalwart[postgres]") from exc
    return PostgresEventStore(
        url, create=create, codec=codec, clock=clock, read_only=read_only, **options
    )


def open_configured(
    settings: StoreSettings, location: str | os.PathLike[str] | None = None, **options: Any
) -> EventStore:
    """The store at ``location`` (else ``settings.location``), opened with the config's
    ``snapshot_every`` and ``tail_poll_ms``; ``options`` are :func:`open`'s others."""
    poll = None if settings.tail_poll_ms is None else settings.tail_poll_ms / 1000
    return open(
        settings.location if location is None else location,
        snapshot_every=settings.snapshot_every,
        poll_interval=poll,
        **options,
    )
