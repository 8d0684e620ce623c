"""``stalwart.store.open``: a store from a location string."""

from __future__ import annotations

import os

from stalwart.clock import Clock
from stalwart.errors import StoreError
from stalwart.events import DEFAULT_CODEC, Codec

from ._lmdb import LmdbEventStore
from ._protocol import EventStore


def open(
    location: str | os.PathLike[str],
    *,
    create: bool = True,
    codec: Codec = DEFAULT_CODEC,
    clock: Clock | None = None,
) -> EventStore:
    """Open the store at ``location``: a directory path (LMDB).

    ``create=False`` raises StoreNotFoundError instead of creating an empty store, which
    is what read-only tools (the CLI's tail, replay, streams) want.
    """
    text = os.fspath(location)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise StoreError(
            f"store URL scheme {scheme!r} is not supported by this version; "
            "give a directory path for the embedded LMDB store"
        )
    return LmdbEventStore(text, create=create, codec=codec, clock=clock)
