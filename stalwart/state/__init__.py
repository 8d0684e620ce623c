"""Pure folds and policies: state is rebuilt from events, decisions are functions of it.

This package imports only :mod:`stalwart.events`; nothing here does I/O or reads time.
"""

from ._aggregate import Aggregate, ApplyFolder, Folder, fold, fold_streams
from ._by_stream import aggregate_for
from ._session import (
    SESSION,
    LastMessage,
    PendingRequest,
    SessionAggregate,
    SessionFolder,
    SessionState,
    SessionStatus,
    apply_session,
)
from ._summary import SUMMARY, StreamSummary, StreamSummaryAggregate, SummaryFolder

__all__ = [
    "SESSION",
    "SUMMARY",
    "Aggregate",
    "ApplyFolder",
    "Folder",
    "LastMessage",
    "PendingRequest",
    "SessionAggregate",
    "SessionFolder",
    "SessionState",
    "SessionStatus",
    "StreamSummary",
    "StreamSummaryAggregate",
    "SummaryFolder",
    "aggregate_for",
    "apply_session",
    "fold",
    "fold_streams",
]
