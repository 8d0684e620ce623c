"""Review (session 32): the provider layer against a misbehaving provider, over real HTTP.

Every test drives the real ``ProviderClient`` / ``ModelCaller`` (through the runtime's
``ProviderLayer``) against a server on 127.0.0.1: the raw-socket server of the second
review, which writes exactly the bytes a test needs, or the ``FakeProvider``. The log is a
real LMDB store in ``tmp_path``; deadlines run on a ``FakeClock`` through a real
``Scheduler`` and ``IoPortal`` where a test needs to move time. Nothing of stalwart is
mocked. Tests marked ``# Was: DEFECT:`` failed on the code as reviewed, before their fixes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest

from stalwart.actors import IoPortal, Scheduler, clock_timer
from stalwart.cli._replay import verify_store
from stalwart.clock import FakeClock
from stalwart.errors import ProviderError
from stalwart.events import PromptCompleted, PromptTimeout
from stalwart.providers import Done, ProviderResponse
from stalwart.runtime import ProviderLayer
from stalwart.store import EventStore
from tests import test_providers_review_two as review_two
from tests._runtime_support import GUARD, agent_settings, runtime_config
from tests.test_providers_review_two import (
    REQUEST,
    SESSION,
    SSE_HEAD,
    anthropic_text,
    call,
    config,
    failed_classes,
    openai_text,
)

#: the second review's raw-socket HTTP server (a fixture); ``store`` is conftest's
raw = review_two.raw


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def session_events(store: EventStore, stream: str = SESSION) -> list[Any]:
    return [r.event for r in store.read_stream(stream)]


def held_open(head: bytes, body: bytes, seconds: float = GUARD) -> Callable[[socket.socket], None]:
    """Headers and ``body``, then the body held open (no end) until the client leaves."""

    def handle(conn: socket.socket) -> None:
        conn.sendall(head + body)
        conn.settimeout(0.05)
        end = time.monotonic() + seconds  # real-time: only bounds a client that never leaves
        while time.monotonic() < end:
            try:
                if not conn.recv(1):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    return handle


@pytest.fixture
def on_the_clock(
    clock: FakeClock, store: EventStore
) -> Iterator[Callable[[Any, Any], ProviderResponse | BaseException]]:
    """Run one call of a ``ProviderLayer`` on the portal, its deadlines on ``clock``:
    ``run(config, on_event)`` returns the reply, or what the call raised."""
    with IoPortal() as portal, Scheduler(clock) as scheduler:
        layers: list[ProviderLayer] = []

        def run(cfg: Any, on_event: Any = None) -> ProviderResponse | BaseException:
            layer = ProviderLayer(cfg, store, clock=clock)
            layers.append(layer)
            caller = layer.caller(timer=partial(clock_timer, portal, scheduler, clock))
            future = portal.submit(partial(caller.call, on_event=on_event), SESSION, REQUEST)
            try:
                return future.result(GUARD)
            except Exception as exc:
                return exc

        try:
            yield run
        finally:
            for layer in layers:
                portal.submit(layer.aclose).result(GUARD)


# -- a complete answer and the deadline that passes while the connection is drained ------


# Was: DEFECT: an answer whole before its deadline was dropped as a stall cut in the 50 ms drain
def test_an_answer_complete_before_its_deadline_survives_the_deadline_passing_in_the_drain(
    raw: Any, store: EventStore, clock: FakeClock, on_the_clock: Any
) -> None:
    """The provider sends the whole answer and its ``[DONE]``, then keeps the body open
    (a proxy that holds the chunked body's end back). The caller reads on for at most
    50 ms to give the connection back to the pool; the stall budget passes in that
    time. The answer was complete before the budget ran out: it is the reply, recorded
    as ``prompt:completed``, with no ``execution:prompt_timeout``, and the log
    verifies. Before, the cut of the drain threw the answer away as a stall."""
    server = raw([held_open(SSE_HEAD, openai_text("all ", "done"))])
    cfg = runtime_config(server.base_url, agents={"default": agent_settings(60_000)})

    def on_event(event: object) -> None:
        if isinstance(event, Done):  # the answer is whole; the budget runs out now
            clock.advance(61)

    reply = on_the_clock(cfg, on_event)
    assert isinstance(reply, ProviderResponse), reply
    assert reply.text == "all done"
    events = session_events(store)
    assert [e for e in events if isinstance(e, PromptTimeout)] == []
    assert [type(e) for e in events if isinstance(e, PromptCompleted)] == [PromptCompleted]
    assert [(f.kind, f.tag) for f in verify_store(store, None).findings] == []


CHUNKED_SSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


def closed_without_last_chunk(body: bytes) -> Callable[[socket.socket], None]:
    """A chunked event stream whose body is closed (FIN) before its last, empty chunk."""

    def handle(conn: socket.socket) -> None:
        conn.sendall(CHUNKED_SSE + chunked(body))
        conn.shutdown(socket.SHUT_WR)

    return handle


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["openai", "anthropic"])
# Was: DEFECT: a connection broken after the final event dropped the whole answer and asked again
async def test_a_connection_broken_after_the_final_event_keeps_the_answer(
    api: str, raw: Any, store: EventStore
) -> None:
    """The provider (or a proxy before it) sends the whole answer and its final event,
    then closes the connection without the chunked body's last chunk. The answer is
    whole: it is the reply, after one request, and nothing failed."""
    body = openai_text("all ", "done") if api == "openai" else anthropic_text("all ", "done")
    server = raw([closed_without_last_chunk(body)])
    reply = await call(config(server.base_url, api), store)
    assert isinstance(reply, ProviderResponse), reply
    assert reply.text == "all done"
    assert failed_classes(store) == []
    assert len(server.heads) == 1


# -- an error status whose body stalls or breaks off ------------------------------------


def error_status_then(end: str) -> Callable[[socket.socket], None]:
    """A 503 (chunked) whose body begins, then stalls (``end="stalls"``) until the
    client leaves, or is closed before its end (``"breaks"``)."""
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunked(b'{"error": {"type": "ser')
    )
    if end == "stalls":
        return held_open(head, b"")

    def breaks(conn: socket.socket) -> None:
        conn.sendall(head)
        conn.shutdown(socket.SHUT_WR)

    return breaks


@pytest.mark.anyio
@pytest.mark.parametrize("end", ["stalls", "breaks"])
# Was: DEFECT: a 503 with a stalled/cut body failed late as timeout_stall, or as stream_cut
async def test_an_error_status_is_its_own_class_whatever_its_body_does(
    end: str, raw: Any, store: EventStore
) -> None:
    """The status line says 503 at once; the body (read only to tell a 4xx apart)
    stalls, or is cut. The call fails as ``unavailable`` within about a second, not
    after the 5 s stall budget as a ``timeout_stall``, nor as a ``stream_cut``."""
    server = raw([error_status_then(end)])
    begun = time.monotonic()
    reply = await call(config(server.base_url, prompt_timeout_ms=5_000, max_retries=0), store)
    took = time.monotonic() - begun  # real-time: the bound on an error's body is real time
    assert isinstance(reply, ProviderError), reply
    assert failed_classes(store) == ["unavailable"]
    assert took < 4.5, took
