"""Identifiers: the only module of stalwart that makes random ids."""

from __future__ import annotations

import os

__all__ = ["new_id", "new_ids"]

_urandom = os.urandom


def new_id() -> str:
    """A new random 128-bit id as 32 lowercase hex characters, from the operating
    system's random source (ids name approvals and idempotency keys: nobody reading the
    log may predict the next one). Every event gets one, so it skips building a UUID."""
    return _urandom(16).hex()


def new_ids(count: int) -> list[str]:
    """``count`` new ids as :func:`new_id` makes them, from one read of the random source
    (the store's writer names every event of a batch at once)."""
    hexed = _urandom(16 * count).hex()
    return [hexed[at : at + 32] for at in range(0, 32 * count, 32)]
