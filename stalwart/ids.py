"""Identifiers: the only module of stalwart that makes random ids."""

from __future__ import annotations

import os

__all__ = ["new_id"]

_urandom = os.urandom


def new_id() -> str:
    """A new random 128-bit id as 32 lowercase hex characters, from the operating
    system's random source (ids name approvals and idempotency keys: nobody reading the
    log may predict the next one). Every event gets one, so it skips building a UUID."""
    return _urandom(16).hex()
