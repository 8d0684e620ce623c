"""One HTTP client per configured provider: streams replies as neutral events.

The API key is read from the environment variable the config names, once, and kept in a
private attribute: it is sent in a header and nowhere else (not in reprs, errors, events
or logs). Transport errors, error statuses and broken streams all become ProviderError.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import anyio
import httpx
import msgspec

from stalwart._logs import hide_secret, unhide_secret, url_secrets
from stalwart.clock import Clock, SystemClock
from stalwart.config import ProviderSettings
from stalwart.errors import ProviderError
from stalwart.events import ToolCall

from ._anthropic import AnthropicWire
from ._classify import (
    classify_request,
    classify_status,
    classify_stream_error,
    stream_error,
    unsendable,
)
from ._openai import OpenAIWire
from ._shape import JSON_ERRORS
from ._sse import MAX_FRAME_BYTES, SseEvent, SseFrameTooLarge, SseParser
from ._types import (
    Done,
    ProviderRequest,
    ProviderResponse,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    Usage,
)

_ERROR_BODY_LIMIT = 64 * 1024
#: how long an error status's body is read (it only tells a 4xx apart) before classing it
_ERROR_BODY_SECONDS = 1.0
_DRAIN_LIMIT = 64 * 1024
_DRAIN_SECONDS = 0.05
#: a whole (non-streamed) reply is refused past this many bytes, as a streamed frame is
_REPLY_LIMIT = MAX_FRAME_BYTES
#: a bare media type (``type/subtype``), the only part of a Content-Type an error shows
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}")


class _Decoder(Protocol):
    done: bool

    def feed(self, frame: SseEvent) -> list[StreamEvent]: ...


class _Wire(Protocol):
    api: str
    errors: tuple[tuple[str, str, bool], ...]

    def url(self, base_url: str) -> str: ...
    def headers(self, api_key: str | None) -> dict[str, str]: ...
    def body(self, model: str, request: ProviderRequest, *, stream: bool) -> dict[str, Any]: ...
    def stream_decoder(self, provider: str, model: str) -> _Decoder: ...
    def response(self, data: dict[str, Any]) -> tuple[str, str, Any, str, Usage]: ...


WIRES: dict[str, _Wire] = {"openai": OpenAIWire(), "anthropic": AnthropicWire()}


#: what reading a frame of valid JSON but the wrong shape raises (``.get`` on a string, a
#: missing key, a number that is not one, a value of the wrong type: ``_shape.WrongShape``
#: is a TypeError): the wires read dicts as the APIs document them
_SHAPE_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ValueError)


class ProviderClient:
    """Talks to one provider. Share one per provider: it holds a connection pool."""

    def __init__(
        self,
        name: str,
        settings: ProviderSettings,
        *,
        clock: Clock | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self._wire = WIRES[settings.kind]
        self._url = self._wire.url(settings.base_url)
        key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        # a key from a file-backed secret or a CRLF .env ends in a line break: not the key's
        self._api_key = key.strip() if key is not None else None
        # whatever their shape, no log line shows the key or the base_url's password (a
        # server may echo the request's headers in its own, which httpcore's trace prints)
        self._hidden = (*((self._api_key,) if self._api_key else ()), *url_secrets(self._url))
        for secret in self._hidden:
            hide_secret(secret)
        self._clock = clock or SystemClock()
        self._http = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(None, connect=settings.connect_timeout_ms / 1000),
            limits=httpx.Limits(max_connections=settings.max_in_flight),
        )

    def __repr__(self) -> str:
        url = httpx.URL(self._url).copy_with(userinfo=b"", query=None)
        return f"ProviderClient({self.name!r}, kind={self.settings.kind!r}, url={str(url)!r})"

    @property
    def has_api_key(self) -> bool:
        return bool(self._api_key)

    async def aclose(self) -> None:
        try:
            await self._http.aclose()
        finally:
            hidden, self._hidden = self._hidden, ()
            for secret in hidden:  # once nothing of this client can log any more
                unhide_secret(secret)

    def _headers(self, model: str) -> dict[str, str]:
        key = self._api_key
        if key is not None and not (key.isascii() and key.isprintable()):
            # httpx would raise UnicodeEncodeError building the request (non-ASCII), or
            # LocalProtocolError sending it (a line break): final either way
            raise unsendable(provider=self.name, model=model)
        return {"content-type": "application/json", **self._wire.headers(key)}

    def _misshapen(self, model: str) -> ProviderError:
        """JSON that is not the wire's shape (a null choice, a string where an object
        goes): malformed, retryable; the frame's content stays out of the message."""
        return stream_error(
            "malformed", "a frame is not in the expected shape", provider=self.name, model=model
        )

    async def _fail(self, response: httpx.Response, model: str) -> ProviderError:
        """The error for a non-200 answer. Its body is read only to tell a 4xx apart (a
        context overflow, a content policy), for at most ``_ERROR_BODY_SECONDS``: the
        status has come, so a body that stalls or breaks off costs no more than that."""
        body = b""
        with anyio.move_on_after(_ERROR_BODY_SECONDS), contextlib.suppress(httpx.RequestError):
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) >= _ERROR_BODY_LIMIT:
                    break
        return classify_status(
            response.status_code,
            body,
            response.headers.get("retry-after"),
            provider=self.name,
            model=model,
            now=self._clock.now(),
        )

    async def stream(
        self, model: str, request: ProviderRequest
    ) -> AsyncGenerator[StreamEvent, None]:
        """The reply as it arrives; ends with :class:`Done` or raises ProviderError.

        Closing the iterator (or cancelling its consumer) closes the connection: nothing
        more is read and the server sees the client go.
        """
        body = msgspec.json.encode(self._wire.body(model, request, stream=True))
        try:
            async with self._http.stream(
                "POST", self._url, content=body, headers=self._headers(model)
            ) as response:
                if response.status_code != 200:
                    raise await self._fail(response, model)
                content_type = response.headers.get("content-type", "")
                if "text/event-stream" not in content_type:
                    raise stream_error(
                        "malformed",
                        f"expected an event stream, got {_media_type(content_type)}",
                        provider=self.name,
                        model=model,
                    )
                async for event in self._events(response, model):
                    yield event
        except httpx.RequestError as exc:
            raise classify_request(exc, provider=self.name, model=model) from _cause(exc)

    async def _events(self, response: httpx.Response, model: str) -> AsyncIterator[StreamEvent]:
        parser = SseParser()
        decoder = self._wire.stream_decoder(self.name, model)
        chunks = response.aiter_bytes()
        async for chunk in chunks:
            try:
                frames = parser.feed(chunk)
            except SseFrameTooLarge as exc:
                raise stream_error("malformed", str(exc), provider=self.name, model=model) from None
            for frame in frames:
                try:
                    events = decoder.feed(frame)
                except _SHAPE_ERRORS:
                    raise self._misshapen(model) from None
                for event in events:
                    yield event
                if decoder.done:
                    await _drain(chunks)
                    return
        detail = "a frame was cut mid-way" if parser.pending else "it ended before its final event"
        raise stream_error(
            "stream_cut", f"the stream was cut: {detail}", provider=self.name, model=model
        )

    async def complete(self, model: str, request: ProviderRequest) -> ProviderResponse:
        """A whole reply without streaming; one larger than ``MAX_FRAME_BYTES`` is refused
        as malformed instead of buffered without bound."""
        body = msgspec.json.encode(self._wire.body(model, request, stream=False))
        try:
            async with self._http.stream(
                "POST", self._url, content=body, headers=self._headers(model)
            ) as response:
                if response.status_code != 200:
                    raise await self._fail(response, model)
                content = await self._whole(response, model)
        except httpx.RequestError as exc:
            raise classify_request(exc, provider=self.name, model=model) from _cause(exc)
        return self._reply(model, content)

    async def _whole(self, response: httpx.Response, model: str) -> bytes:
        """The reply's body, read up to ``_REPLY_LIMIT`` bytes and refused past it."""
        content = bytearray()
        async for chunk in response.aiter_bytes():
            content += chunk
            if len(content) > _REPLY_LIMIT:
                raise stream_error(
                    "malformed",
                    f"the reply is larger than {_REPLY_LIMIT} bytes",
                    provider=self.name,
                    model=model,
                )
        return bytes(content)

    def _reply(self, model: str, content: bytes) -> ProviderResponse:
        try:
            data = msgspec.json.decode(content)
        except JSON_ERRORS:
            data = None
        if not isinstance(data, dict):
            raise stream_error(
                "malformed", "the reply is not a JSON object", provider=self.name, model=model
            )
        error = data.get("error")
        if error:  # a 200 whose body is an error (OpenRouter's, when the model behind it fails)
            raise classify_stream_error(
                error, provider=self.name, model=model, classes=self._wire.errors
            )
        try:
            text, thinking, calls, finish, usage = self._wire.response(data)
        except _SHAPE_ERRORS:
            raise self._misshapen(model) from None
        return ProviderResponse(
            provider=self.name,
            model=model,
            text=text,
            thinking=thinking,
            tool_calls=calls,
            finish_reason=finish,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
        )


def _media_type(content_type: str) -> str:
    """What an error may say of a reply's Content-Type: its bare media type when that is
    a plain ``type/subtype`` token; the header's full text (a proxy may reflect the
    request's headers into it) never."""
    if not content_type:
        return "nothing"
    bare = content_type.partition(";")[0].strip().lower()
    return bare if _MEDIA_TYPE.fullmatch(bare) else "another content type"


def _cause(exc: httpx.RequestError) -> BaseException | None:
    """What a request's ProviderError is chained to: the transport error (its traceback
    helps), except a protocol error. A request httpx refused to send quotes the header
    value it refused (the API key's, maybe); a response it could not parse quotes the
    server's bytes, which a proxy may have filled with the request's own headers."""
    return None if isinstance(exc, httpx.ProtocolError) else exc


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what little follows the final event (the body's end), briefly and boundedly,
    so the connection goes back to the pool instead of being closed: the next call then
    skips a TCP (and TLS) handshake. A server that holds the body open loses only this,
    and so does one that breaks the connection after its final event (a reset, a chunked
    body without its last chunk): the reply is whole, only the connection is not kept."""
    seen = 0
    with anyio.move_on_after(_DRAIN_SECONDS):
        try:
            async for chunk in chunks:
                seen += len(chunk)
                if seen > _DRAIN_LIMIT:
                    return
        except httpx.RequestError:
            return


class Accumulator:
    """Builds the whole reply from stream events (tool-call arguments joined per index)."""

    def __init__(self, provider: str, model: str) -> None:
        self.provider = provider
        self.model = model
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: dict[int, list[str]] = {}
        self.finish: str | None = None
        self.input_tokens = 0
        self.output_tokens = 0

    def add(self, event: StreamEvent) -> None:
        match event:
            case TextDelta():
                self.text.append(event.text)
            case ThinkingDelta():
                self.thinking.append(event.text)
            case ToolCallDelta():
                parts = self.calls.setdefault(event.index, ["", "", ""])
                parts[0] = event.id or parts[0]
                parts[1] = event.name or parts[1]
                parts[2] += event.arguments
            case Usage():
                self.input_tokens = max(self.input_tokens, event.input_tokens)
                self.output_tokens = max(self.output_tokens, event.output_tokens)
            case Done():
                self.finish = event.finish_reason

    def response(self) -> ProviderResponse:
        calls = tuple(
            ToolCall(id=parts[0], name=parts[1], arguments=parts[2] or "{}")
            for _, parts in sorted(self.calls.items())
        )
        return ProviderResponse(
            provider=self.provider,
            model=self.model,
            text="".join(self.text),
            thinking="".join(self.thinking),
            tool_calls=calls,
            finish_reason=self.finish or "stop",
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
        )
