"""LLM provider calls that cannot hang: clients, classification, deadlines, fallback, breaker."""

from stalwart.backoff import backoff_delay, parse_retry_after

from ._breaker import Breaker
from ._caller import ModelCaller
from ._classify import classify_request, classify_status, classify_transport
from ._client import Accumulator, ProviderClient
from ._seal import CallSeal
from ._sink import EventSink
from ._sse import MAX_FRAME_BYTES, SseEvent, SseFrameTooLarge, SseParser
from ._types import (
    Done,
    Message,
    ProviderRequest,
    ProviderResponse,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "Accumulator",
    "Breaker",
    "CallSeal",
    "Done",
    "EventSink",
    "Message",
    "ModelCaller",
    "ProviderClient",
    "ProviderRequest",
    "ProviderResponse",
    "SseEvent",
    "SseFrameTooLarge",
    "SseParser",
    "StreamEvent",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
    "backoff_delay",
    "classify_request",
    "classify_status",
    "classify_transport",
    "parse_retry_after",
]
