"""A real HTTP server on 127.0.0.1 that speaks both wire protocols and plays a script.

One port serves OpenAI Chat Completions (``POST /v1/chat/completions``) and Anthropic
Messages (``POST /v1/messages``), streamed or not, so a config can point any provider at
``fake.base_url``. Each request takes its step from the script and is recorded: what was
asked, which step played, how many deltas went out, and how it ended. ``outcome ==
"client_closed"`` is how a test proves that an aborted call really closed its socket.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from stalwart._logs import get_logger
from stalwart.clock import Clock, SystemClock

from ._frames import Frames, error_body, frames_for
from ._script import (
    Answer,
    Cut,
    ErrorEvent,
    Fail,
    Hang,
    Malformed,
    Reset,
    Script,
    Stall,
    Step,
    Trickle,
    Truncated,
    WrongContentType,
)

__all__ = ["FakeProvider", "RecordedRequest"]

log = get_logger(__name__)

Outcome = Literal[
    "running", "completed", "client_closed", "server_stopped", "reset", "rejected", "error"
]
_WATCH_SLICE = 0.02
_WORDS = re.compile(r"\S+\s*|\s+")


class RecordedRequest(msgspec.Struct, kw_only=True):
    """One request the fake provider received, and what became of it."""

    index: int
    api: Literal["openai", "anthropic"]
    model: str
    stream: bool
    body: dict[str, Any]
    action: str
    authorized: bool
    started_at: float
    finished_at: float | None = None
    outcome: Outcome = "running"
    status: int = 200
    deltas_sent: int = 0
    client_port: int = 0
    """The client's port: two requests with the same one shared a kept-alive connection."""


class _ClientGone(Exception):
    """The client closed its side, or the server is stopping."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _pieces(text: str, chunks: int) -> list[str]:
    if not text:
        return []
    if chunks <= 0:
        return _WORDS.findall(text)
    size = max(1, -(-len(text) // chunks))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _prefix(text: str, count: int) -> list[str]:
    """``count`` deltas taken from ``text`` word by word (repeating it if needed)."""
    words = _pieces(text, 0) or ["."]
    return [words[i % len(words)] for i in range(count)]


class _Server(ThreadingHTTPServer):
    """Serves each connection on a thread of its own, and knows them all: a stopped
    server closes every connection still open (a kept-alive one too), so nothing it
    served outlives :meth:`FakeProvider.stop`."""

    daemon_threads = True
    allow_reuse_address = True
    #: the listen backlog: a provider pool opens up to ``max_in_flight`` (64) connections
    #: at once, and socketserver's 5 reset some of a burst (the kernel caps it at somaxconn)
    request_queue_size = 1024
    fake: FakeProvider

    def __init__(self, address: tuple[str, int], handler: type[_Handler]) -> None:
        super().__init__(address, handler)
        self._open_lock = threading.Lock()
        self._open: dict[socket.socket, threading.Thread] = {}

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets an idle kept-alive connection is normal, not an error."""
        log.debug("fake_provider.connection_error", client=client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name=f"fake-provider:{self.server_address[1]}:{client_address[1]}",
            daemon=True,
        )
        with self._open_lock:
            self._open[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self, timeout: float) -> None:
        """Shut every open connection (its thread sees the client gone and ends) and wait
        up to ``timeout`` s for their threads. Call once the server accepts no more."""
        with self._open_lock:
            open_now = list(self._open.items())
        for connection, _ in open_now:
            with contextlib.suppress(OSError):  # already closed (a reset) or gone
                connection.shutdown(socket.SHUT_RDWR)
        clock = SystemClock()  # a bound in real time, whatever clock the fake plays on
        deadline = clock.monotonic() + timeout
        for _, thread in open_now:
            thread.join(max(deadline - clock.monotonic(), 0))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as real servers do: small frames go out at once
    server: _Server
    record: RecordedRequest

    # -- plumbing ---------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: requests are recorded, not printed (headers may hold keys)."""

    def finish(self) -> None:
        with contextlib.suppress(OSError):  # reset on purpose, or the client left
            super().finish()

    def _send_head(self, status: int, content_type: str, length: int | None) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        if length is None:
            self.send_header("transfer-encoding", "chunked")
            self.send_header("cache-control", "no-cache")
        else:
            self.send_header("content-length", str(length))
        self.end_headers()

    def _write(self, data: bytes, *, chunked: bool = True) -> None:
        if not data:
            return
        self._watch(0)
        payload = b"%x\r\n%s\r\n" % (len(data), data) if chunked else data
        try:
            self.wfile.write(payload)
            self.wfile.flush()
        except OSError:
            raise _ClientGone("client_closed") from None

    def _end_chunks(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            raise _ClientGone("client_closed") from None

    def _watch(self, seconds: float | None) -> None:
        """Wait ``seconds`` (None: for ever) unless the client leaves or the server stops."""
        clock = self.server.fake.clock
        stopping = self.server.fake.stopping
        end = None if seconds is None else clock.monotonic() + seconds
        while True:
            if stopping.is_set():
                raise _ClientGone("server_stopped")
            remaining = _WATCH_SLICE if end is None else min(end - clock.monotonic(), 0.05)
            readable, _, _ = select.select([self.connection], [], [], max(remaining, 0))
            if readable:
                try:
                    peek = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    raise _ClientGone("client_closed") from None
                if not peek:
                    raise _ClientGone("client_closed")
                stopping.wait(_WATCH_SLICE)  # the client sent more: keep watching
            if end is not None and clock.monotonic() >= end:
                return

    def _reset(self) -> None:
        """Close with a TCP RST: the client sees 'connection reset by peer'."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()
        raise _ClientGone("reset")

    # -- requests ---------------------------------------------------------------------

    def do_GET(self) -> None:
        body = b'{"status":"ok"}'
        self._send_head(200, "application/json", len(body))
        self.wfile.write(body)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        api: Literal["openai", "anthropic"] | None = (
            "openai"
            if path.endswith("/chat/completions")
            else "anthropic"
            if path.endswith("/messages")
            else None
        )
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        if api is None or not isinstance(body, dict):
            status = 404 if api is None else 400
            self._plain_error(status, api or "openai", "invalid_request_error")
            return
        fake = self.server.fake
        self.record = fake._begin(api, body, self._authorized(api), self.client_address[1])
        try:
            self._play(api)
            fake._end(self.record, "completed" if self.record.status < 400 else "rejected")
        except _ClientGone as gone:
            self.close_connection = True
            stopped = gone.outcome == "client_closed" and fake.stopping.is_set()
            fake._end(self.record, "server_stopped" if stopped else gone.outcome)
        except Exception:  # a bug in a step must not leave its request "running"
            self.close_connection = True
            fake._end(self.record, "error")
            log.exception("fake_provider.step_failed", index=self.record.index)

    def _play(self, api: str) -> None:
        if not self.record.authorized:  # a refused request does not use up a step
            self.record.action = "unauthorized"
            self._plain_error(401, api, None)
            return
        step = self.server.fake._take(self.record)
        frames = frames_for(api, self.record.model, f"{self.record.index:06d}")
        if self.record.stream:
            self._stream(step, frames)
        else:
            self._complete(step, frames)

    def _authorized(self, api: str) -> bool:
        key = self.server.fake.api_key
        if key is None:
            return True
        if api == "anthropic":
            return self.headers.get("x-api-key") == key
        return self.headers.get("authorization") == f"Bearer {key}"

    def _plain_error(self, status: int, api: str, error_type: str | None) -> None:
        body = error_body(api, status, error_type)
        if hasattr(self, "record"):
            self.record.status = status
        self._send_head(status, "application/json", len(body))
        self._write(body, chunked=False)

    # -- streamed replies -------------------------------------------------------------

    def _delta(self, frames: Frames, text: str, delay_ms: int) -> None:
        if self.record.deltas_sent and delay_ms:
            self._watch(delay_ms / 1000)
        self._write(frames.text(text))
        self.server.fake._sent(self.record)

    def _stream(self, step: Step, frames: Frames) -> None:
        if isinstance(step, Hang):
            self._watch(None)
        if isinstance(step, Fail):
            self._fail(step)
            return
        if isinstance(step, WrongContentType):
            page = b"<html><body>Please sign in to the network.</body></html>"
            self._send_head(200, step.content_type, len(page))
            self._write(page, chunked=False)
            return
        self._send_head(200, "text/event-stream", None)
        self._write(frames.open(step.input_tokens if isinstance(step, Answer) else 12))
        match step:
            case Answer():
                self._answer(step, frames)
            case Trickle():
                while True:
                    self._delta(frames, step.text, step.interval_ms)
            case Stall() | Reset() | Cut() | Malformed() | Truncated() | ErrorEvent():
                for text in _prefix(step.text, step.after_deltas):
                    self._delta(frames, text, step.delay_ms)
                self._break_stream(step, frames)
        self._end_chunks()

    def _answer(self, step: Answer, frames: Frames) -> None:
        if step.first_delay_ms:
            self._watch(step.first_delay_ms / 1000)
        for piece in _pieces(step.thinking, 0):
            self._write(frames.thinking(piece))
            self.server.fake._sent(self.record)
        for piece in _pieces(step.text, step.chunks):
            self._delta(frames, piece, step.delay_ms)
        if step.tool_calls:
            self._write(frames.tool_calls(step.tool_calls))
        finish = step.finish_reason
        if finish is None and step.tool_calls:
            finish = "tool_use" if self.record.api == "anthropic" else "tool_calls"
        self._write(frames.close(finish, step.input_tokens, _output_tokens(step)))

    def _break_stream(self, step: Step, frames: Frames) -> None:
        match step:
            case Stall():
                self._watch(None)
            case Reset():
                self._reset()
            case Cut():
                if step.mid_frame:
                    self._write(b'data: {"partial":')
            case Malformed():
                self._write(b"data: this is not json at all\n\n")
            case Truncated():
                self._write(frames.truncated())
            case ErrorEvent():
                self._write(frames.error(step.error_type))

    def _fail(self, step: Fail) -> None:
        api = self.record.api
        body = step.body.encode() if step.body is not None else None
        body = body if body is not None else error_body(api, step.status, step.error_type)
        self.record.status = step.status
        self.send_response(step.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if step.retry_after is not None:
            self.send_header("retry-after", step.retry_after)
        self.end_headers()
        self._write(body, chunked=False)

    # -- whole replies ----------------------------------------------------------------

    def _complete(self, step: Step, frames: Frames) -> None:
        match step:
            case Answer():
                if step.first_delay_ms:
                    self._watch(step.first_delay_ms / 1000)
                body = json.dumps(frames.complete(step, _output_tokens(step))).encode()
                self._send_head(200, "application/json", len(body))
                self._write(body, chunked=False)
            case Fail():
                self._fail(step)
            case ErrorEvent():
                status = 529 if self.record.api == "anthropic" else 500
                self._fail(Fail(status=status, error_type=step.error_type))
            case Hang() | Stall() | Trickle():
                self._watch(None)
            case Reset():
                self._reset()
            case Cut() | Truncated():
                whole = json.dumps(frames.complete(Answer(text=step.text), 1)).encode()
                length = len(whole) if isinstance(step, Cut) else len(whole) // 2
                self._send_head(200, "application/json", length)
                self._write(whole[: len(whole) // 2], chunked=False)
                if isinstance(step, Cut):  # a clean close before the promised length
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_WR)
            case Malformed():
                page = b"this is not json at all"
                self._send_head(200, "application/json", len(page))
                self._write(page, chunked=False)
            case WrongContentType():
                page = b"<html><body>Please sign in to the network.</body></html>"
                self._send_head(200, step.content_type, len(page))
                self._write(page, chunked=False)


def _output_tokens(step: Answer) -> int:
    if step.output_tokens is not None:
        return step.output_tokens
    return len(_pieces(step.text, 0)) + len(_pieces(step.thinking, 0))


class FakeProvider:
    """A fault-injecting provider on 127.0.0.1; use it as a context manager.

    >>> with FakeProvider([Stall(after_deltas=2)]) as fake:  # doctest: +SKIP
    ...     config = {"kind": "openai", "base_url": fake.base_url}

    ``api_key``, when given, must be sent (``Authorization: Bearer`` for OpenAI,
    ``x-api-key`` for Anthropic) or the request gets a 401.
    """

    def __init__(
        self,
        script: Script | Iterable[Step] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        clock: Clock | None = None,
    ) -> None:
        if script is None:
            script = Script()
        elif not isinstance(script, Script):
            script = Script(steps=tuple(script))
        self.clock = clock or SystemClock()
        self.api_key = api_key
        self.stopping = threading.Event()
        self._host, self._port = host, port
        self._default: Step = script.default
        self._steps: list[Step] = list(script.steps)
        self._left: list[int | None] = [step.times or None for step in self._steps]
        self._requests: list[RecordedRequest] = []
        self._changed = threading.Condition()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"FakeProvider(url={self.url!r}, requests={len(self._requests)})"

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> FakeProvider:
        self.stopping.clear()
        server = _Server((self._host, self._port), _Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.name = f"fake-provider:{server.server_address[1]}"
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; requests still running end as ``server_stopped``, and every
        connection still open (a client's kept-alive one too) is closed: the client's
        next request finds no server, as with a real one that went away."""
        self.stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.close_connections(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake provider is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}" if self._server else "(not started)"

    @property
    def base_url(self) -> str:
        """The ``base_url`` for either provider kind."""
        return f"{self.url}/v1"

    # -- the script ---------------------------------------------------------------------

    def add(self, *steps: Step) -> None:
        """Offer more steps, after those already in the script."""
        with self._changed:
            self._steps.extend(steps)
            self._left.extend(step.times or None for step in steps)

    def set_default(self, step: Step) -> None:
        with self._changed:
            self._default = step

    def _take(self, record: RecordedRequest) -> Step:
        """The first matching step with uses left (and use it), else the default."""
        with self._changed:
            step = self._default
            for index, candidate in enumerate(self._steps):
                left = self._left[index]
                if (left is None or left > 0) and candidate.matches(record.api, record.model):
                    if left is not None:
                        self._left[index] = left - 1
                    step = candidate
                    break
            record.action = str(step.__struct_config__.tag)
            return step

    # -- the record -----------------------------------------------------------------------

    def _begin(
        self, api: Any, body: dict[str, Any], authorized: bool, client_port: int
    ) -> RecordedRequest:
        with self._changed:
            record = RecordedRequest(
                index=len(self._requests),
                api=api,
                model=str(body.get("model", "")),
                stream=bool(body.get("stream")),
                body=body,
                action="",
                authorized=authorized,
                started_at=self.clock.now(),
                client_port=client_port,
            )
            self._requests.append(record)
            self._changed.notify_all()
        log.debug("fake_provider.request", index=record.index, api=api, model=record.model)
        return record

    def _sent(self, record: RecordedRequest) -> None:
        with self._changed:
            record.deltas_sent += 1
            self._changed.notify_all()

    def _end(self, record: RecordedRequest, outcome: Outcome) -> None:
        with self._changed:
            record.outcome = outcome
            record.finished_at = self.clock.now()
            self._changed.notify_all()
        log.debug("fake_provider.done", index=record.index, outcome=outcome)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Copies of every request so far, in arrival order.

        A request's ``outcome`` is set just after its reply is written, so a client can
        hold the whole reply while it still says ``running``: wait with
        :meth:`wait_finished` or :meth:`wait_for` before asserting on it.
        """
        with self._changed:
            return [msgspec.structs.replace(r) for r in self._requests]

    def wait_for(
        self, predicate: Callable[[list[RecordedRequest]], bool], timeout: float = 5.0
    ) -> list[RecordedRequest]:
        """Block until ``predicate(requests)`` holds; TimeoutError after ``timeout`` s."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self._requests), timeout):
                raise TimeoutError(f"the fake provider did not reach the state in {timeout} s")
            return [msgspec.structs.replace(r) for r in self._requests]

    def wait_finished(self, index: int, timeout: float = 5.0) -> RecordedRequest:
        """The ``index``-th request once it has ended (completed, closed, reset...)."""

        def ended(requests: list[RecordedRequest]) -> bool:
            return len(requests) > index and requests[index].outcome != "running"

        return self.wait_for(ended, timeout)[index]
