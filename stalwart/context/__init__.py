"""The context engine: fit a long conversation into the model's window, losing nothing."""

from ._types import ContextMessage, Summarizer, SummaryRequest, ThinkingBlock

__all__ = ["ContextMessage", "Summarizer", "SummaryRequest", "ThinkingBlock"]
