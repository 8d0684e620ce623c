"""Second review of the channels: defects, each proven by a test, and the paths the
review checked that hold (a send cut by a crash, a batch split across channels).

Real parts only: a real HTTP receiver on 127.0.0.1 (tests/test_channels.py's), real
streams (a pipe, a text wrapper over bytes), real LMDB stores in tmp_path, the loopback
fake provider, a real child process killed with SIGKILL, FakeClocks for every deadline.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import pytest

from stalwart.actors import RunReport
from stalwart.channels import ConsoleChannel, MemoryChannel, OutboundMessage
from stalwart.clock import FakeClock
from stalwart.errors import ChannelError
from stalwart.events import (
    AnnouncementDeadLettered,
    AnnouncementDeadLetterExpired,
    AnnouncementDelivered,
    AnnouncementQueued,
    AnnouncementResent,
    AnnouncementSendFailed,
)
from stalwart.runtime import Runtime
from stalwart.store import EventStore
from stalwart.testing import FakeProvider
from tests._runtime_support import (
    GUARD,
    advance_until,
    delivered,
    has,
    in_flight_s,
    log_until,
    of,
    reap,
    runtime_config,
    sigkill,
)
from tests.test_channels import Receiver, send, webhook


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hook() -> Iterator[Receiver]:
    """tests/test_channels.py's receiver: 200 to every POST, each request recorded."""
    made = Receiver()
    try:
        yield made
    finally:
        made.close()


def message(text: str = "hello", **fields: Any) -> OutboundMessage:
    return OutboundMessage(
        **{"conversation": "c1", "text": text, "idempotency_key": "k-1"} | fields
    )


# -- the console channel ---------------------------------------------------------------------


class StuckStream(io.StringIO):
    """A stream whose writes wait until ``free`` is set, as a pipe nobody reads (or a
    terminal paused with Ctrl-S) does once its buffer is full. ``entered`` is set when a
    write begins; ``free`` is set by a guard timer at the latest, so a test that fails
    does not hang."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.free = threading.Event()
        self._guard = threading.Timer(GUARD, self.free.set)
        self._guard.daemon = True
        self._guard.start()

    def write(self, text: str) -> int:
        self.entered.set()
        self.free.wait()
        return super().write(text)

    def close(self) -> None:
        self._guard.cancel()
        self.free.set()
        super().close()


@pytest.fixture
def stuck() -> Iterator[StuckStream]:
    stream = StuckStream()
    try:
        yield stream
    finally:
        stream.free.set()


# Was: DEFECT: a console stream that blocks (full pipe, Ctrl-S) held the whole event loop
@pytest.mark.anyio
async def test_a_console_whose_stream_blocks_does_not_hold_the_event_loop(
    stuck: StuckStream,
) -> None:
    """The console wrote and flushed inside ``async def send``, on the event loop's
    thread. A stream that blocks (a full pipe to a reader that stopped reading, a terminal
    paused with Ctrl-S) then held the runtime's whole loop: every model call, send and
    tool waited for it. Expected: the loop runs on while the write waits; a send cut
    while its write is under way ends when the write does, delivered (what it did)."""
    channel = ConsoleChannel(stream=stuck)
    outcomes: list[str] = []

    async def cut_while_writing(scope: anyio.CancelScope) -> None:
        with scope:
            await channel.send(message("first"))
            outcomes.append("delivered")

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as group:
        group.start_soon(cut_while_writing, scope)
        await anyio.to_thread.run_sync(stuck.entered.wait, GUARD)
        assert not stuck.free.is_set(), "the loop ran again only once the write ended"
        scope.cancel()  # the caller's deadline passes while the write waits
        stuck.free.set()
    assert outcomes == ["delivered"]
    assert stuck.getvalue() == "[c1] first\n"


# Was: DEFECT: (the same) a send queued behind a blocked console write could not be cut
@pytest.mark.anyio
async def test_console_sends_cut_behind_a_blocked_write_are_not_written_and_order_holds(
    stuck: StuckStream,
) -> None:
    """Behind a write that waits, a send cut before its turn is withdrawn (its outcome,
    ``timeout``, sends it again later: written now too, it would be shown twice), and the
    sends after keep their order."""
    channel = ConsoleChannel(stream=stuck)
    async with anyio.create_task_group() as group:
        group.start_soon(channel.send, message("first"))
        await anyio.to_thread.run_sync(stuck.entered.wait, GUARD)
        with anyio.move_on_after(0):  # cut at once: it waits for its turn
            await channel.send(message("cut"))
        stuck.free.set()
        await channel.send(message("second"))
        await channel.send(message("third"))
    assert stuck.getvalue() == "[c1] first\n[c1] second\n[c1] third\n"


# Was: DEFECT: one character the stream cannot encode lost the whole console message
@pytest.mark.anyio
async def test_a_console_writes_what_its_streams_encoding_cannot_hold_escaped() -> None:
    """A stream whose encoding cannot hold a character of the text (a log file opened as
    ASCII, a Windows pipe in cp1252, ``PYTHONIOENCODING=ascii``) raised
    UnicodeEncodeError, and the console failed the whole message as ``transport`` (not
    retryable) for one accent or emoji: the user was told nothing. A lone surrogate (text
    cut mid-pair) failed the same way on a UTF-8 stream. Expected: the message is written,
    what the stream cannot hold shown escaped, as control characters are."""
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii")
    await ConsoleChannel(stream=ascii_out).send(message("caf\u00e9 \U0001f600"))
    ascii_out.flush()
    assert raw.getvalue() == b"[c1] caf\\xe9 \\U0001f600\n"

    raw = io.BytesIO()
    utf8_out = io.TextIOWrapper(raw, encoding="utf-8")
    await ConsoleChannel(stream=utf8_out).send(message("half \ud83d pair", conversation="c\udcff"))
    utf8_out.flush()
    assert raw.getvalue() == b"[c\\udcff] half \\ud83d pair\n"


# Was: DEFECT: a console send with sys.stdout None raised AttributeError, not ChannelError
@pytest.mark.anyio
async def test_a_console_with_no_stdout_fails_as_a_channel_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process started with its stdout closed (``>&-``, some service managers) has
    ``sys.stdout`` None: the console's send raised AttributeError, which breaks the
    channel protocol (ChannelError or a Delivery) and is recorded as the error's class
    name. Expected: a ChannelError, not retryable."""
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(ChannelError) as info:
        await ConsoleChannel().send(message())
    assert (info.value.kind, info.value.retryable) == ("transport", False)


# -- the webhook channel ---------------------------------------------------------------------


# Was: DEFECT: a lone surrogate made a webhook send raise a raw UnicodeEncodeError
@pytest.mark.anyio
async def test_a_webhook_delivers_text_with_a_lone_surrogate(hook: Receiver) -> None:
    """A lone surrogate in the text, conversation, thread or key (model output cut
    mid-pair, a host's own ids from ``os.fsdecode``) made ``send`` raise a raw
    UnicodeEncodeError from the JSON encoder, against the protocol (ChannelError or a
    Delivery), and nothing was sent. Expected: delivered, each lone half replaced by
    U+FFFD; the header carries the same key as the body."""
    odd = message(
        "half \ud83d pair", conversation="c\udcff", thread="t\ud800", idempotency_key="k\udc80"
    )
    channel = webhook(hook.url)
    try:
        await send(channel, odd)
    finally:
        await channel.aclose()
    [request] = hook.requests
    body = msgspec.json.decode(request.body)
    assert body["text"] == "half \ufffd pair"
    assert (body["conversation"], body["thread"]) == ("c\ufffd", "t\ufffd")
    assert body["idempotency_key"] == "k\ufffd"
    assert request.headers["idempotency-key"] == "k%EF%BF%BD"


# Was: DEFECT: a key with a space at an end was rejected by HTTP on every (re-)send
@pytest.mark.anyio
@pytest.mark.parametrize("key", [" k-1", "k-1 "])
async def test_an_idempotency_key_with_space_at_an_end_is_delivered(
    hook: Receiver, key: str
) -> None:
    """A key that is printable ASCII went into the header as it is, but a header value
    cannot start or end with a space (h11 refuses it): the request could not be sent,
    ``rejected``, not retryable, and every re-send of the same key fails the same way, so
    the message never arrives. Expected: delivered, the key percent-encoded in the header
    and as it is in the body."""
    channel = webhook(hook.url)
    try:
        delivery = await send(channel, message(idempotency_key=key))
    finally:
        await channel.aclose()
    assert delivery.status == 200
    [request] = hook.requests
    assert msgspec.json.decode(request.body)["idempotency_key"] == key
    header = request.headers["idempotency-key"]
    assert header.strip() == header
    assert "%" in header


# -- a send cut by a crash (checked: holds; no suite test killed a process mid-send) ---------


@pytest.mark.slow
def test_an_answer_whose_send_a_sigkill_cut_is_sent_again_once_with_its_key(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A child process answers, records the answer as queued and is killed with SIGKILL
    while its send is under way (no outcome in the log). The next process on the same
    log sends it again, once its sender's send can no longer be under way, with the same
    idempotency key; later passes and a third process do not send it again."""
    directory = tmp_path / "store"
    t0 = 1_800_000_000.0
    script = Path(__file__).with_name("_channels_send_child.py")
    argv = [sys.executable, str(script), str(directory), fake.base_url, str(t0)]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        said = json.loads(child.stdout.readline() or "{}")
        assert "sending" in said, said
        sigkill(child)
    finally:
        reap(child)
    config = runtime_config(fake.base_url)
    chat = MemoryChannel("chat")
    clock = FakeClock(start=t0)
    with Runtime(config, store=directory, clock=clock, channels={"chat": chat}) as rt:
        [again] = advance_until(clock, lambda: list(chat.messages), step_s=0.5)
        assert clock.now() >= t0 + in_flight_s(config)  # not while it may be under way
        assert (again.idempotency_key, again.text) == (said["sending"], said["text"])
        records = log_until(rt.store, "session:s1", has(AnnouncementDelivered))
        clock.advance(in_flight_s(config) * 3)
        rt.session("s1", channel="chat").status(timeout=GUARD)
    later = FakeClock(start=clock.now() + 60)
    chat_later = MemoryChannel("chat")
    with Runtime(config, store=directory, clock=later, channels={"chat": chat_later}) as rt:
        rt.session("s1", channel="chat").status(timeout=GUARD)
        later.advance(in_flight_s(config) * 3)
        rt.session("s1", channel="chat").status(timeout=GUARD)
        records = list(rt.store.read_stream("session:s1"))
    assert len(chat.messages) == 1
    assert chat_later.attempted == []
    [queued] = of(AnnouncementQueued, records)
    assert queued.announcement_id == said["sending"]
    assert len(of(AnnouncementResent, records)) == 1
    assert len(of(AnnouncementDelivered, records)) == 1


# -- a batch split across channels (checked: holds) ----------------------------------------


def test_a_batch_whose_part_on_one_channel_fails_delivers_the_other_and_dead_letters_once(
    store: EventStore, clock: FakeClock, fake: FakeProvider, chat: MemoryChannel
) -> None:
    """Two completions of one parent, one for ``chat`` and one for ``ops`` (which always
    fails): the chat part is delivered, the ops part is dead-lettered, retried
    ``max_retries`` times with its own key and then expired; each run's stream holds the
    outcome of its own part only."""

    async def work(report: RunReport) -> str:
        return "the answer"

    ops = MemoryChannel("ops")
    ops.fail_next(100)
    dead = {"retry_base_ms": 1_000, "retry_cap_ms": 1_000, "max_retries": 2}
    cfg = runtime_config(fake.base_url, dead_letters=dead)
    with Runtime(cfg, store=store, clock=clock, channels={"chat": chat, "ops": ops}) as rt:
        rt.session("p1", channel="chat", conversation="room")
        to_chat = rt.spawn("p1", "a", task_class="research", work=work)
        to_ops = rt.spawn("p1", "b", task_class="research", work=work, channel="ops")
        assert to_chat.result(GUARD).outcome == to_ops.result(GUARD).outcome == "succeeded"
        clock.advance(rt.config.subagents.announce_debounce_ms / 1000 + 0.01)
        [sent] = delivered(rt, chat, 1)
        log_until(store, "deadletter", has(AnnouncementDeadLettered))
        advance_until(clock, lambda: len(ops.attempted) >= 3, step_s=0.5)
        queue = log_until(store, "deadletter", has(AnnouncementDeadLetterExpired))
        chat_run = list(store.read_stream(f"session:{to_chat.run_id}"))
        ops_run = list(store.read_stream(f"session:{to_ops.run_id}"))
    [expired] = of(AnnouncementDeadLetterExpired, queue)
    assert (expired.reason, expired.attempts) == ("retries_exhausted", 2)
    assert len({m.idempotency_key for m in ops.attempted}) == 1
    assert len(ops.attempted) == 3
    assert len(chat.attempted) == 1
    assert of(AnnouncementDelivered, chat_run)[0].announcement_id == sent.idempotency_key
    assert of(AnnouncementSendFailed, chat_run) == []
    assert of(AnnouncementDelivered, ops_run) == []
    [failed] = of(AnnouncementSendFailed, ops_run)
    assert failed.announcement_id == ops.attempted[0].idempotency_key
