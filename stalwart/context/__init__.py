"""The context engine: fit a long conversation into the model's window, losing nothing."""

from ._tokens import (
    PROFILES,
    Countable,
    TokenEstimator,
    TokenProfile,
    estimate_message_tokens,
    estimate_text_tokens,
    estimate_tokens,
)
from ._types import ContextMessage, Summarizer, SummaryRequest, ThinkingBlock

__all__ = [
    "PROFILES",
    "ContextMessage",
    "Countable",
    "Summarizer",
    "SummaryRequest",
    "ThinkingBlock",
    "TokenEstimator",
    "TokenProfile",
    "estimate_message_tokens",
    "estimate_text_tokens",
    "estimate_tokens",
]
