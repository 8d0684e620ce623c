"""Identifiers: the only module of stalwart that makes random ids."""

from __future__ import annotations

import uuid

__all__ = ["new_id"]


def new_id() -> str:
    """A new random 128-bit id as 32 lowercase hex characters."""
    return uuid.uuid4().hex
