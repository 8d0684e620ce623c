"""Pure folds and policies: state is rebuilt from events, decisions are functions of it.

This package imports only :mod:`stalwart.events`; nothing here does I/O or reads time.
"""

from ._aggregate import Aggregate, fold
from ._by_stream import aggregate_for
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
