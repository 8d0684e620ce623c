"""Which fold a stream is replayed with."""

from __future__ import annotations

from typing import Any

from ._aggregate import Aggregate
from ._breaker import BREAKER
from ._session import SESSION
from ._summary import SUMMARY


def aggregate_for(stream: str) -> Aggregate[Any]:
    """The fold ``replay`` uses for a stream: by its prefix, else the summary fold."""
    if stream.startswith("session:"):
        return SESSION
    if stream.startswith("provider:"):
        return BREAKER
    return SUMMARY
