"""A deterministic stand-in summarizer: no model, the same text for the same input.

The CLI's ``context simulate``, the benchmark and the tests use it so that a run can be
repeated exactly. It is extractive: the first sentence of each message (and the names of
the tools it called), in order, cut to the request's ``max_tokens``. It reports the
tokens an LLM summarizer would have been charged (the estimate of its input and output),
so spend caps behave as they would with a real one.
"""

from __future__ import annotations

import re

from ._tokens import estimate_message_tokens, estimate_text_tokens
from ._types import SummaryRequest

__all__ = ["ExtractiveSummarizer"]

_SENTENCE = re.compile(r"(.{1,160}?[.!?])(?:\s|$)", re.DOTALL)


class ExtractiveSummarizer:
    """``summarizer(request) -> (text, input_tokens, output_tokens)``, deterministically."""

    def __init__(self, per_message_chars: int = 160) -> None:
        self.per_message_chars = per_message_chars
        self.calls = 0

    def __call__(self, request: SummaryRequest) -> tuple[str, int, int]:
        self.calls += 1
        limit = max(1, request.max_tokens) * 3
        lines: list[str] = []
        used = 0
        for message in request.messages:
            flat = " ".join(message.content.split())
            found = _SENTENCE.match(flat)
            first = found.group(1) if found else flat[: self.per_message_chars]
            calls = ", ".join(call.name for call in message.tool_calls)
            line = f"{message.role}: {first}" + (f" [called {calls}]" if calls else "")
            if used + len(line) > limit:
                break
            lines.append(line)
            used += len(line) + 1
        text = "\n".join(lines) or "(nothing to summarize)"
        spent_in = sum(estimate_message_tokens(message) for message in request.messages)
        return text, spent_in, estimate_text_tokens(text)
