"""A channel that POSTs each message as JSON to an HTTP endpoint, with bounded retries.

Every attempt has its own time limit and carries the same ``Idempotency-Key`` header, so a
receiver that saw an attempt the sender gave up on can drop the duplicate. With a
``timer`` (a runtime's channels have one), the attempts' limits and the backoffs between
them run on its Clock; without one, on the event loop's. httpx's own connect and read
timeouts (the same length) stay on real time: a network that does not answer is bounded
whatever the Clock does. The secret
header's value is read from its env var once and goes into that header only: not into a
repr, an error, a log line or an event. Errors and reprs never show the url's path or
query either (a webhook url often holds a token), and httpx's own request log line shows
a webhook's url as its origin only (a filter on the ``httpx`` logger; no level or handler
is configured).
"""

from __future__ import annotations

import os
import random
from urllib.parse import quote, urlsplit

import anyio
import httpx
import msgspec

from stalwart._aio import cut_after, sleep_for
from stalwart._logs import (
    get_logger,
    hide_secret,
    hide_url,
    unhide_secret,
    unhide_url,
    url_secrets,
)
from stalwart._text import scrub_surrogates
from stalwart.backoff import backoff_delay, parse_retry_after
from stalwart.clock import Clock, SystemClock, Timer
from stalwart.config import ChannelSettings, url_problem
from stalwart.errors import ChannelError, ConfigError

from ._types import Delivery, OutboundMessage, closed_error

__all__ = ["WebhookChannel"]

log = get_logger(__name__)


class _Failure(msgspec.Struct, frozen=True, kw_only=True):
    """One failed attempt, content-free."""

    kind: str
    retryable: bool
    detail: str
    status: int | None = None
    retry_after: float | None = None


class WebhookChannel:
    """Delivers to one webhook url. Share one per channel: it holds a connection pool."""

    def __init__(
        self,
        name: str,
        settings: ChannelSettings,
        *,
        clock: Clock | None = None,
        timer: Timer | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
    ) -> None:
        where = f"channels.{name}"
        problem = (
            "a webhook channel needs a url" if settings.url is None else url_problem(settings.url)
        )
        if problem is not None or settings.url is None:
            raise ConfigError(f"key '{where}.url': {problem}", key=f"{where}.url")
        self.name = name
        self.settings = settings
        self._url = settings.url
        self._secret: tuple[str, str] | None = None
        if settings.secret_header and settings.secret_env:
            self._secret = (settings.secret_header, _secret_value(where, settings.secret_env))
        # a receiver may echo the request's headers in its own (httpcore's trace prints them)
        self._hidden = (*url_secrets(self._url), *(self._secret[1:] if self._secret else ()))
        for secret in self._hidden:
            hide_secret(secret)
        self._logged_url = str(httpx.URL(self._url))  # as httpx's request log shows it
        hide_url(self._logged_url, _origin(self._url))
        self._clock = clock or SystemClock()
        self._timer = timer
        self._rng = rng or random.Random()
        self._timeout = settings.timeout_ms / 1000
        self._http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(self._timeout))
        self._closed = False
        self._backoffs: set[anyio.CancelScope] = set()  # the sends waiting to try again

    def __repr__(self) -> str:
        header = f", secret_header={self.settings.secret_header!r}" if self._secret else ""
        return f"WebhookChannel({self.name!r}, url={_origin(self._url)!r}{header})"

    async def aclose(self) -> None:
        """Refuse new sends, end the ones waiting out a backoff (each fails as ``closed``
        at once, not after its wait), and close the connection pool, which ends an
        attempt in flight the same way. Call it on the event loop the sends run on."""
        first, self._closed = not self._closed, True
        for backoff in self._backoffs:
            backoff.cancel()
        try:
            await self._http.aclose()
        finally:
            if first:  # once nothing of it can log any more
                unhide_url(self._logged_url)
                for secret in self._hidden:
                    unhide_secret(secret)

    async def send(self, message: OutboundMessage) -> Delivery:
        """POST the message until it is accepted (2xx), a failure is final, or the attempts
        run out; a retryable failure waits a full-jitter backoff (at least Retry-After)."""
        if self._closed:
            raise closed_error(self.name)
        # JSON is UTF-8: a lone surrogate (text cut mid-pair) is sent as U+FFFD
        key = scrub_surrogates(message.idempotency_key)
        thread = None if message.thread is None else scrub_surrogates(message.thread)
        body = msgspec.json.encode(
            {
                "conversation": scrub_surrogates(message.conversation),
                "thread": thread,
                "text": scrub_surrogates(message.text),
                "kind": message.kind,
                "idempotency_key": key,
            }
        )
        headers = {"content-type": "application/json", "idempotency-key": _header_safe(key)}
        if self._secret is not None:
            headers[self._secret[0]] = self._secret[1]
        attempt = 0
        while True:
            if self._closed:  # closed while this send backed off
                raise closed_error(self.name)
            attempt += 1
            try:
                outcome = await self._attempt(body, headers)
            except RuntimeError:  # httpx: the client was closed during the attempt
                if self._closed:
                    raise closed_error(self.name) from None
                raise
            if self._closed and not isinstance(outcome, int):  # its pool closed under it
                raise closed_error(self.name)
            if isinstance(outcome, int):
                return Delivery(channel=self.name, attempts=attempt, status=outcome)
            delay = self._retry_delay(outcome, attempt)
            if delay is None:
                raise self._error(outcome, attempt)
            log.info(
                "channel.retry_scheduled",
                channel=self.name,
                attempt=attempt,
                kind=outcome.kind,
                status=outcome.status,
                delay_s=round(delay, 3),
            )
            with anyio.CancelScope() as backoff:
                self._backoffs.add(backoff)
                if self._closed:  # closed during the attempt: no wait
                    backoff.cancel()
                try:
                    await sleep_for(delay, self._timer)
                finally:
                    self._backoffs.discard(backoff)

    async def _attempt(self, body: bytes, headers: dict[str, str]) -> int | _Failure:
        """The 2xx status, or what went wrong; bounded by the per-attempt timeout."""
        with cut_after(self._timeout, self._timer):
            try:
                async with self._http.stream(
                    "POST", self._url, content=body, headers=headers
                ) as response:
                    status = response.status_code
                    retry_after = response.headers.get("retry-after")
            except (httpx.LocalProtocolError, httpx.UnsupportedProtocol) as exc:
                # a request that cannot be sent as it is: sending it again cannot help
                return _Failure(
                    kind="rejected",
                    retryable=False,
                    detail=f"the request could not be sent: {type(exc).__name__}",
                )
            except httpx.TransportError as exc:
                return _transport_failure(exc)
            if 200 <= status < 300:
                return status
            return _status_failure(status, parse_retry_after(retry_after, self._clock.now()))
        return _Failure(kind="timeout", retryable=True, detail="no answer within the time limit")

    def _retry_delay(self, failure: _Failure, attempt: int) -> float | None:
        """Seconds to wait before the next attempt, or None to stop here."""
        if not failure.retryable or attempt >= self.settings.max_attempts:
            return None
        cap = self.settings.retry_cap_ms / 1000
        if failure.retry_after is not None and failure.retry_after > cap:
            return None  # the receiver asks for longer than we wait: leave it to the caller
        settings = self.settings
        delay = backoff_delay(attempt, settings.retry_base_ms, settings.retry_cap_ms, self._rng)
        return max(delay, failure.retry_after or 0.0)

    def _error(self, failure: _Failure, attempts: int) -> ChannelError:
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
        why = ""
        if failure.retryable and attempts < self.settings.max_attempts:
            cap = self.settings.retry_cap_ms
            why = f"; its Retry-After of {failure.retry_after:g} s is over the {cap} ms cap"
        return ChannelError(
            f"webhook channel {self.name!r}: {failure.detail} ({failure.kind}) after {tries}{why}",
            kind=failure.kind,
            retryable=failure.retryable,
            channel=self.name,
            status=failure.status,
            attempts=attempts,
            retry_after=failure.retry_after,
        )


def _status_failure(status: int, retry_after: float | None) -> _Failure:
    if status == 429:
        kind, retryable = "rate_limited", True
    elif status == 408:
        kind, retryable = "timeout", True
    elif 500 <= status < 600:
        kind, retryable = "server_error", True
    else:
        kind, retryable = "rejected", False
    return _Failure(
        kind=kind,
        retryable=retryable,
        detail=f"HTTP {status}",
        status=status,
        retry_after=retry_after,
    )


def _transport_failure(exc: httpx.TransportError) -> _Failure:
    if isinstance(exc, httpx.TimeoutException):
        kind, what = "timeout", "timed out"
    elif isinstance(exc, httpx.ConnectError):
        kind, what = "connect", "could not connect"
    else:
        kind, what = "transport", "the connection broke"
    return _Failure(kind=kind, retryable=True, detail=f"{what}: {type(exc).__name__}")


def _secret_value(where: str, variable: str) -> str:
    """The secret header's value from ``variable``, stripped of the line break a secret
    file often ends with; never shown in an error."""
    value = os.environ.get(variable, "").strip()
    key = f"{where}.secret_env"
    if not value:
        raise ConfigError(f"key '{key}': the environment variable {variable!r} is not set", key=key)
    if not (value.isascii() and value.isprintable()):
        raise ConfigError(
            f"key '{key}': the environment variable {variable!r} holds a value that cannot "
            "be an HTTP header value (a non-ASCII or control character)",
            key=key,
        )
    return value


def _header_safe(key: str) -> str:
    """An idempotency key as a header value: as it is when it can be one (printable
    ASCII, no space at either end), else percent-encoded (the body carries it as it is)."""
    if key.isascii() and key.isprintable() and key.strip(" ") == key:
        return key
    return quote(key, safe="")


def _origin(url: str) -> str:
    """``scheme://host:port/...``: no user info, path or query."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}/..."
