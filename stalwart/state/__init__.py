"""Pure folds and policies: state is rebuilt from events, decisions are functions of it.

This package imports only :mod:`stalwart.events`; nothing here does I/O or reads time.
"""

from typing import Any

from ._aggregate import Aggregate, fold
from ._session import (
    SESSION,
    LastMessage,
    PendingRequest,
    SessionAggregate,
    SessionState,
    SessionStatus,
    apply_session,
)
from ._summary import SUMMARY, StreamSummary, StreamSummaryAggregate


def aggregate_for(stream: str) -> Aggregate[Any]:
    """The fold ``replay`` uses for a stream: by its prefix, else the summary fold."""
    if stream.startswith("session:"):
        return SESSION
    return SUMMARY


__all__ = [
    "SESSION",
    "SUMMARY",
    "Aggregate",
    "LastMessage",
    "PendingRequest",
    "SessionAggregate",
    "SessionState",
    "SessionStatus",
    "StreamSummary",
    "StreamSummaryAggregate",
    "aggregate_for",
    "apply_session",
    "fold",
]
