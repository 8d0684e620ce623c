"""The context engine: fit a long conversation into the model's window, losing nothing.

The lossless DAG engine (:class:`DagEngine`, the default) keeps every message verbatim,
a fresh tail of recent turns, and a hierarchy of summaries of everything older that the
agent can search and expand back to the exact messages; see ``docs/context.md``.
"""

from ._dag import ContextScopeError, DagSession, valid_session_id
from ._engine import Assembly, DagEngine, ModelProfile
from ._ledger import Decide, MemoryLedger, SummarizerLedger, ended
from ._recall import Expansion, Inspection, SearchHit
from ._render import DAG_SYSTEM_CLAUSE, neutralise, render_summary
from ._repair import (
    SYNTHETIC_RESULT,
    Provider,
    answers_of,
    repair,
    results_by_call,
    validity_violations,
)
from ._search import Bm25Index
from ._standin import ExtractiveSummarizer
from ._summarize import SUMMARY_INSTRUCTIONS
from ._tokens import (
    PROFILES,
    Countable,
    TokenEstimator,
    TokenProfile,
    declared_tokens,
    estimate_message_tokens,
    estimate_text_tokens,
    estimate_tokens,
    request_budget,
)
from ._transcript import (
    SessionMessages,
    TranscriptError,
    messages_from_records,
    parse_transcript,
    read_transcript,
)
from ._types import ContextMessage, Summarizer, SummaryRequest, ThinkingBlock

__all__ = [
    "DAG_SYSTEM_CLAUSE",
    "PROFILES",
    "SUMMARY_INSTRUCTIONS",
    "SYNTHETIC_RESULT",
    "Assembly",
    "Bm25Index",
    "ContextMessage",
    "ContextScopeError",
    "Countable",
    "DagEngine",
    "DagSession",
    "Decide",
    "Expansion",
    "ExtractiveSummarizer",
    "Inspection",
    "MemoryLedger",
    "ModelProfile",
    "Provider",
    "SearchHit",
    "SessionMessages",
    "Summarizer",
    "SummarizerLedger",
    "SummaryRequest",
    "ThinkingBlock",
    "TokenEstimator",
    "TokenProfile",
    "TranscriptError",
    "answers_of",
    "declared_tokens",
    "ended",
    "estimate_message_tokens",
    "estimate_text_tokens",
    "estimate_tokens",
    "messages_from_records",
    "neutralise",
    "parse_transcript",
    "read_transcript",
    "render_summary",
    "repair",
    "request_budget",
    "results_by_call",
    "valid_session_id",
    "validity_violations",
]
