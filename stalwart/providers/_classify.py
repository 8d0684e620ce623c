"""Which failures are worth retrying: HTTP statuses, error bodies, transport errors.

Bodies are read only to tell a context overflow or a content-policy refusal from another
400; they never reach an error message, a log line or an event.
"""

from __future__ import annotations

import re

import httpx

from stalwart.backoff import parse_retry_after
from stalwart.errors import ContextOverflowError, ProviderError

_RETRYABLE_STATUS = {
    408: "request_timeout",
    409: "conflict",
    429: "rate_limited",
    500: "server_error",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
    529: "overloaded",
}
_FINAL_STATUS = {
    400: "bad_request",
    401: "auth",
    403: "forbidden",
    404: "not_found",
    413: "context_overflow",
    422: "bad_request",
}
_OVERFLOW_MARKERS = (
    b"context_length_exceeded",
    b"maximum context length",
    b"prompt is too long",
    b"context window",
    b"too many tokens",
    b"exceed context limit",  # Anthropic: "input length and `max_tokens` exceed context limit"
    b"exceeds the available context size",  # llama.cpp server
    b"exceed_context_size_error",  # llama.cpp server's error type
)
#: Gemini: "The input token count (1048577) exceeds the maximum number of tokens allowed"
_OVERFLOW_WORDS = re.compile(rb"input token count\b.{0,64}?\bexceeds the maximum")
_POLICY_MARKERS = (b"content_policy", b"content_filter", b"safety", b"moderation")


def classify_status(
    status: int,
    body: bytes,
    retry_after: str | None,
    *,
    provider: str,
    model: str,
    now: float,
) -> ProviderError:
    """The typed error for a non-2xx answer."""
    wait = parse_retry_after(retry_after, now)
    lowered = body[:65536].lower()
    kind = _RETRYABLE_STATUS.get(status)
    retryable = kind is not None
    if kind is None:
        kind = _FINAL_STATUS.get(status)
        if kind is None:
            retryable = status >= 500
            kind = "server_error" if retryable else "client_error"
    if not retryable and (kind == "context_overflow" or _overflows(lowered)):
        return ContextOverflowError(
            f"{provider}/{model}: the prompt does not fit the model's context window "
            f"(HTTP {status})",
            kind="context_overflow",
            retryable=False,
            status=status,
            provider=provider,
            model=model,
        )
    if not retryable and any(m in lowered for m in _POLICY_MARKERS):
        kind = "content_policy"
    return ProviderError(
        f"{provider}/{model} answered HTTP {status} ({kind})",
        kind=kind,
        retryable=retryable,
        status=status,
        retry_after=wait,
        provider=provider,
        model=model,
    )


def _overflows(lowered: bytes) -> bool:
    """Whether an error body (lower-cased) says the prompt does not fit the context."""
    return any(m in lowered for m in _OVERFLOW_MARKERS) or bool(_OVERFLOW_WORDS.search(lowered))


def unsendable(*, provider: str, model: str) -> ProviderError:
    """The final error of a request that cannot be sent as built: a header value (the API
    key's, say) with a line break or a non-ASCII character in it. It names no value."""
    return ProviderError(
        f"{provider}/{model}: the request could not be sent as built (check the API key "
        "and headers for line breaks and non-ASCII characters)",
        kind="client_error",
        retryable=False,
        provider=provider,
        model=model,
    )


def classify_request(exc: httpx.RequestError, *, provider: str, model: str) -> ProviderError:
    """The typed error for a request that failed without an HTTP answer to classify.

    A request httpx refused to send (``LocalProtocolError``: a header value it cannot
    write, such as a key with a line break in it) is final: no retry can send it, and
    nothing reached the provider. A body that cannot be decoded (a broken gzip stream)
    is a malformed reply, retryable. Everything else is a transport failure. Raise the
    error for any ``ProtocolError`` ``from None``: a local one's message quotes the
    header value it refused (the API key's, maybe), a remote one's the server's bytes
    (which a proxy may fill with the request's own headers).
    """
    if isinstance(exc, httpx.LocalProtocolError):
        return unsendable(provider=provider, model=model)
    if isinstance(exc, httpx.DecodingError):
        return stream_error(
            "malformed",
            "the reply's body could not be decoded (DecodingError)",
            provider=provider,
            model=model,
        )
    if isinstance(exc, httpx.TransportError):
        return classify_transport(exc, provider=provider, model=model)
    return ProviderError(
        f"{provider}/{model}: the request failed ({type(exc).__name__})",
        kind="client_error",
        retryable=False,
        provider=provider,
        model=model,
    )


def classify_transport(exc: httpx.TransportError, *, provider: str, model: str) -> ProviderError:
    """The typed error for a connection that failed or broke; always retryable."""
    if isinstance(exc, httpx.ConnectTimeout | httpx.ConnectError):
        kind = "connect"
    elif isinstance(exc, httpx.ReadTimeout):
        kind = "read_timeout"
    elif isinstance(exc, httpx.RemoteProtocolError):
        kind = "stream_cut"
    elif isinstance(exc, httpx.ReadError | httpx.WriteError):
        kind = "connection_reset"
    else:
        kind = "transport"
    return ProviderError(
        f"{provider}/{model}: {kind.replace('_', ' ')} ({type(exc).__name__})",
        kind=kind,
        retryable=True,
        provider=provider,
        model=model,
    )


def stream_error(kind: str, detail: str, *, provider: str, model: str) -> ProviderError:
    """A stream that broke its protocol: cut before its end, or a frame we cannot read."""
    return ProviderError(
        f"{provider}/{model}: {detail}",
        kind=kind,
        retryable=True,
        provider=provider,
        model=model,
    )


#: the class an error reported inside a stream takes, by the words of its ``type`` or
#: ``code`` (the first that matches): the classes of the HTTP statuses those errors are
#: documented with. Any other error is ``stream_error``, retryable (unless its ``code`` is
#: an HTTP status: see :func:`classify_stream_error`).
STREAM_ERRORS: tuple[tuple[str, str, bool], ...] = (
    ("rate_limit", "rate_limited", True),
    ("invalid_request", "bad_request", False),
    ("authentication", "auth", False),
    ("permission", "forbidden", False),
    ("not_found", "not_found", False),
    ("billing", "client_error", False),
)


def _status_class(code: object) -> tuple[str, bool] | None:
    """The class of an HTTP status given as an error's numeric ``code`` (OpenRouter, vLLM
    and LiteLLM report ``{"code": 429}``); None for anything else. A 413 is left out: a
    context overflow is only ever told by its own error type."""
    if not isinstance(code, int) or isinstance(code, bool):
        return None
    if code in _RETRYABLE_STATUS:
        return _RETRYABLE_STATUS[code], True
    if code in _FINAL_STATUS and code != 413:
        return _FINAL_STATUS[code], False
    return None


def classify_stream_error(
    error: object,
    *,
    provider: str,
    model: str,
    classes: tuple[tuple[str, str, bool], ...] = STREAM_ERRORS,
) -> ProviderError:
    """The typed error for an error the provider reported in its reply rather than with
    an HTTP status: inside the stream, or as the body of a whole reply that came with a
    200 (OpenRouter does, when the model behind it fails). ``{"error": {"type": ...,
    "code": ...}}`` is told apart by the words of its ``type`` and ``code``, then by a
    ``code`` that is an HTTP status; any other is ``stream_error``, retryable. Its message
    never reaches the error."""
    words = ""
    by_status = None
    if isinstance(error, dict):
        words = " ".join(v for v in (error.get("type"), error.get("code")) if isinstance(v, str))
        by_status = _status_class(error.get("code"))
    words = words.lower()
    found = next(((k, r) for m, k, r in classes if m in words), by_status)
    kind, retryable = found or ("stream_error", True)
    return ProviderError(
        f"{provider}/{model}: the reply reported an error ({kind})",
        kind=kind,
        retryable=retryable,
        provider=provider,
        model=model,
    )
