"""Pure folds and policies: state is rebuilt from events, decisions are functions of it.

This package imports only :mod:`stalwart.events`; nothing here does I/O or reads time.
"""

from ._aggregate import Aggregate, ApplyFolder, Folder, fold, fold_streams
from ._breaker import (
    BREAKER,
    BreakerAggregate,
    BreakerState,
    BreakerStatus,
    apply_breaker,
    decide_breaker,
)
from ._by_stream import aggregate_for
from ._prompt import (
    KNOBS,
    PromptWindow,
    decide_prompt_timeout,
    next_deadline,
    window_started,
    window_touched,
)
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
    "BREAKER",
    "KNOBS",
    "SESSION",
    "SUMMARY",
    "Aggregate",
    "ApplyFolder",
    "BreakerAggregate",
    "BreakerState",
    "BreakerStatus",
    "Folder",
    "LastMessage",
    "PendingRequest",
    "PromptWindow",
    "SessionAggregate",
    "SessionFolder",
    "SessionState",
    "SessionStatus",
    "StreamSummary",
    "StreamSummaryAggregate",
    "SummaryFolder",
    "aggregate_for",
    "apply_breaker",
    "apply_session",
    "decide_breaker",
    "decide_prompt_timeout",
    "fold",
    "fold_streams",
    "next_deadline",
    "window_started",
    "window_touched",
]
