"""How many tokens a message costs a provider, estimated without a tokenizer.

The estimate is deliberately on the high side: an engine that fits a transcript into a
budget must not overflow it, and a few percent of slack costs less than a rejected
request. Each provider family has a :class:`TokenProfile` (characters per token, the
framing every message and tool call adds, the fixed cost of an image). A
:class:`TokenEstimator` multiplies the raw estimate by a running correction factor fed
with ``(estimated, reported)`` pairs from provider usage, so a model whose tokenizer is
denser than the profile assumed is corrected within a few calls.

Text is counted by length, not tokenized: ASCII runs at the profile's characters per
token, and characters outside ASCII (CJK, emoji, accents) at about one token each, which
is what the BPE vocabularies in use do to them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Protocol

import msgspec

from stalwart.events import ToolCall, ToolSpec

from ._types import ContextMessage

__all__ = [
    "PROFILES",
    "Countable",
    "TokenEstimator",
    "TokenProfile",
    "estimate_message_tokens",
    "estimate_text_tokens",
    "estimate_tokens",
    "request_budget",
]

_FACTOR_MIN = 0.5
_FACTOR_MAX = 4.0
_WEIGHT = 0.2  # how far one observation moves the running factor


class TokenProfile(msgspec.Struct, frozen=True, kw_only=True):
    """The constants of one provider family's tokenizer and message framing."""

    name: str
    chars_per_token: float = 3.6
    message_overhead: int = 4
    tool_call_overhead: int = 12
    image_tokens: int = 1_600
    thinking_overhead: int = 4


PROFILES: dict[str, TokenProfile] = {
    # OpenAI chat framing is ~4 tokens a message; tiktoken's o200k runs ~4 chars/token on
    # English, code and JSON run denser, so 3.6 keeps the estimate above the truth. A
    # high-detail 1024px image is 765 tokens; larger ones tile up to ~1,100.
    "openai": TokenProfile(name="openai", chars_per_token=3.6, image_tokens=1_105),
    # Anthropic's tokenizer is denser (~3.3 chars/token on English); an image costs about
    # width*height/750 tokens, ~1,600 at the 1.15 megapixel cap.
    "anthropic": TokenProfile(
        name="anthropic", chars_per_token=3.2, message_overhead=5, image_tokens=1_600
    ),
}
DEFAULT_PROFILE = PROFILES["anthropic"]  # the stricter of the two


class Countable(Protocol):
    """What is counted: a :class:`ContextMessage` or the provider ``Message`` shape."""

    @property
    def content(self) -> str: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...
    @property
    def tool_call_id(self) -> str | None: ...
    @property
    def images(self) -> tuple[str, ...]: ...


def estimate_text_tokens(text: str, profile: TokenProfile = DEFAULT_PROFILE) -> int:
    """Tokens for a piece of text: ASCII by length, other characters about one each."""
    if not text:
        return 0
    if text.isascii():
        return math.ceil(len(text) / profile.chars_per_token)
    # Multi-byte characters: 2-byte (accents) and 3/4-byte (CJK, emoji) alike count as
    # about one token; the extra UTF-8 bytes over the character count bound how many.
    extra = len(text.encode("utf-8", "surrogatepass")) - len(text)
    wide = min(len(text), extra)
    return math.ceil((len(text) - wide) / profile.chars_per_token) + wide


#: What ends a summary cut to its maximum (a summarizer that ignores its ``max_tokens``).
CUT_SUMMARY = " [... cut: the summary was longer than its maximum]"


def clip_to_tokens(text: str, limit: int, marker: str = CUT_SUMMARY) -> str:
    """``text`` if it costs at most ``limit`` tokens, else its longest prefix that does
    with ``marker`` after it (the marker alone when nothing else fits)."""
    if estimate_text_tokens(text) <= limit:
        return text
    room = max(0, limit - estimate_text_tokens(marker))
    return text[: chars_within(text, room)] + marker


def chars_within(text: str, room: int) -> int:
    """How many leading characters of ``text`` cost at most ``room`` tokens (0 when not
    even one does): the cut point for text that must fit a token limit."""
    if estimate_text_tokens(text) <= room:
        return len(text)
    low, high = 0, len(text) - 1
    while low < high:  # the longest prefix within room: tokens grow with length
        middle = (low + high + 1) // 2
        if estimate_text_tokens(text[:middle]) <= room:
            low = middle
        else:
            high = middle - 1
    return low


def _raw_message_tokens(message: Countable, profile: TokenProfile) -> int:
    total = profile.message_overhead + estimate_text_tokens(message.content, profile)
    for call in message.tool_calls:
        total += profile.tool_call_overhead
        total += estimate_text_tokens(call.name, profile)
        total += estimate_text_tokens(call.arguments, profile)
        total += estimate_text_tokens(call.id, profile)
    if message.tool_call_id:
        total += estimate_text_tokens(message.tool_call_id, profile) + 2
    total += len(message.images) * profile.image_tokens
    if isinstance(message, ContextMessage):
        if message.name:
            total += estimate_text_tokens(message.name, profile)
        for block in message.thinking:
            total += profile.thinking_overhead + estimate_text_tokens(block.text, profile)
            if block.signature:
                total += estimate_text_tokens(block.signature, profile)
    return total


def estimate_message_tokens(message: Countable) -> int:
    """One message's tokens under the default (stricter) profile, uncalibrated."""
    return _raw_message_tokens(message, DEFAULT_PROFILE)


def estimate_tokens(messages: Iterable[Countable]) -> int:
    """A transcript's tokens under the default profile, uncalibrated."""
    return sum(_raw_message_tokens(message, DEFAULT_PROFILE) for message in messages)


class TokenEstimator:
    """A provider's estimator with a running correction factor from reported usage.

    ``calibrate(estimated, reported)`` moves the factor a fifth of the way toward
    ``reported / estimated`` (an exponentially weighted mean, clamped to 0.5..4), so one
    odd reply cannot swing it and a consistent bias is corrected within ~10 calls. The
    factor never goes below 1.0 unless reports consistently say the estimate is high.
    """

    def __init__(self, provider: str = "anthropic", model: str = "") -> None:
        self.provider = provider
        self.model = model
        self.profile = PROFILES.get(provider, DEFAULT_PROFILE)
        self.factor = 1.0
        self.observations = 0

    def calibrate(self, estimated: int, reported: int) -> float:
        """Feed one pair: ``estimated`` the uncalibrated estimate (:meth:`raw`, summed) of
        what was sent, ``reported`` what the provider counted; returns the new factor."""
        self.factor, self.observations = self.after(estimated, reported)
        return self.factor

    def after(self, estimated: int, reported: int) -> tuple[float, int]:
        """The factor and the count of observations one more pair would leave (pure:
        the estimator is unchanged; a pair with a side not above 0 changes nothing)."""
        if estimated <= 0 or reported <= 0:
            return self.factor, self.observations
        ratio = min(_FACTOR_MAX, max(_FACTOR_MIN, reported / estimated))
        if self.observations == 0:
            return ratio, 1
        return self.factor + _WEIGHT * (ratio - self.factor), self.observations + 1

    def raw(self, message: Countable) -> int:
        """The uncalibrated estimate under this provider's profile."""
        return _raw_message_tokens(message, self.profile)

    def message(self, message: Countable) -> int:
        """One message's calibrated estimate."""
        return math.ceil(self.raw(message) * self.factor)

    def messages(self, messages: Iterable[Countable]) -> int:
        """A transcript's calibrated estimate."""
        return math.ceil(sum(self.raw(message) for message in messages) * self.factor)

    def text(self, text: str) -> int:
        """A bare text's calibrated estimate (no message framing)."""
        return math.ceil(estimate_text_tokens(text, self.profile) * self.factor)

    def overhead_extra(self, overhead: int) -> int:
        """What a request's ``overhead`` (the uncalibrated estimate of what it carries
        besides its messages: a system text, tool declarations; a budget counted it at
        factor 1) costs on top of that estimate at this factor: room the messages do not
        get. Never below 0 (a factor under 1 gives them nothing back)."""
        overhead = max(0, overhead)
        return max(0, math.ceil(overhead * self.factor) - overhead)


def request_budget(
    context_window: int,
    *,
    max_output_tokens: int,
    tools: Iterable[ToolSpec] = (),
    estimator: TokenEstimator | None = None,
) -> int:
    """The tokens a request's messages may use: the model's window less the reply it
    may write (``max_tokens``) and the tool declarations sent with it (name, description
    and JSON schema, estimated like text). Never below 1."""
    profile = estimator.profile if estimator else DEFAULT_PROFILE
    factor = estimator.factor if estimator else 1.0
    declared = declared_tokens(tools, profile)
    return max(1, context_window - max_output_tokens - math.ceil(declared * factor))


def declared_tokens(tools: Iterable[ToolSpec], profile: TokenProfile = DEFAULT_PROFILE) -> int:
    """The uncalibrated estimate of tool declarations (name, description, JSON schema)."""
    declared = 0
    for spec in tools:
        schema = json.dumps(spec.parameters, separators=(",", ":"), sort_keys=True)
        declared += profile.tool_call_overhead
        declared += estimate_text_tokens(f"{spec.name} {spec.description} {schema}", profile)
    return declared
